"""The save-dir as the trainer uses it: a folder per run by default, --overwrite keeping the old run aside until
the new one has saved (and putting it back when the new one ends before), and a stop during evaluation that saves
promptly and resumes to the same weights."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import main_multi_gpu
from conftest import (
    REPO,
    RUN_TIMEOUT,
    TINY,
    as_a_fresh_process,
    assert_ok,
    assert_untouched,
    blobs,
    cli_command,
    cli_env,
    config_for,
    contents,
    image_folder,
    preloaded_context,
    run_cli_forked,
    run_ranks,
    tiny_model,
)
from multigpu.checkpoints import checkpoint
from multigpu.errors import TrainingStopped, UsageError
from multigpu.resilience.faults import FAULT_ENV
from train_multi_gpu import MultiGPUTrainer

QUICK = [*TINY, "--model", "mlp", "--mode", "flatten", "--epochs", "1"]


@pytest.mark.slow
def test_without_save_dir_each_run_gets_its_own_folder_and_resume_auto_continues_the_newest_with_its_settings(
    tmp_path,
):
    # README's first command, then one with another LR.
    first = run_cli_forked(QUICK, cwd=tmp_path)
    second = run_cli_forked([*QUICK, "--lr", "0.01"], cwd=tmp_path)
    assert_ok(first)
    assert_ok(second)
    # Said in the first lines (after the model line), before anything is trained.
    assert "--save-dir not given: this run writes to checkpoints/run-1" in "".join(
        first.stdout.splitlines()[:2]
    )
    assert "checkpoints/run-2" in "".join(second.stdout.splitlines()[:2])
    runs = tmp_path / "checkpoints"
    assert all(
        (runs / run / name).exists() for run in ("run-1", "run-2") for name in ("last.pt", "best.pt", "tb")
    )
    other = contents(runs / "run-2")
    resumed = run_cli_forked(
        [*QUICK[:-1], "2", "--resume", "auto"], cwd=tmp_path
    )  # run-1's command, 2 epochs in all
    assert_ok(resumed)
    assert (
        "--save-dir not given: continuing checkpoints/run-1, the newest run with these settings "
        "(checkpoints/run-2 has other settings)"
    ) in resumed.stdout
    assert "resumed from checkpoints/run-1/last.pt" in resumed.stdout
    assert checkpoint.load(str(runs / "run-1" / "last.pt"))["epoch"] == 2
    assert contents(runs / "run-2") == other  # the other run is untouched


@pytest.mark.slow
def test_an_overwrite_run_sigkilled_before_its_first_save_is_put_back_by_the_next_start(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert_ok(run_cli_forked([*QUICK, "--save-dir", str(save_dir)]))
    before = contents(save_dir)
    killed = run_cli_forked([*QUICK, "--save-dir", str(save_dir), "--overwrite"], env={FAULT_ENV: "0:3"})
    assert killed.returncode == -9 and not (save_dir / "best.pt").exists()
    (kept,) = save_dir.glob(".replaced-*")  # what the killed run set aside: nothing could put it back
    # The next start puts it back before anything else, and --resume auto continues the old run (here finished).
    assert main_multi_gpu.main([*QUICK, "--save-dir", str(save_dir), "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert (
        f"--save-dir {save_dir}: put the previous run's files back from {kept}, where an --overwrite run that "
        f"ended before its first checkpoint had left them" in out
    )
    assert f"run in {save_dir} is already complete: 1 epochs, best val_acc " in out
    assert_untouched(save_dir, before)
    # An --overwrite run that saves drops its own set-aside copy.
    assert main_multi_gpu.main([*QUICK, "--save-dir", str(save_dir), "--overwrite", "--seed", "1"]) == 0
    assert (
        not list(save_dir.glob(".replaced-*"))
        and (save_dir / "best.pt").read_bytes() != before[Path("best.pt")]
    )


# ---------------------------------------------------------------- --overwrite that ends before its first save
@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save-dir of a finished one-epoch run: last.pt, best.pt and tb/."""
    save_dir = tmp_path_factory.mktemp("finished") / "ckpt"
    MultiGPUTrainer(
        tiny_model(), blobs(64, 0), blobs(32, 1), config_for(save_dir, 1, save_dir=str(save_dir), epochs=1)
    ).fit()
    return save_dir


