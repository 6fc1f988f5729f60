"""DDP, DataParallel, gradient accumulation and one device train the same model (issue 5).

Models here have no BatchNorm or dropout, so the only differences allowed are
fp32 rounding from a different summation order: max abs weight difference
<= 1e-5 after 20+ optimizer steps, for SGD (momentum, weight decay) and AdamW.

Why the data agree by construction: ResumableDistributedSampler gives rank r
positions r, r+W, r+2W, ... of the epoch's global order (a function of seed and
epoch only), so global batch i of W ranks x B holds exactly the samples of
batch i of one process x W*B. With accumulation, micro-batch k of window i is
cut from the same stream, so K micro-batches of B are batch i of K*B.

All DDP runs share one spawn of 2 real gloo processes (module fixture): starting
processes costs far more than these tiny trainings.
"""

# No `from __future__ import annotations` here: DDP checks the comm hook's annotations as real objects.
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from conftest import blobs, config_for, run_ranks, tiny_model
from multigpu.parallel.distributed import Runtime
from multigpu.parallel.wrapping import as_ddp
from train_multi_gpu import MultiGPUTrainer

TOLERANCE = 1e-5
WORLD = 2
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.05}, "adamw": {"optimizer": "adamw", "lr": 3e-3}}
# 160 samples, 2 epochs: 10 optimizer steps per epoch with 16 samples per step.
WHOLE_BATCH = {"size": 160, "batch_size": 16}
# 138 samples, 2 epochs, 12 per step: each epoch ends in a short window of 6 = micro-batches of 4 + 2
# (one process, K=3) or 2 + 1 per rank (2 ranks, K=3), so the weighting of a short window is on trial too.
ACCUMULATION = {"size": 138, "batch_size": 12}


@dataclass
class Outcome:
    """What one training run left behind."""

    weights: dict[str, torch.Tensor]
    steps: int  # optimizer steps taken
    lr: float  # the LR after --lr-scaling, which depends on the effective batch
    effective_batch: int
    forwards: int  # micro-batches run through the model
    all_reduces: int  # DDP gradient all-reduces (communication-hook calls); 0 outside DDP


