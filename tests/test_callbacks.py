"""Callbacks (multigpu/callbacks.py): the hooks fit() calls, their state in checkpoints, and early stopping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import main_multi_gpu
from conftest import TINY, blobs, config_for, read_scalars, run_ranks, tiny_model
from multigpu import checkpoint
from train_multi_gpu import MultiGPUTrainer


class Recorder:
    """Records each hook it gets as (hook, global step); counts steps in its checkpointed state."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.steps = 0

    def on_fit_start(self, trainer: Any) -> None:
        self.calls.append(("fit_start", trainer.progress.global_step))

    def on_step_end(self, trainer: Any) -> None:
        self.steps += 1

    def on_epoch_end(self, trainer: Any) -> None:
        self.calls.append(("epoch_end", trainer.progress.global_step))

    def on_validation_end(self, trainer: Any) -> None:
        self.calls.append(("validation_end", trainer.progress.global_step))

    def on_save(self, trainer: Any) -> None:
        self.calls.append(("save", trainer.progress.global_step))

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


def frozen(params: Any) -> torch.optim.Optimizer:
    """An optimizer with a learning rate of 0: the validation loss is the same every epoch (a plateau)."""
    return torch.optim.SGD(params, lr=0.0)


def test_callbacks_are_called_at_their_points_and_their_state_survives_a_resume(tmp_path):
    first = Recorder()
    MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config_for(tmp_path, 1, epochs=1),
                    callbacks=[first]).fit()
    assert first.calls == [("fit_start", 0), ("epoch_end", 8), ("validation_end", 8), ("save", 8)]
    assert checkpoint.load(str(tmp_path / "ckpt" / "last.pt"))["callbacks"] == {"Recorder": {"steps": 8}}
    second, other = Recorder(), Recorder()  # two of a class: each keeps its own state
    MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config_for(tmp_path, 1, epochs=2, resume="auto"),
                    callbacks=[second, other]).fit()
    assert second.steps == 16 and other.steps == 8  # the second one was not in the checkpoint: it started fresh
    assert second.calls[0] == ("fit_start", 8)


def plateau(tmp_path: Path, patience: int, epochs: int, **config: Any) -> dict[str, Any]:
    return MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1),
                           config_for(tmp_path, 1, epochs=epochs, early_stop_patience=patience, **config),
                           optimizer=frozen).fit()


def test_early_stopping_stops_on_a_plateau_after_patience_epochs_and_keeps_the_best(tmp_path, capsys):
    summary = plateau(tmp_path, patience=2, epochs=10)
    assert summary["epochs"] == 3  # epoch 1 sets the best, epochs 2 and 3 do not beat it
    assert "val_acc has not improved for 2 epoch(s) (--early-stop-patience 2)" in summary["stopped_early"]
    assert summary["stopped_early"] in capsys.readouterr().out
    assert checkpoint.load(str(tmp_path / "ckpt" / "best.pt"))["epoch"] == 1
    assert checkpoint.load(str(tmp_path / "ckpt" / "last.pt"))["epoch"] == 3


def test_a_resumed_run_continues_the_patience_counter(tmp_path):
    assert "stopped_early" not in plateau(tmp_path, patience=3, epochs=2)  # one epoch without improvement so far
    assert plateau(tmp_path, patience=3, epochs=10, resume="auto")["epochs"] == 4  # 5 if the counter restarted
    again = plateau(tmp_path, patience=3, epochs=10, resume="auto")  # resumed after it stopped: nothing to train
    assert again["epochs"] == 4 and "stopped_early" in again


def test_early_stopping_flags_count_only_improvements_above_min_delta(tmp_path, capsys):
    save_dir = tmp_path / "run"
    code = main_multi_gpu.main([*TINY, "--epochs", "5", "--mode", "flatten", "--image-shape", "1,4,4",
                                "--early-stop-patience", "1", "--early-stop-min-delta", "100",
                                "--save-dir", str(save_dir)])
    assert code == 0
    out = capsys.readouterr().out
    assert "val_acc has not improved by more than 100 for 1 epoch(s)" in out  # it trains, but not by 100
    assert checkpoint.load(str(save_dir / "last.pt"))["epoch"] == 2


class StopOnOneRank:
    """Asks to stop after the first epoch, on rank 1 only."""

    def on_epoch_end(self, trainer: Any) -> None:
        if trainer.runtime.rank == 1:
            trainer.stop_training("rank 1 asked")


def _stop_on_one_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config_for(tmp_path, world_size, epochs=3),
                              callbacks=[StopOnOneRank()])
    summary = trainer.fit()
    return {"epochs": summary["epochs"], "why": summary.get("stopped_early")}


def test_all_ranks_stop_together_when_one_asks(tmp_path):
    assert run_ranks(_stop_on_one_rank, 2, tmp_path, tmp_path) == [{"epochs": 1, "why": "rank 1 asked"}] * 2


class LogsItsRank:
    """Logs (rank + 1) x step each step as a device tensor, and once per evaluation a float."""

    def on_step_end(self, trainer: Any) -> None:
        step = torch.tensor(float(trainer.progress.global_step), device=trainer.device)
        trainer.log({"mine/rank_value": (trainer.runtime.rank + 1) * step})

    def on_validation_end(self, trainer: Any) -> None:
        trainer.log({"mine/epoch": float(trainer.progress.epoch)})


def _log_scalars(rank: int, world_size: int, tmp_path: Path) -> None:
    config = config_for(tmp_path, world_size, epochs=2, log_every=3)
    MultiGPUTrainer(tiny_model(), blobs(32 * world_size, 0), blobs(16, 1), config, callbacks=[LogsItsRank()]).fit()


def test_own_scalars_reach_tensorboard_as_the_mean_over_calls_and_ranks(tmp_path):
    run_ranks(_log_scalars, 2, tmp_path, tmp_path)
    scalars = read_scalars(tmp_path / "ckpt" / "tb")
    # 4 steps an epoch, sync points at steps 3, 4 (epoch end), 6, 8: each the mean of its steps' values
    # over both ranks (x1 and x2, so x1.5).
    assert scalars["mine/rank_value"] == [(3, 1.5 * 2), (4, 1.5 * 4), (6, 1.5 * 5.5), (8, 1.5 * 7.5)]
    assert scalars["mine/epoch"] == [(4, 1.0), (8, 2.0)]