@pytest.fixture
def previous(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run's save-dir, for one test."""
    shutil.copytree(finished, tmp_path / "ckpt")
    return tmp_path / "ckpt"


OVERWRITE_DATA = blobs(64, 0)


def overwrite_run(
    save_dir: Path, data: Dataset = OVERWRITE_DATA, world_size: int = 1, **changes
) -> MultiGPUTrainer:
    """A fresh run over the previous one: 8 steps an epoch, the first checkpoint at the end of the epoch."""
    config = config_for(save_dir, world_size, save_dir=str(save_dir), overwrite=True, **changes)
    return MultiGPUTrainer(tiny_model(), data, blobs(32, 1), config)


def nonfinite_at_step_1(save_dir: Path) -> None:
    nan = TensorDataset(torch.full((64, 16), float("nan")), torch.zeros(64, dtype=torch.long))
    with pytest.raises(TrainingStopped, match="loss became non-finite at step 1;"):
        overwrite_run(save_dir, nan).fit()


def interrupt_at_first_step(trainer: MultiGPUTrainer) -> None:
    """A real SIGINT to this process at the first optimizer step, once (a second one exits at once)."""
    sent: list[bool] = []

    def interrupt(*args: Any) -> None:
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    trainer.optimizer.register_step_post_hook(interrupt)


def sigint_before_the_first_save(save_dir: Path) -> None:
    trainer = overwrite_run(save_dir)
    interrupt_at_first_step(trainer)
    assert trainer.fit()["stopped"]  # a clean stop: exit 0 in the CLI, but nothing of this run is kept


@pytest.mark.parametrize("fail", [nonfinite_at_step_1, sigint_before_the_first_save])
def test_an_overwrite_run_that_ends_before_its_first_save_puts_the_previous_run_back(previous, fail, capsys):
    before = contents(previous)
    fail(previous)
    out = capsys.readouterr().out
    assert contents(previous) == before and not list(
        previous.glob(".replaced-*")
    )  # byte for byte, and only them
    assert (
        f"--overwrite: this run ended before its first checkpoint, so the previous run's files are back in "
        f"--save-dir {previous} (this run's own logs there removed)" in out
    )
    resumed = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        blobs(32, 1),
        config_for(previous, 1, save_dir=str(previous), resume="auto", epochs=2),
    )
    assert resumed.fit()["global_step"] == 16
    assert (
        f"resumed from {previous / 'last.pt'}: epoch 2, step 8, 0 samples into the epoch"
        in capsys.readouterr().out
    )


