"""A run's settings read from its checkpoint without torch or its code, and how a command's differ from them."""

from __future__ import annotations

import os

import torch

from multigpu.checkpoints import run_settings
from multigpu.config import TrainConfig


def test_a_runs_settings_are_read_without_running_what_its_checkpoint_holds(tmp_path):
    class Payload:  # what a hostile pickle does: calls a function of its choice when loaded
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "ran"),)

    config = TrainConfig(lr=0.5)
    torch.save(
        {"config": config.to_dict(), "model": {"w": torch.ones(3)}, "extra": Payload()}, tmp_path / "last.pt"
    )
    assert run_settings.saved_settings(str(tmp_path / "last.pt")) == config.to_dict()
    assert not (tmp_path / "ran").exists()
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    os.mkfifo(tmp_path / "pipe.pt")  # never opened: reading it would wait for a writer
    assert run_settings.saved_settings(str(tmp_path / "notes.pt")) is None
    assert run_settings.saved_settings(str(tmp_path / "pipe.pt")) is None


def test_a_command_continues_a_run_with_other_epochs_workers_or_output_flags_but_not_another_lr():
    saved = TrainConfig(batch_size=32, lr=0.01).to_dict()
    same_run = TrainConfig(
        batch_size=32,
        lr=0.01,
        epochs=9,
        num_workers=4,
        compile=True,
        log_every=1,
        save_dir="elsewhere",
        progress=False,
        resume="auto",
    )
    assert run_settings.differences(saved, same_run) == []
    assert (
        run_settings.differences(saved, TrainConfig(batch_size="auto", lr=0.01)) == []
    )  # found again at start
    assert run_settings.differences(saved, TrainConfig(batch_size=64, lr=0.1, seed=2)) == [
        "batch_size: 32 -> 64",
        "lr: 0.01 -> 0.1",
        "seed: 0 -> 2",
    ]
    assert run_settings.differences({"lr": 0.01}, TrainConfig(lr=0.01)) == []  # settings an older run lacks
    # What a resume logs: every setting of the run, but not how this start goes.
    assert run_settings.changes(
        saved,
        TrainConfig(batch_size=32, lr=0.01, epochs=9, resume="auto", overwrite=False, allow_low_disk=True),
    ) == ["epochs: 3 -> 9"]
