"""Callbacks (multigpu/loop/callbacks.py): the hooks fit() calls, their state in checkpoints, and early stopping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import main_multi_gpu
import predict_multi_gpu
from conftest import TINY, assert_ok, blobs, config_for, read_scalars, run_cli, run_ranks, tiny_model
from multigpu.checkpoints import checkpoint
from multigpu.config import TrainConfig
from multigpu.data import build_datasets
from multigpu.loop.callbacks import ema_weights
from multigpu.models import build_model
from multigpu.resilience.faults import FAULT_ENV
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
    MultiGPUTrainer(
        tiny_model(), blobs(64, 0), blobs(16, 1), config_for(tmp_path, 1, epochs=1), callbacks=[first]
    ).fit()
    assert first.calls == [("fit_start", 0), ("epoch_end", 8), ("validation_end", 8), ("save", 8)]
    assert checkpoint.load(str(tmp_path / "ckpt" / "last.pt"))["callbacks"] == {"Recorder": {"steps": 8}}
    second, other = Recorder(), Recorder()  # two of a class: each keeps its own state
    MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        blobs(16, 1),
        config_for(tmp_path, 1, epochs=2, resume="auto"),
        callbacks=[second, other],
    ).fit()
    assert (
        second.steps == 16 and other.steps == 8
    )  # the second one was not in the checkpoint: it started fresh
    assert second.calls[0] == ("fit_start", 8)


def plateau(tmp_path: Path, patience: int, epochs: int, **config: Any) -> dict[str, Any]:
    return MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        blobs(16, 1),
        config_for(tmp_path, 1, epochs=epochs, early_stop_patience=patience, **config),
        optimizer=frozen,
    ).fit()


def test_early_stopping_stops_on_a_plateau_after_patience_epochs_and_keeps_the_best(tmp_path, capsys):
    summary = plateau(tmp_path, patience=2, epochs=10)
    assert summary["epochs"] == 3  # epoch 1 sets the best, epochs 2 and 3 do not beat it
    assert "val_acc has not improved for 2 epoch(s) (--early-stop-patience 2)" in summary["stopped_early"]
    assert summary["stopped_early"] in capsys.readouterr().out
    assert checkpoint.load(str(tmp_path / "ckpt" / "best.pt"))["epoch"] == 1
    assert checkpoint.load(str(tmp_path / "ckpt" / "last.pt"))["epoch"] == 3


def test_a_resumed_run_continues_the_patience_counter(tmp_path):
    assert "stopped_early" not in plateau(
        tmp_path, patience=3, epochs=2
    )  # one epoch without improvement so far
    assert (
        plateau(tmp_path, patience=3, epochs=10, resume="auto")["epochs"] == 4
    )  # 5 if the counter restarted
    again = plateau(
        tmp_path, patience=3, epochs=10, resume="auto"
    )  # resumed after it stopped: nothing to train
    assert again["epochs"] == 4 and "stopped_early" in again


def test_early_stopping_flags_count_only_improvements_above_min_delta(tmp_path, capsys):
    save_dir = tmp_path / "run"
    code = main_multi_gpu.main(
        [
            *TINY,
            "--epochs",
            "5",
            "--mode",
            "flatten",
            "--image-shape",
            "1,4,4",
            "--early-stop-patience",
            "1",
            "--early-stop-min-delta",
            "100",
            "--save-dir",
            str(save_dir),
        ]
    )
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
    trainer = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        blobs(16, 1),
        config_for(tmp_path, world_size, epochs=3),
        callbacks=[StopOnOneRank()],
    )
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
    MultiGPUTrainer(
        tiny_model(), blobs(32 * world_size, 0), blobs(16, 1), config, callbacks=[LogsItsRank()]
    ).fit()


@pytest.mark.slow
def test_own_scalars_reach_tensorboard_as_the_mean_over_calls_and_ranks(tmp_path):
    run_ranks(_log_scalars, 2, tmp_path, tmp_path)
    scalars = read_scalars(tmp_path / "ckpt" / "tb")
    # 4 steps an epoch, sync points at steps 3, 4 (epoch end), 6, 8: each the mean of its steps' values
    # over both ranks (x1 and x2, so x1.5).
    assert scalars["mine/rank_value"] == [(3, 1.5 * 2), (4, 1.5 * 4), (6, 1.5 * 5.5), (8, 1.5 * 7.5)]
    assert scalars["mine/epoch"] == [(4, 1.0), (8, 2.0)]


class TrainedWeights:
    """Keeps a copy of the trained parameters after each optimizer step (it runs after the built-in EMA)."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_step_end(self, trainer: Any) -> None:
        self.steps.append([p.detach().clone() for p in trainer.model.parameters()])