def test_an_overwrite_run_refused_mid_epoch_puts_the_previous_run_back(tmp_path, capsys):
    """Bad input that only training finds (flags are checked before the old files are set aside): a training
    image cut short after its header, which the checks at start pass."""
    images = image_folder(tmp_path / "images", {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    save_dir = tmp_path / "ckpt"
    run = [
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(images),
        "--image-shape",
        "3,8,8",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--no-progress",
        "--save-dir",
        str(save_dir),
    ]
    assert main_multi_gpu.main(run) == 0
    before, image = contents(save_dir), images / "train" / "dog" / "1.png"
    whole = image.read_bytes()
    image.write_bytes(whole[:48])
    capsys.readouterr()
    assert main_multi_gpu.main([*run, "--overwrite"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"error: --dataset imagefolder: {image} cannot be read (image file is truncated); "
        f"remove or replace it (--resume auto then continues from the last checkpoint)"
    ]
    assert "the previous run's files are back" in out
    assert contents(save_dir) == before and not list(save_dir.glob(".replaced-*"))
    image.write_bytes(whole)
    assert main_multi_gpu.main([*run, "--resume", "auto", "--epochs", "2"]) == 0
    assert (
        f"resumed from {save_dir / 'last.pt'}: epoch 2, step 2, 0 samples into the epoch"
        in capsys.readouterr().out
    )


def _interrupted_overwrite(rank: int, world_size: int, save_dir: Path) -> dict:
    trainer = overwrite_run(save_dir, world_size=world_size)
    if rank == 0:
        interrupt_at_first_step(trainer)  # the other rank learns of it at the next sync point
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = trainer.fit()
    return {"stopped": summary["stopped"], "step": summary["global_step"], "out": printed.getvalue()}


@pytest.mark.slow
def test_every_rank_skips_the_stop_checkpoint_of_an_overwrite_run_and_rank_0_puts_the_old_files_back(
    previous,
):
    before = contents(previous)
    ranks = run_ranks(_interrupted_overwrite, 2, previous.parent / "ranks", previous)
    # Step 4, the first sync point: the epoch's end on 2 ranks, before its save.
    assert [(r["stopped"], r["step"]) for r in ranks] == [(True, 4), (True, 4)]
    assert (
        "stopped by SIGINT at step 4, before this run's first checkpoint: nothing of it is saved"
        in ranks[0]["out"]
    )
    assert contents(previous) == before and not list(previous.glob(".replaced-*"))


def test_under_torchrun_with_restarts_left_the_set_aside_copy_waits_for_the_restart(
    previous, capsys, monkeypatch
):
    before = contents(previous)
    for name, value in (
        ("TORCHELASTIC_RUN_ID", "job"),
        ("TORCHELASTIC_MAX_RESTARTS", "1"),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
    ):
        monkeypatch.setenv(name, value)
    nonfinite_at_step_1(
        previous
    )  # torchrun would restart it: the restart must start afresh, not continue the old run
    (kept,) = previous.glob(".replaced-*")
    assert (
        f"--overwrite: the previous run's files stay in {kept} while torchrun may restart this run"
        in capsys.readouterr().out
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    nonfinite_at_step_1(previous)  # the restart fails too, and is the last attempt: the old files go back
    out = capsys.readouterr().out
    assert (
        f"torchrun restart 1: the previous run's files stay in {kept} until this run's first checkpoint"
        in out
    )
    assert f"no checkpoint to resume in {previous}: starting from scratch" in out
    assert "the previous run's files are back" in out and contents(previous) == before


def test_resume_from_a_folder_continues_its_newest_checkpoint(previous, tmp_path, capsys):
    trainer = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        blobs(32, 1),
        config_for(tmp_path, 1, save_dir=str(tmp_path / "next"), resume=str(previous)),
    )
    assert trainer.resume()
    assert f"resumed from {previous / 'last.pt'}: epoch 2, step 8" in capsys.readouterr().out


# A user's script whose validation set sends SIGTERM to torchrun while rank 0 evaluates epoch 1 (once), and
# holds that evaluation until torchrun has passed the signal on to rank 0: on a busy machine the evaluation's
# other batches would otherwise end before it arrives.
STOPPED_IN_EVALUATION = """
import os, signal, sys, time, torch
from torch.utils.data import TensorDataset
from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer

class Validation(TensorDataset):
    trainer = None  # set once built: its stop request is where the signal shows

    def __getitem__(self, index):
        marker = sys.argv[1]
        if os.environ["RANK"] == "0" and index == 40 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun passes it to every worker
            deadline = time.monotonic() + 60
            while self.trainer.stop.signal_name is None and time.monotonic() < deadline:
                time.sleep(0.01)  # a signal's handler runs in this thread, between two instructions
        return super().__getitem__(index)

def train(argv):
    config = parse_config(argv)
    data = torch.randn(640, 16, generator=torch.Generator().manual_seed(0))
    targets = (data[:, 0] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    validation = Validation(data[128:], targets[128:])
    with MultiGPUTrainer(model, TensorDataset(data[:128], targets[:128]), validation, config) as trainer:
        validation.trainer = trainer
        trainer.fit()

sys.exit(main_guarded(train, sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_stop_during_evaluation_saves_at_once_and_resumes_to_the_same_weights(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(STOPPED_IN_EVALUATION)
    args = [
        "--batch-size",
        "8",
        "--eval-batch-size",
        "4",
        "--epochs",
        "2",
        "--no-progress",
        "--dist-timeout",
        "60",
    ]

    def start(marker: str, save_dir: Path) -> subprocess.Popen:
        return subprocess.Popen(
            cli_command([marker, *args, "--save-dir", str(save_dir)], nproc=2, script=script),
            cwd=REPO,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    whole = start("/dev/null", tmp_path / "whole")  # the marker exists: never stopped
    assert whole.wait(RUN_TIMEOUT) == 0, whole.stdout.read()
    # Through the launcher's torchrun (multigpu/launch/torchrun.py), whose exit status is the workers'.
    stopped = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "multigpu" / "launch" / "torchrun.py"),
            "--log-file",
            str(tmp_path / "torchrun.log"),
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(tmp_path / "marker"),
            *args,
            "--save-dir",
            str(tmp_path / "stopped"),
        ],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
    resumed = subprocess.run(
        cli_command(
            [str(tmp_path / "marker"), *args, "--save-dir", str(tmp_path / "stopped"), "--resume", "auto"],
            nproc=2,
            script=script,
        ),
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert_ok(resumed)
    assert "epoch 1/2: val loss" in resumed.stdout  # the interrupted evaluation runs first
    ours, theirs = (checkpoint.load(str(tmp_path / run / "last.pt")) for run in ("stopped", "whole"))
    assert ours["metrics"] == theirs["metrics"] and ours["best_value"] == theirs["best_value"]
    for key, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][key], tensor), key


def test_a_second_fit_of_the_same_trainer_is_its_own_run_and_says_what_to_do_for_more_epochs(tmp_path):
    """Not "holds another run's checkpoints": they are this trainer's. epochs is the total, so a finished run has
    nothing left to train, and the line says how to train further; its files stay as they are."""
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1))
    trainer.fit()
    before = contents(tmp_path / "ckpt")
    with pytest.raises(
        UsageError,
        match=r"^fit\(\) already trained this run to its 2 epochs \(epochs is the total, "
        r"not epochs per call\): nothing to train; to train further, build a trainer "
        r"with more epochs and resume='auto' \(it continues from .*ckpt\)$",
    ):
        trainer.fit()
    assert_untouched(tmp_path / "ckpt", before)
    more = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=3, resume="auto"))
    assert more.fit()["epochs"] == 3  # what the line says works


@pytest.mark.slow
def test_resuming_a_finished_run_says_it_is_complete_trains_nothing_and_writes_nothing(tmp_path):
    """The same command again, --resume auto added (a requeued job that had finished): one line, exit 0, and the
    checkpoints and TensorBoard event files stay byte for byte as they were."""
    save_dir = tmp_path / "ckpt"
    first = run_cli_forked([*QUICK, "--save-dir", str(save_dir)])
    assert_ok(first)
    best = checkpoint.load(str(save_dir / "best.pt"))["best_value"]
    before = contents(save_dir)
    assert any(name.parts[0] == "tb" for name in before)  # the event file is among what must stay as it was
    again = run_cli_forked([*QUICK, "--save-dir", str(save_dir), "--resume", "auto"])
    assert_ok(again)
    assert again.stdout.splitlines()[1:] == [
        f"run in {save_dir} is already complete: 1 epochs, best val_acc {best:.4f}; nothing to train (raise "
        f"--epochs to train further)"
    ], again.stdout  # after the model line: no plan, no "first step lr 0"
    assert contents(save_dir) == before


def _overwrite_run_stuck_at_its_first_step(save_dir: str, errors: str, stuck: Any, heard: Any) -> None:
    """An --overwrite run whose first step's end never returns (as a call into a tracker that never answered
    did), in a process of its own: its stderr to the file `errors`; `stuck` set once it waits, `heard` once the
    first stop request reached it (it waits on all the same)."""
    as_a_fresh_process()
    with open(errors, "w") as file:
        os.dup2(file.fileno(), 2)
    trainer = overwrite_run(Path(save_dir))

    def never_returns(*args: Any) -> None:
        stuck.set()
        while not trainer.stop.requested:
            threading.Event().wait(0.01)  # polling the flag the signal sets
        heard.set()
        threading.Event().wait()

    trainer.optimizer.register_step_post_hook(never_returns)
    trainer.fit()


def test_a_second_signal_that_ends_an_overwrite_run_at_once_puts_the_previous_run_back(previous, tmp_path):
    """The first Ctrl-C only asks for a stop at the next sync point, which a stuck step never reaches; the second
    ends the process at once, and the files --overwrite set aside are back first, byte for byte."""
    before = contents(previous)
    context = preloaded_context()
    stuck = context.Event()
    heard = context.Event()
    errors = tmp_path / "errors.txt"
    run = context.Process(
        target=_overwrite_run_stuck_at_its_first_step, args=(str(previous), str(errors), stuck, heard)
    )
    run.start()
    try:
        assert stuck.wait(RUN_TIMEOUT) and list(previous.glob(".replaced-*"))  # set aside while it runs
        os.kill(run.pid, signal.SIGINT)
        assert heard.wait(RUN_TIMEOUT)  # two signals sent at once would arrive as one
        os.kill(run.pid, signal.SIGINT)
        run.join(RUN_TIMEOUT)
    finally:
        if run.is_alive():
            run.kill()
            run.join()
    assert run.exitcode == 128 + signal.SIGINT, errors.read_text()
    assert errors.read_text().splitlines() == [
        "second SIGINT: exiting now without a checkpoint",
        f"--overwrite: this run ended before its first checkpoint, so the previous run's files are back in "
        f"--save-dir {previous}",
    ]
    assert contents(previous) == before and not list(previous.glob(".replaced-*"))