class AllReduceCount:
    """DDP communication-hook state: counts bucket all-reduces, then lets the default hook do them."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce_hook(
    state: AllReduceCount, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state.calls += 1
    # None: the default (whole-world) group, as DDP itself passes it.
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # torch's stub wants a group


def train(
    tmp_path: Path, world_size: int, size: int, runtime: Runtime | None = None, **overrides: Any
) -> Outcome:
    """Train tiny_model on `size` blobs for 2 epochs and report weights and counts."""
    config = config_for(tmp_path, world_size, lr_scaling="linear", lr_base_batch=16, epochs=2, **overrides)
    trainer = MultiGPUTrainer(tiny_model(), blobs(size, 0), None, config, runtime=runtime)
    count = AllReduceCount()
    if world_size > 1:
        as_ddp(trainer.step.wrapped).register_comm_hook(count, counting_allreduce_hook)
    forwards = []
    trainer.step.wrapped.register_forward_pre_hook(lambda module, args: forwards.append(1))
    trainer.fit()
    weights = {name: tensor.detach().cpu().clone() for name, tensor in trainer.model.state_dict().items()}
    return Outcome(
        weights, trainer.progress.global_step, trainer.lr, trainer.effective_batch, len(forwards), count.calls
    )


def ddp_runs(world_size: int) -> dict[str, dict[str, Any]]:
    """The DDP runs, per optimizer: the whole batch split over ranks, and the same with accumulation 3."""
    runs = {}
    for name, optimizer in OPTIMIZERS.items():
        runs[f"{name}/split"] = dict(
            size=WHOLE_BATCH["size"], batch_size=WHOLE_BATCH["batch_size"] // world_size, **optimizer
        )
        runs[f"{name}/split+accum"] = dict(
            size=ACCUMULATION["size"],
            grad_accum_steps=3,
            batch_size=ACCUMULATION["batch_size"] // (3 * world_size),
            **optimizer,
        )
    return runs


def _ddp_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Outcome]:
    return {
        name: train(tmp_path / f"rank{rank}" / name, world_size, **run)
        for name, run in ddp_runs(world_size).items()
    }


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Rank 0's outcomes of every DDP run (rank 1 is checked against rank 0 here)."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    rank0, rank1 = run_ranks(_ddp_rank, WORLD, tmp_path, tmp_path)
    for name in rank0:
        for key, tensor in rank0[name].weights.items():
            assert torch.equal(tensor, rank1[name].weights[key]), f"{name}: ranks disagree on {key}"
    return rank0


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


def assert_same_training(actual: Outcome, expected: Outcome) -> float:
    """Same steps, LR and effective batch, weights within TOLERANCE; returns the max abs difference."""
    assert (actual.steps, actual.effective_batch, actual.lr) == (
        expected.steps,
        expected.effective_batch,
        expected.lr,
    )
    difference = max_difference(actual.weights, expected.weights)
    print(f"max abs weight difference {difference:.3g} after {actual.steps} steps")  # figure for the guide
    assert difference <= TOLERANCE
    return difference


def assert_training_moved(outcome: Outcome) -> None:
    """Equal weights mean something only if training changed them."""
    assert max_difference(outcome.weights, tiny_model().state_dict()) > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_ddp_equals_one_process_with_the_whole_batch(ddp, tmp_path, optimizer):
    single = train(tmp_path, 1, **WHOLE_BATCH, **OPTIMIZERS[optimizer])
    assert single.steps == 20
    assert_training_moved(single)
    assert_same_training(ddp[f"{optimizer}/split"], single)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_accumulation_equals_one_big_batch_in_one_process_and_under_ddp(ddp, tmp_path, optimizer):
    big = train(tmp_path / "big", 1, **ACCUMULATION, **OPTIMIZERS[optimizer])
    accumulated = train(
        tmp_path / "accum",
        1,
        size=ACCUMULATION["size"],
        grad_accum_steps=3,
        batch_size=ACCUMULATION["batch_size"] // 3,
        **OPTIMIZERS[optimizer],
    )
    assert big.steps == 24  # ceil(138 / 12) = 12 per epoch, the last one short
    assert_training_moved(big)
    assert_same_training(accumulated, big)
    assert_same_training(ddp[f"{optimizer}/split+accum"], big)


@pytest.mark.slow
def test_ddp_accumulation_all_reduces_once_per_optimizer_step(ddp):
    """no_sync around forward and backward of the first K-1 micro-batches: one all-reduce per step."""
    run = ddp["sgd/split+accum"]
    # 69 samples per rank in micro-batches of 2: 35 per epoch; all-reducing each would be 70 calls.
    assert run.forwards == 70
    assert run.all_reduces == run.steps == 24  # tiny_model's gradients fit one DDP bucket
    assert ddp["sgd/split"].all_reduces == ddp["sgd/split"].steps == 20  # without accumulation: every step


def test_dataparallel_splitting_a_batch_equals_one_device_with_that_batch(tmp_path):
    """The trainer's DP path (batch = --batch-size x devices, effective batch and LR from it) equals one device.

    Without CUDA nn.DataParallel runs the module as is, so on the CPU this proves
    the trainer's DP bookkeeping, not torch's scatter/gather; with 2+ GPUs the
    same test runs real DataParallel on cuda:0,1.
    """
    gpus = torch.cuda.device_count() >= 2
    device = torch.device("cuda:0" if gpus else "cpu")
    dp = Runtime("dp", device, dp_device_ids=[0, 1])
    split = train(
        tmp_path / "dp",
        1,
        runtime=dp,
        size=WHOLE_BATCH["size"],
        batch_size=8,
        num_workers=0,
        **OPTIMIZERS["sgd"],
    )
    single = train(
        tmp_path / "one",
        1,
        runtime=Runtime("none", device),
        num_workers=0,
        **WHOLE_BATCH,
        **OPTIMIZERS["sgd"],
    )
    assert split.forwards == single.forwards == 20  # one forward of 16 per step (DP splits it inside)
    assert_same_training(split, single)
