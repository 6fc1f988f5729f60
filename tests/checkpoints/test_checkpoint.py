"""Checkpoint files (multigpu/checkpoints/checkpoint.py): atomic saves, refused files, the fallback to an older
good checkpoint, and a full disk. Distributed kill-and-resume scenarios live in test_resume.py."""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (
    PYTHON,
    REPO,
    RUN_TIMEOUT,
    TINY,
    blobs,
    cli_command,
    cli_env,
    config_for,
    file_size_limit,
    tiny_model,
)
from multigpu import rng
from multigpu.checkpoints import checkpoint
from multigpu.data import build_datasets
from multigpu.errors import UsageError
from multigpu.models import build_model
from multigpu.resilience import faults
from train_multi_gpu import MultiGPUTrainer


def plain_state(step: int) -> dict:
    """The smallest dict `checkpoint.load` accepts, marked with `step`."""
    return {
        "format_version": checkpoint.FORMAT_VERSION,
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {},
        "scheduler": {},
        "scaler": {},
        "epoch": 0,
        "global_step": step,
        "config": {},
    }


class RunsCode:
    """Unpickling this would run a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_broken(path: Path, kind: str, marker: Path) -> None:
    """A file that must be refused: a truncated checkpoint, random bytes, or a pickle that runs code."""
    if kind in ("truncated", "cut-near-the-end"):
        checkpoint.atomic_save(plain_state(99), str(path))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2 if kind == "truncated" else -10])
    elif kind == "random-bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    else:
        torch.save({**plain_state(99), "model": RunsCode(marker)}, path)


def set_age(path: Path, seconds_ago: float) -> None:
    """Give `path` a modification time `seconds_ago` seconds in the past: "newest" is by mtime."""
    when = path.stat().st_mtime - seconds_ago
    os.utime(path, (when, when))


BROKEN_KINDS = ("truncated", "random-bytes", "code-running-pickle")


@pytest.mark.parametrize("kind", (*BROKEN_KINDS, "cut-near-the-end"))
def test_broken_file_is_refused_in_one_line_without_running_code(tmp_path, kind):
    path, marker = tmp_path / "last.pt", tmp_path / "code-ran"
    write_broken(path, kind, marker)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.load(str(path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"checkpoint {path} refused: ")
    assert (
        "weights_only=False" not in message and "weights_only` set to `False" not in message
    )  # never advise it
    assert not marker.exists()


def test_load_newest_skips_broken_newer_files_for_the_previous_good_one(tmp_path):
    checkpoint.atomic_save(plain_state(5), str(tmp_path / "step-000000005.pt"))
    set_age(tmp_path / "step-000000005.pt", 60)
    for age, (name, kind) in enumerate(
        zip(["step-000000010.pt", "step-000000015.pt", "last.pt"], BROKEN_KINDS)
    ):
        write_broken(tmp_path / name, kind, tmp_path / "code-ran")
        set_age(tmp_path / name, 30 - age)
    warnings: list[str] = []
    path, state = checkpoint.load_newest(str(tmp_path), warnings.append)
    assert (Path(path).name, state["global_step"]) == ("step-000000005.pt", 5)
    assert [w.split(" refused")[0] for w in warnings] == [
        f"checkpoint {tmp_path / n}" for n in ("last.pt", "step-000000015.pt", "step-000000010.pt")
    ]
    assert not (tmp_path / "code-ran").exists()


def test_save_killed_between_writing_and_renaming_leaves_the_old_checkpoint(tmp_path):
    target = tmp_path / "last.pt"
    checkpoint.atomic_save(plain_state(1), str(target))
    before = target.read_bytes()
    child = os.fork()
    if child == 0:  # the child dies by SIGKILL after the new file is complete, before the rename
        checkpoint.atomic_save(plain_state(2), str(target), before_rename=faults.kill_self)
        os._exit(0)  # not reached
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert target.read_bytes() == before and checkpoint.load(str(target))["global_step"] == 1
    leftovers = checkpoint.remove_unfinished(str(tmp_path))
    assert len(leftovers) == 1 and leftovers[0].startswith("last.pt.")  # the finished-but-unrenamed file
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_prune_keeps_the_newest_step_checkpoints(tmp_path):
    for step in (3, 6, 9, 12):
        checkpoint.atomic_save(plain_state(step), checkpoint.step_checkpoint_path(str(tmp_path), step))
        set_age(Path(checkpoint.step_checkpoint_path(str(tmp_path), step)), 100 - step)
    checkpoint.prune_step_checkpoints(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000009.pt", "step-000000012.pt"]


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    rng.seed_all(123)
    checkpoint.atomic_save(
        {**plain_state(0), "rng": rng.rng_state(torch.device("cpu"))}, str(tmp_path / "r.pt")
    )
    expected = (torch.rand(3).tolist(), random.random(), np.random.rand())
    rng.seed_all(0)
    rng.set_rng_state(checkpoint.load(str(tmp_path / "r.pt"))["rng"], torch.device("cpu"))
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == expected


def test_unwritable_save_dir_is_refused_before_training(tmp_path):
    (tmp_path / "a-file").write_text("")  # root may write anywhere, but not below a file
    config = config_for(tmp_path, 1, save_dir=str(tmp_path / "a-file" / "x"))
    with pytest.raises(UsageError, match="is not writable"):
        MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config)


def test_resume_auto_in_a_trainer_uses_the_previous_good_checkpoint(tmp_path, capsys):
    good = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=1))
    good.fit()  # 8 steps: last.pt at step 8
    for age, kind in enumerate(BROKEN_KINDS):
        write_broken(tmp_path / "ckpt" / f"step-00000001{age}.pt", kind, tmp_path / "code-ran")
    resumed = MultiGPUTrainer(
        tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=2, resume="auto")
    )
    assert resumed.progress.global_step == 0  # resuming is fit()'s first step, not the constructor's
    assert resumed.fit()["global_step"] == 16  # continued at step 8, so one more epoch of 8 steps
    out = capsys.readouterr().out
    assert out.count("refused") == 3 and f"resumed from {tmp_path / 'ckpt' / 'last.pt'}" in out
    assert not (tmp_path / "code-ran").exists()


def test_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    save_dir = tmp_path / "ckpt"
    args = [
        *TINY,
        "--model",
        "mlp",
        "--mode",
        "flatten",
        "--epochs",
        "1",
        "--save-every-steps",
        "2",
        "--save-dir",
        str(save_dir),
    ]
    config = config_for(tmp_path, 1, model="mlp", mode="flatten", train_size=512, val_size=100, batch_size=32)
    data = build_datasets(config)
    MultiGPUTrainer(
        build_model("mlp", data.input_shape, data.num_classes), data.train, data.val, config
    ).save_checkpoint("last.pt")  # 3.2 MB: larger than the limit below
    before = (save_dir / "last.pt").read_bytes()
    # Refused at start without --allow-low-disk (tests/test_bad_input.py); with it, the first save fails.
    result = subprocess.run(
        cli_command([*args, "--resume", "auto", "--allow-low-disk"]),
        cwd=REPO,
        env=cli_env(),
        text=True,
        capture_output=True,
        timeout=RUN_TIMEOUT,
        preexec_fn=file_size_limit(2**20),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"warning: --save-dir {save_dir} is under a file size limit (ulimit -f) of 1.0 MB" in result.stdout
    assert result.stderr.strip().splitlines() == [
        f"error: could not write checkpoint {save_dir / 'step-000000002.pt'}: File too large; stopped at step 2, "
        f"the previous checkpoint is kept: {save_dir / 'last.pt'}"
    ]
    assert (save_dir / "last.pt").read_bytes() == before
    assert sorted(p.name for p in save_dir.iterdir() if p.is_file()) == [
        ".run.lock",
        "last.pt",
    ]  # no temporary file


def test_a_checkpoint_written_before_format_2_still_resumes(tmp_path):
    MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(20, 1), config_for(tmp_path, 1, epochs=1)).fit()
    path = tmp_path / "ckpt" / "last.pt"
    state = checkpoint.load(str(path))
    new_keys = (
        "optimizer_class",
        "scheduler_class",
        "scheduler_interval",
        "monitor",
        "best_value",
        "steps_per_epoch",
    )
    old = {key: value for key, value in state.items() if key not in new_keys}
    torch.save(
        {**old, "format_version": 1, "best_val_acc": state["best_value"]}, path
    )  # as the old trainer wrote it
    resumed = MultiGPUTrainer(
        tiny_model(), blobs(64, 0), blobs(20, 1), config_for(tmp_path, 1, epochs=2, resume="auto")
    )
    assert resumed.resume()
    assert (resumed.monitor.name, resumed.progress.best_value) == ("val_acc", state["best_value"])
    assert resumed.fit()["global_step"] == 16


@pytest.mark.parametrize(
    "content, why",
    [
        (b"epoch 3: val acc 0.97\n", "it holds text; a checkpoint is what torch.save writes"),
        (b"", "the file is empty"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_named_as_such(tmp_path, content, why):
    (tmp_path / "notes.txt").write_bytes(content)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.load(str(tmp_path / "notes.txt"))
    assert str(refused.value) == f"checkpoint {tmp_path / 'notes.txt'} refused: not a checkpoint ({why})"


@pytest.mark.slow
def test_the_start_probe_writes_real_bytes_so_a_full_disk_is_refused(tmp_path):
    probe = (
        "import sys; from multigpu.checkpoints import checkpoint; checkpoint.check_writable(sys.argv[1]); "
        "print(checkpoint.room_shortfall(sys.argv[1], 2 * 2**20, 2 * 2**20, 'one checkpoint'))"
    )
    run = functools.partial(
        subprocess.run,
        [PYTHON, "-c", probe, str(tmp_path)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    full = run(preexec_fn=file_size_limit(checkpoint.PROBE_BYTES // 2))  # an empty file would still fit
    assert full.returncode == 1 and full.stderr.strip().splitlines()[-1] == (
        f"multigpu.errors.UsageError: --save-dir {tmp_path} is not writable (File too large); "
        f"free some space or choose another directory"
    )
    small = run(preexec_fn=file_size_limit(2**20))  # room for the probe, not for a 2 MB checkpoint
    assert small.stdout.strip() == (
        "('is under a file size limit (ulimit -f) of 1.0 MB, but one checkpoint needs "
        "about 2.1 MB', 'raise the limit (ulimit -f unlimited)')"
    )
    assert checkpoint.room_shortfall(str(tmp_path), 2 * 2**20, 2**20, "two checkpoints") is None
    too_much = checkpoint.room_shortfall(str(tmp_path), 10**18, 10**17, "ten checkpoints")
    assert (
        too_much is not None
        and "MB free, but this run's checkpoints need about 1000000000000.0 MB (ten checkpoints)"
        in too_much[0]
    )
    assert list(tmp_path.iterdir()) == []  # the probe is gone


def test_an_unwritable_log_dir_names_its_flag(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match=f"--log-dir {tmp_path / 'a-file' / 'tb'} is not writable"):
        checkpoint.check_writable(str(tmp_path / "a-file" / "tb"), flag="--log-dir")


def test_the_size_estimate_is_close_to_a_real_checkpoint(tmp_path):
    config = config_for(tmp_path, 1, model="mlp", mode="flatten", train_size=64, val_size=16, epochs=1)
    data = build_datasets(config)
    trainer = MultiGPUTrainer(
        build_model("mlp", data.input_shape, data.num_classes), data.train, data.val, config
    )
    estimate = checkpoint.estimate_size(trainer.model, trainer.optimizer)
    trainer.fit()  # AdamW's state exists after the first step
    real = (tmp_path / "ckpt" / "last.pt").stat().st_size
    assert abs(estimate - real) / real < 0.05, (estimate, real)


def test_unfinished_saves_go_and_a_folder_caught_between_its_renames_comes_back(tmp_path):
    """A kill inside safe_files.replace_folder leaves the old folder as `last.old.tmp`: put back when nothing
    took its place, dropped when the new one is in place; half-written folders and files are removed."""
    (tmp_path / "last.old.tmp").mkdir()
    (tmp_path / "last.old.tmp" / checkpoint.MARKER).write_bytes(b"complete")
    for folder in ("best", "best.old.tmp", "step-000000004.tmp"):
        (tmp_path / folder).mkdir()
    (tmp_path / "step-000000010.pt.abc4.tmp").write_bytes(b"half")  # a file that a folder's pattern also fits
    removed = checkpoint.remove_unfinished(str(tmp_path))
    assert removed == ["best.old.tmp", "step-000000004.tmp", "step-000000010.pt.abc4.tmp"]
    assert (tmp_path / "last" / checkpoint.MARKER).read_bytes() == b"complete"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best", "last"]
