"""--multi-gpu fsdp (multigpu/sharding.py): which blocks are sharded, and that sharded training is the same training.

Equivalence (issue 22): fsdp at 2 processes = ddp at 2 processes = one process at twice the batch, within 1e-5
of every parameter after 5 AdamW steps (fp32), with and without gradient accumulation and clipping. All 2-rank
runs share one spawn of real gloo processes (module fixture); the same spawn checks that clipping's total norm
over sharded gradients is the full one, that evaluation and prediction are exact when the ranks have different
numbers of batches, that the EMA of sharded weights is the EMA of one process, and that a checkpoint saved by
fsdp at 2 processes resumes at 1 to the same weights as an uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import main_multi_gpu
from conftest import blobs, config_for, run_ranks, tiny_model
from multigpu import sharded, sharding
from multigpu.config import parse_config
from multigpu.errors import UsageError
from multigpu.stateful import ModelState
from train_multi_gpu import MultiGPUTrainer

TOLERANCE = 1e-5
WORLD = 2
SIZE, VAL_SIZE = 80, 21  # 80 samples at 16 per step: 5 steps; 21 = eval batches of 8, 8, 5: rank 1 has one fewer
# Per-rank settings at 2 ranks; one process gets batch_size x 2.
RUNS: dict[str, dict[str, Any]] = {
    "plain": dict(batch_size=8),
    "accum": dict(batch_size=4, grad_accum_steps=2),
    "clip": dict(batch_size=8, clip_grad_norm=0.05),
    "accum+clip+ema": dict(batch_size=4, grad_accum_steps=2, clip_grad_norm=0.05, ema_decay=0.5),
}


def _full_weights(trainer: MultiGPUTrainer) -> dict[str, torch.Tensor]:
    state = ModelState(trainer.model).state_dict()  # whole on rank 0, sharded or not
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def train(tmp_path: Path, world_size: int, mode: str, epochs: int = 1, **overrides: Any) -> dict[str, Any]:
    """Train tiny_model for 5 AdamW steps an epoch; the full weights (rank 0), EMA weights, evaluation and
    predictions."""
    config = config_for(tmp_path, world_size, multi_gpu=mode, optimizer="adamw", lr=3e-3, epochs=epochs,
                        **overrides)
    with MultiGPUTrainer(tiny_model(), blobs(SIZE, 0), blobs(VAL_SIZE, 1), config) as trainer:
        summary = trainer.fit()
        ema = trainer.eval_model.state_dict() if trainer.eval_model is not None else None
        return {"weights": _full_weights(trainer), "ema": ema, "steps": summary["global_step"],
                "eval": trainer.evaluate(), "predict": trainer.predict(batch_size=8)}


def _clipped_norm(world_size: int) -> tuple[float, float]:
    """clip_grad_norm_'s total norm over a sharded model's gradients, and over the same unsharded model's."""
    plain, sharded = tiny_model(), tiny_model()
    sharding.shard(sharded, torch.device("cpu"), world_size)
    inputs, targets = blobs(16, 2).tensors
    nn.functional.cross_entropy(plain(inputs), targets).backward()
    rank = torch.distributed.get_rank()
    # Each rank's half of the batch, each loss weighted by its half: the reduced gradient is the whole batch's.
    half = slice(rank * 8, rank * 8 + 8)
    nn.functional.cross_entropy(sharded(inputs[half]), targets[half]).backward()
    full = nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    total = nn.utils.clip_grad_norm_(sharded.parameters(), 1e-3)
    return float(total.full_tensor() if hasattr(total, "full_tensor") else total), float(full)


def _rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, settings in RUNS.items():
        for mode in ("fsdp", "ddp"):
            results[f"{mode}/{name}"] = train(tmp_path / f"rank{rank}" / mode / name, world_size, mode, **settings)
    # Saved by fsdp at 2 ranks after epoch 1 (the parent resumes it at 1 process for epoch 2; a constant LR, as
    # a schedule's length depends on --epochs).
    train(tmp_path / "resume", world_size, "fsdp", lr_schedule="constant", ema_decay=0.5, **RUNS["plain"])
    results["norms"] = _clipped_norm(world_size)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp_path = tmp_path_factory.mktemp("fsdp")
    rank0, _ = run_ranks(_rank, WORLD, tmp_path, tmp_path)
    return rank0, tmp_path


def one_process(tmp_path: Path, mode: str = "none", **settings: Any) -> dict[str, Any]:
    """The same run in one process with the whole batch of the 2 ranks."""
    settings = dict(settings, batch_size=settings["batch_size"] * WORLD)
    return train(tmp_path, 1, mode, **settings)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


