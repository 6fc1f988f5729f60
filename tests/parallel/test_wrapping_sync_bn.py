"""BatchNorm across devices: --sync-bn and the small-batch warning (issue 5, PITFALLS 18).

SyncBatchNorm trains only on CUDA devices. On the CPU --sync-bn says so in one
line and keeps BatchNorm, and training runs; without it a line warns when the
per-device batch is small (< 16). On a machine with a GPU, the last test
checks that SyncBatchNorm over 2 ranks trains like one process with the whole
batch (2 gloo ranks may share one GPU).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from conftest import blobs, config_for, run_ranks, tiny_model
from multigpu.parallel.distributed import Runtime
from train_multi_gpu import MultiGPUTrainer

WORLD = 2


def bn_model() -> nn.Sequential:
    """A model with BatchNorm whose affine weights are not the defaults, so keeping them is visible."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(32)
    model = nn.Sequential(nn.Linear(16, 32), norm, nn.ReLU(), nn.Linear(32, 4))
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    return model


def build_quietly(
    tmp_path: Path, world_size: int, model: nn.Module, runtime: Runtime | None = None, **overrides: Any
) -> tuple[MultiGPUTrainer, list[str]]:
    """A trainer and the start-up lines about BatchNorm it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = MultiGPUTrainer(
            model,
            blobs(64, 0),
            None,
            config_for(tmp_path, world_size, epochs=1, **overrides),
            runtime=runtime,
        )
    return trainer, [line for line in printed.getvalue().splitlines() if "BatchNorm" in line]


CPU_CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "sync-bn": (bn_model, {"sync_bn": True, "batch_size": 8}),
    "small batch": (bn_model, {"batch_size": 8}),
    "batch 16": (bn_model, {"batch_size": 16}),
    "no BatchNorm": (tiny_model, {"batch_size": 8}),
}


def _cpu_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, dict[str, Any]]:
    results = {}
    for name, (make_model, overrides) in CPU_CASES.items():
        trainer, lines = build_quietly(tmp_path / f"{name}-{rank}", world_size, make_model(), **overrides)
        if name == "sync-bn":
            trainer.fit()  # would raise if SyncBatchNorm had slipped in: it cannot train on the CPU
        results[name] = {
            "lines": lines,
            "types": {
                type(m).__name__
                for m in trainer.model.modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm)
            },
        }
    return results


SYNC_BN_LINE = "--sync-bn needs DDP on CUDA devices; keeping per-device BatchNorm"
SMALL_BATCH_LINE = (
    "warning: BatchNorm statistics come from 8 samples per device; results will depend on the "
    "device count (consider --sync-bn or a larger batch)"
)


def test_sync_bn_on_the_cpu_says_so_once_keeps_batchnorm_and_small_batches_warn(tmp_path):
    rank0, rank1 = run_ranks(_cpu_rank, WORLD, tmp_path, tmp_path)
    assert rank0["sync-bn"]["types"] == {"BatchNorm1d"}
    # Not synced, so the statistics are per device after all: the small-batch warning follows.
    assert rank0["sync-bn"]["lines"] == [SYNC_BN_LINE, SMALL_BATCH_LINE]
    assert rank0["small batch"]["lines"] == [SMALL_BATCH_LINE]
    assert rank0["batch 16"]["lines"] == rank0["no BatchNorm"]["lines"] == []
    assert all(result["lines"] == [] for result in rank1.values())  # one line per job, not per rank


def train_bn(tmp_path: Path, world_size: int, runtime: Runtime, **overrides: Any) -> dict[str, Any]:
    """Train bn_model (one BatchNorm in eval mode at start) and report the conversion and the weights."""
    model = bn_model()
    model[1].eval()  # a flag the conversion must keep
    trainer, _ = build_quietly(
        tmp_path, world_size, model, runtime, num_workers=0, optimizer="sgd", lr=0.05, **overrides
    )
    converted = [
        (type(m).__name__, m.training, m.weight.detach().cpu().clone())
        for m in trainer.model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    trainer.fit()
    return {
        "converted": converted,
        "state": {name: tensor.detach().cpu().clone() for name, tensor in trainer.model.state_dict().items()},
    }


def _cuda_rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    device = torch.device("cuda", rank % torch.cuda.device_count())  # ranks may share a GPU: gloo allows it
    torch.cuda.set_device(device)
    runtime = Runtime("ddp", device, rank, rank, world_size, "gloo")
    return train_bn(tmp_path / f"rank{rank}", world_size, runtime, sync_bn=True, batch_size=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SyncBatchNorm trains only on CUDA devices")
def test_sync_bn_on_cuda_trains_like_one_process_with_the_whole_batch(tmp_path):
    rank0, _ = run_ranks(_cuda_rank, WORLD, tmp_path, tmp_path)
    single = train_bn(tmp_path / "single", 1, Runtime("none", torch.device("cuda:0")), batch_size=16)
    ((kind, training, weight),) = rank0["converted"]
    assert kind == "SyncBatchNorm" and training is False  # converted before the wrap, eval flag kept
    assert torch.equal(weight, bn_model()[1].weight.detach())  # affine weights kept
    difference = max(
        (rank0["state"][k].float() - single["state"][k].float()).abs().max().item() for k in single["state"]
    )
    print(f"SyncBatchNorm 2 ranks x 8 vs 1 process x 16: max abs difference {difference:.3g}")
    assert difference <= 1e-4  # weights and running statistics
