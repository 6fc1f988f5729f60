"""The save-dir as the trainer uses it: a folder per run by default, --overwrite keeping the old run aside until
the new one has saved, and a stop during evaluation that saves promptly and resumes to the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from conftest import REPO, RUN_TIMEOUT, TINY, assert_ok, cli_command, cli_env, run_cli
from multigpu import checkpoint
from multigpu.faults import FAULT_ENV

QUICK = [*TINY, "--model", "mlp", "--mode", "flatten", "--epochs", "1"]


def test_without_save_dir_each_run_gets_its_own_folder_and_resume_auto_continues_the_newest(tmp_path):
    first, second = run_cli(QUICK, cwd=tmp_path), run_cli(QUICK, cwd=tmp_path)  # README's first command, twice
    assert_ok(first)
    assert_ok(second)
    # Said in the first lines (after the model line), before anything is trained.
    assert "--save-dir not given: this run writes to checkpoints/run-1" in "".join(first.stdout.splitlines()[:2])
    assert "checkpoints/run-2" in "".join(second.stdout.splitlines()[:2])
    runs = tmp_path / "checkpoints"
    assert all((runs / run / name).exists() for run in ("run-1", "run-2") for name in ("last.pt", "best.pt", "tb"))
    resumed = run_cli([*QUICK[:-1], "2", "--resume", "auto"], cwd=tmp_path)
    assert_ok(resumed)
    assert "continuing the newest run folder checkpoints/run-2" in resumed.stdout
    assert "resumed from checkpoints/run-2/last.pt" in resumed.stdout
    assert checkpoint.load(str(runs / "run-2" / "last.pt"))["epoch"] == 2
    assert checkpoint.load(str(runs / "run-1" / "last.pt"))["epoch"] == 1  # the other run is untouched


def test_overwrite_keeps_the_old_best_until_the_new_run_has_saved(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert_ok(run_cli([*QUICK, "--save-dir", str(save_dir)]))
    old_best = (save_dir / "best.pt").read_bytes()
    # Killed before its first checkpoint: the old run's files are kept aside, not deleted.
    killed = run_cli([*QUICK, "--save-dir", str(save_dir), "--overwrite"], env={FAULT_ENV: "0:3"})
    assert killed.returncode == -9 and not (save_dir / "best.pt").exists()
    (kept,) = save_dir.glob(".replaced-*")
    assert (kept / "best.pt").read_bytes() == old_best and (kept / "tb").is_dir()
    finished = run_cli([*QUICK, "--save-dir", str(save_dir), "--overwrite"])
    assert_ok(finished)
    assert (save_dir / "best.pt").read_bytes() != old_best
    assert [p.name for p in save_dir.glob(".replaced-*")] == [kept.name]  # this run's own copy went at its save


# A user's script whose validation set sends SIGTERM to torchrun while rank 0 evaluates epoch 1 (once).
STOPPED_IN_EVALUATION = '''
import os, signal, sys, torch
from torch.utils.data import TensorDataset
from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer

class Validation(TensorDataset):
    def __getitem__(self, index):
        marker = sys.argv[1]
        if os.environ["RANK"] == "0" and index == 40 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun passes it to every worker
        return super().__getitem__(index)

def train(argv):
    config = parse_config(argv)
    data = torch.randn(640, 16, generator=torch.Generator().manual_seed(0))
    targets = (data[:, 0] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    with MultiGPUTrainer(model, TensorDataset(data[:128], targets[:128]), Validation(data[128:], targets[128:]),
                         config) as trainer:
        trainer.fit()

sys.exit(main_guarded(train, sys.argv[2:]))
'''


def test_a_stop_during_evaluation_saves_at_once_and_resumes_to_the_same_weights(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STOPPED_IN_EVALUATION)
    args = ["--batch-size", "8", "--eval-batch-size", "4", "--epochs", "2", "--no-progress", "--dist-timeout", "60"]

    def start(marker: str, save_dir: Path) -> subprocess.Popen:
        return subprocess.Popen(cli_command([marker, *args, "--save-dir", str(save_dir)], nproc=2, script=script),
                                cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    whole = start("/dev/null", tmp_path / "whole")  # the marker exists: never stopped
    assert whole.wait(RUN_TIMEOUT) == 0, whole.stdout.read()
    # Through the launcher's torchrun (multigpu/torchrun.py), whose exit status is the workers'.
    stopped = subprocess.Popen([sys.executable, str(REPO / "multigpu" / "torchrun.py"), "--log-file",
                                str(tmp_path / "torchrun.log"), "--standalone", "--nproc_per_node=2", str(script),
                                str(tmp_path / "marker"), *args, "--save-dir", str(tmp_path / "stopped")],
                               cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, signalled = [], None
    for line in stopped.stdout:
        output.append(line)
        if line.startswith("epoch 1/2") and signalled is None:
            break  # never reached: evaluation of epoch 1 is where the stop comes
        if "stopped by SIGTERM" in line:
            signalled = line
    text = "".join(output)
    assert stopped.wait(RUN_TIMEOUT) == 0, text  # a clean stop: exit 0 through the launcher's torchrun
    assert signalled and "at step 8;" in signalled, text  # 128 samples / (2 x 8): the end of epoch 1
    state = checkpoint.load(str(tmp_path / "stopped" / "last.pt"))
    assert (state["epoch"], state["evaluated"], state["metrics"]) == (1, False, {})
    resumed = subprocess.run(cli_command([str(tmp_path / "marker"), *args, "--save-dir", str(tmp_path / "stopped"),
                                          "--resume", "auto"], nproc=2, script=script), cwd=REPO, env=cli_env(),
                             capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert_ok(resumed)
    assert "epoch 1/2: val loss" in resumed.stdout  # the interrupted evaluation runs first
    ours, theirs = (checkpoint.load(str(tmp_path / run / "last.pt")) for run in ("stopped", "whole"))
    assert ours["metrics"] == theirs["metrics"] and ours["best_value"] == theirs["best_value"]
    for key, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][key], tensor), key
