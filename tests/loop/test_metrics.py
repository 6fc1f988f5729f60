"""Evaluation metrics: built-ins, defaults by task, a user's own, and exactness across world sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import blobs, config_for, regression_model, regression_set, run_ranks, tiny_model
from multigpu.loop import metrics
from train_multi_gpu import MultiGPUTrainer

PRIME = 101  # not a multiple of 2 or 3 or of the batch: ranks get unequal shares, the last batch is short


def confidence(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user metric in per-sample form: the probability given to the target."""
    return outputs.softmax(-1).gather(1, targets[:, None]).squeeze(1)


def errors(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A user metric in (sum, count) form: misclassified samples."""
    return (outputs.argmax(-1) != targets).sum(), targets.shape[0]


def _evaluate(rank: int, world_size: int, tmp_path: Path) -> list[dict]:
    classifier = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, world_size),
        metrics=["accuracy", "top2", confidence, errors],
    )
    regression = MultiGPUTrainer(
        regression_model(), regression_set(64, 0), None, config_for(tmp_path, world_size), loss_fn=F.mse_loss
    )
    return [classifier.evaluate(blobs(PRIME, 1)), regression.evaluate(regression_set(PRIME, 1))]


@pytest.mark.slow
def test_every_metric_equals_the_single_process_value_exactly_on_1_2_and_3_ranks(tmp_path):
    single = _evaluate(0, 1, tmp_path)
    assert set(single[0]) == {"loss", "acc", "acc_top2", "confidence", "errors", "count"}
    assert set(single[1]) == {"loss", "mse", "mae", "count"}  # a regression never gets an accuracy
    assert single[0]["count"] == single[1]["count"] == PRIME
    assert single[0]["errors"] == pytest.approx(1 - single[0]["acc"])
    for world_size in (2, 3):
        for rank_results in run_ranks(_evaluate, world_size, tmp_path, tmp_path):
            assert rank_results == single  # bit-identical, every metric, on every rank


def test_metric_values_are_means_over_samples(tmp_path):
    trainer = MultiGPUTrainer(
        regression_model(), regression_set(64, 0), None, config_for(tmp_path, 1), loss_fn=F.mse_loss
    )
    data = regression_set(PRIME, 1)
    result = trainer.evaluate(data)
    with torch.no_grad():
        outputs = trainer.model(data.tensors[0]).double()
    assert result["mse"] == pytest.approx(((outputs - data.tensors[1]) ** 2).mean().item(), rel=1e-12)
    assert result["mae"] == pytest.approx((outputs - data.tensors[1]).abs().mean().item(), rel=1e-12)
    assert result["loss"] == pytest.approx(result["mse"], rel=1e-6)
    classes = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1)).evaluate(
        blobs(PRIME, 1)
    )
    assert (
        set(classes) == {"loss", "acc", "count"} and 0 <= classes["acc"] <= 1
    )  # a fraction, not a percentage


class Squeezed(torch.nn.Module):
    """A regression model with (N,) outputs: the shape that made the old top-1 evaluation raise."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = regression_model()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs).squeeze(1)


def test_regression_outputs_of_either_shape_get_mse_and_mae(tmp_path):
    flat = MultiGPUTrainer(
        Squeezed(), regression_set(64, 0, ()), None, config_for(tmp_path, 1), loss_fn=F.mse_loss
    )
    column = MultiGPUTrainer(
        regression_model(), regression_set(64, 0), None, config_for(tmp_path, 1), loss_fn=F.mse_loss
    )
    # (N, 1) outputs against (N,) targets are compared sample by sample, never broadcast to N x N.
    mixed = MultiGPUTrainer(
        regression_model(),
        regression_set(64, 0, ()),
        None,
        config_for(tmp_path, 1),
        loss_fn=lambda outputs, targets: F.mse_loss(outputs.squeeze(1), targets),
    )
    results = [
        trainer.evaluate(data)
        for trainer, data in (
            (flat, regression_set(PRIME, 1, ())),
            (column, regression_set(PRIME, 1)),
            (mixed, regression_set(PRIME, 1, ())),
        )
    ]
    for result in results:
        assert set(result) == {"loss", "mse", "mae", "count"}
        assert result["mse"] == pytest.approx(results[0]["mse"], rel=1e-12)


def test_builtin_names_and_directions():
    assert metrics.key_of("accuracy") == "acc" and metrics.key_of("top5") == "acc_top5"
    assert metrics.lower_is_better("val_loss") and metrics.lower_is_better("val_mae")
    assert not metrics.lower_is_better("val_acc")
    with pytest.raises(ValueError, match="unknown metric 'f1': built-ins are acc"):
        metrics.builtin("f1")
    scores = torch.tensor([[0.1, 0.5, 0.4], [0.7, 0.2, 0.1]])
    assert metrics.builtin("top2")(scores, torch.tensor([2, 2])).tolist() == [1.0, 0.0]


class Jittered(torch.utils.data.Dataset):
    """Blobs with a random transform: reading a sample draws from the global RNG, as augmentation does."""

    def __init__(self, size: int):
        self.blobs = blobs(size, 1)

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int):
        inputs, target = self.blobs[index]
        return inputs + 0.1 * torch.rand(inputs.shape), target


def test_the_start_check_of_names_leaves_no_trace(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4)
    )
    trainer = MultiGPUTrainer(
        model, blobs(64, 0), Jittered(32), config_for(tmp_path, 1), metrics=["acc", confidence]
    )
    rng, buffers = torch.get_rng_state(), {name: b.clone() for name, b in trainer.model.named_buffers()}
    trainer.evaluator.check_names(trainer.model, Jittered(32), metrics.Monitor("val_confidence"))
    assert torch.equal(torch.get_rng_state(), rng)  # the transform's draws were put back
    assert all(
        torch.equal(b, buffers[name]) for name, b in trainer.model.named_buffers()
    )  # BatchNorm statistics
    assert trainer.model.training
    with pytest.raises(
        Exception,
        match="--monitor val_conf is not a validation metric of this run; it has "
        "val_loss, val_acc, val_confidence",
    ):
        trainer.evaluator.check_names(trainer.model, Jittered(32), metrics.Monitor("val_conf"))