def _ema_run(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    model, record = tiny_model(), TrainedWeights()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = MultiGPUTrainer(
        model,
        blobs(32 * world_size, 0),
        blobs(16, 1),
        config_for(tmp_path, world_size, epochs=2, ema_decay=0.9),
        callbacks=[record],
    )
    summary = trainer.fit()
    ema = trainer.callbacks.callbacks[0]
    validation = trainer.val_dataset
    assert isinstance(validation, TensorDataset)  # blobs'
    trained = trainer.evaluator.run(trainer.model, validation, 8)
    assert trained is not None  # no stop request given
    return {
        "start": start,
        "steps": record.steps,
        "ema": [p.detach().clone() for p in ema.model.parameters()],
        "val_loss": summary["val_loss"],
        "ema_loss": trainer.evaluate()["loss"],
        "trained_loss": trained["loss"],
        "predicted": trainer.predict(),
        "ema_outputs": ema.model(validation.tensors[0]).detach(),
    }


def hand_ema(start: list[torch.Tensor], steps: list[list[torch.Tensor]], decay: float) -> list[torch.Tensor]:
    average = [p.double() for p in start]
    for trained in steps:
        average = [decay * a + (1 - decay) * t.double() for a, t in zip(average, trained)]
    return average


@pytest.mark.slow
def test_ema_weights_are_the_hand_computed_average_in_one_and_two_processes(tmp_path):
    for _world_size, ranks in (
        (1, [_ema_run(0, 1, tmp_path / "one")]),
        (2, run_ranks(_ema_run, 2, tmp_path / "two", tmp_path / "two")),
    ):
        for run in ranks:
            assert len(run["steps"]) == 8
            for ema, expected in zip(run["ema"], hand_ema(run["start"], run["steps"], 0.9)):
                torch.testing.assert_close(ema.double(), expected, rtol=1e-5, atol=1e-6)
            assert run["val_loss"] == run["ema_loss"] != run["trained_loss"]  # evaluation used the average
            torch.testing.assert_close(run["predicted"], run["ema_outputs"])  # and so does predict
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["ema"], ranks[-1]["ema"]))


EMA_ARGS = [
    *TINY,
    "--model",
    "mlp",
    "--mode",
    "flatten",
    "--image-shape",
    "1,4,4",
    "--epochs",
    "2",
    "--save-every-steps",
    "5",
    "--ema-decay",
    "0.9",
]


@pytest.mark.slow
def test_ema_survives_a_sigkill_and_resume_bit_exactly(tmp_path):
    assert_ok(run_cli([*EMA_ARGS, "--save-dir", str(tmp_path / "whole")]))
    killed = run_cli([*EMA_ARGS, "--save-dir", str(tmp_path / "killed")], env={FAULT_ENV: "0:7"})
    assert killed.returncode == -9, killed.stderr
    assert_ok(run_cli([*EMA_ARGS, "--save-dir", str(tmp_path / "killed"), "--resume", "auto"]))
    whole, resumed = (checkpoint.load(str(tmp_path / name / "last.pt")) for name in ("whole", "killed"))
    assert ema_weights(whole) is not None and ema_weights(whole).keys() == whole["model"].keys()
    for name, tensor in ema_weights(whole).items():
        assert torch.equal(tensor, ema_weights(resumed)[name]), name
        assert not torch.equal(tensor, whole["model"][name]) or not tensor.is_floating_point()
    assert whole["best_value"] == resumed["best_value"]
    # predict_multi_gpu.py predicts with the average
    assert (
        predict_multi_gpu.main(
            ["--checkpoint", str(tmp_path / "whole" / "last.pt"), "--output", str(tmp_path / "val.pt")]
        )
        == 0
    )
    model = build_model("mlp", (16,), 10)
    model.load_state_dict(ema_weights(whole))
    val = build_datasets(TrainConfig.from_dict(whole["config"])).val
    with torch.no_grad():
        expected = model(torch.stack([val[index][0] for index in range(len(val))]))
    torch.testing.assert_close(torch.load(tmp_path / "val.pt", weights_only=True), expected)