@pytest.mark.parametrize("name", RUNS)
def test_fsdp_equals_ddp_and_one_process_with_the_whole_batch(two_ranks, tmp_path, name):
    results, _ = two_ranks
    fsdp, ddp, single = results[f"fsdp/{name}"], results[f"ddp/{name}"], one_process(tmp_path, **RUNS[name])
    assert fsdp["steps"] == ddp["steps"] == single["steps"] == 5
    assert max_difference(single["weights"], tiny_model().state_dict()) > 1e-3  # training moved the weights
    for other in (fsdp, ddp):
        assert max_difference(other["weights"], single["weights"]) <= TOLERANCE
        # Evaluation and prediction over 3 batches at 2 ranks: rank 1 runs a stand-in forward in round 2.
        assert other["eval"]["count"] == VAL_SIZE
        assert abs(other["eval"]["loss"] - single["eval"]["loss"]) <= TOLERANCE
        assert (other["predict"] - single["predict"]).abs().max().item() <= TOLERANCE
    if single["ema"] is not None:
        assert max_difference(fsdp["ema"], single["ema"]) <= TOLERANCE
        assert max_difference(fsdp["ema"], fsdp["weights"]) > 1e-4  # the average, not the weights


def test_clipping_sharded_gradients_returns_the_full_norm(two_ranks):
    sharded, full = two_ranks[0]["norms"]
    assert sharded == pytest.approx(full, rel=1e-5)


@pytest.mark.parametrize("saved_by, resumed_by", [("fsdp x 2", "fsdp"), ("fsdp x 2", "none"), ("none", "fsdp")])
def test_a_checkpoint_resumes_across_fsdp_and_one_device_like_an_uninterrupted_run(two_ranks, tmp_path, saved_by,
                                                                                    resumed_by):
    """Epoch 1 saved by fsdp at 2 processes (or one device), epoch 2 resumed in one process by fsdp (or one
    device): the same weights and EMA as 2 epochs uninterrupted. The full state is gathered into one file,
    so the model, optimizer and EMA state move between any world sizes and modes."""
    settings = dict(batch_size=16, lr_schedule="constant", ema_decay=0.5)
    if saved_by == "none":
        train(tmp_path / "run", 1, "none", **settings)
    else:
        shutil.copytree(two_ranks[1] / "resume", tmp_path / "run")
    resumed = train(tmp_path / "run", 1, resumed_by, epochs=2, resume="auto", **settings)
    uninterrupted = train(tmp_path / "whole", 1, "none", epochs=2, **settings)
    assert resumed["steps"] == uninterrupted["steps"] == 10
    assert max_difference(resumed["weights"], uninterrupted["weights"]) <= TOLERANCE
    assert max_difference(resumed["ema"], uninterrupted["ema"]) <= TOLERANCE


# ---------------------------------------------------------------- which blocks, in one process
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)  # 16 parameters: below the share that makes a block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def test_blocks_are_the_outermost_large_children_of_containers_or_the_named_classes():
    stack = Stack()
    assert sharding.find_blocks(stack) == list(stack.blocks)  # not the Linear layers inside each block's mlp
    assert sharding.find_blocks(stack, "Linear") == [stack.embed] + [b.mlp[i] for b in stack.blocks for i in (0, 2)]
    sequential = tiny_model()
    assert sharding.find_blocks(sequential) == [sequential[0], sequential[2]]  # the ReLU has no parameters
    with pytest.raises(UsageError, match=r"--fsdp-blocks Block,Nope: the model has no module of class Nope; "
                                         r"name classes it has, e\.g\. Block"):
        sharding.find_blocks(stack, "Block,Nope")


def test_fsdp_flags_and_their_no_form():
    assert parse_config(["--multi-gpu", "fsdp"]).fsdp_reshard_after_forward is True
    config = parse_config(["--multi-gpu", "fsdp", "--no-fsdp-reshard-after-forward", "--fsdp-blocks", "Block"])
    assert (config.fsdp_reshard_after_forward, config.fsdp_blocks) == (False, "Block")


def test_fsdp_in_one_process_trains_one_shard_and_says_so(tmp_path, capsys):
    args = ["--multi-gpu", "fsdp", "--train-size", "64", "--val-size", "16", "--batch-size", "16", "--epochs", "1",
            "--no-progress", "--save-dir", str(tmp_path / "run"), "--no-fsdp-reshard-after-forward"]
    assert main_multi_gpu.main(args) == 0
    out = capsys.readouterr().out
    assert "mode fsdp: one process, one shard" in out
    assert "(parameters kept gathered from forward to backward)" in out
    assert not torch.distributed.is_initialized()  # the one-process group is gone with the run
    assert (tmp_path / "run" / "last" / ".metadata").is_file()  # fsdp writes sharded folders (one shard here)
    state = sharded.load_whole(str(tmp_path / "run" / "last"))
    assert all(type(tensor) is torch.Tensor for tensor in state["model"].values())  # whole tensors, not DTensors
    assert main_multi_gpu.main(args + ["--checkpoint-format", "file", "--save-dir", str(tmp_path / "file")]) == 0
    state = torch.load(tmp_path / "file" / "last.pt", weights_only=True)  # or one file, gathered whole
    assert all(type(tensor) is torch.Tensor for tensor in state["model"].values())
