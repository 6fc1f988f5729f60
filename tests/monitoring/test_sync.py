"""A loss that turns NaN or inf (issue 5, PITFALLS 3 and 5).

fp32/bf16: training stops at the next sync point on every rank alike (the
per-step losses are all-reduced, so a NaN on one rank is a NaN for all), with
one message naming the first bad step and the last good checkpoint, which is
not overwritten. fp16: the GradScaler skips the step, as torch does; the skip
is counted once (not once per rank) and logged.

fp16 runs on the CPU here through conftest.use_fp16_on_cpu: the trainer's own
GradScaler path with float16 CPU autocast.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from conftest import blobs, config_for, read_scalars, run_ranks, tiny_model, use_fp16_on_cpu
from multigpu.checkpoints import checkpoint
from multigpu.data.sampler import epoch_order
from multigpu.errors import TrainingStopped
from train_multi_gpu import MultiGPUTrainer

WORLD, SIZE, BATCH = 2, 64, 4  # 8 optimizer steps per epoch on 2 ranks


class PoisonedSample(Dataset):
    """blobs whose sample `index` reads as `value` (NaN, inf) in epoch `epoch` only.

    The epoch is read from the trainer's sampler (attach it as `.sampler`), so
    the bad sample appears once, on the one rank that trains it in that epoch.
    """

    def __init__(self, index: int, epoch: int, value: float):
        self.base, self.index, self.epoch, self.value = blobs(SIZE, 0), index, epoch, value
        self.sampler: Any = None

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, target = self.base[index]
        if index == self.index and self.sampler.epoch == self.epoch:
            inputs = torch.full_like(inputs, self.value)
        return inputs, target


def poisoned_at(epoch: int, step_in_epoch: int, rank: int, world_size: int, value: float) -> PoisonedSample:
    """Data whose one bad sample reaches `rank` in optimizer step `step_in_epoch` (1-based) of `epoch`."""
    position = (step_in_epoch - 1) * BATCH * world_size + rank  # rank r trains positions r, r+W, ...
    return PoisonedSample(int(epoch_order(SIZE, 0, epoch)[position]), epoch, value)


def trainer_on(data: PoisonedSample, tmp_path: Path, world_size: int) -> MultiGPUTrainer:
    trainer = MultiGPUTrainer(tiny_model(), data, None, config_for(tmp_path, world_size, batch_size=BATCH))
    data.sampler = trainer.sampler
    return trainer


def train_until_stopped(tmp_path: Path, world_size: int, rank: int, data: PoisonedSample) -> dict[str, Any]:
    """fp32 training over poisoned data: the stop message and what is left in --save-dir."""
    trainer = trainer_on(data, tmp_path, world_size)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit()
    assert trainer.config.save_dir is not None  # the run folder, chosen at construction
    save_dir = Path(trainer.config.save_dir)
    last = (
        checkpoint.load(str(save_dir / "last.pt")) if rank == 0 and (save_dir / "last.pt").exists() else None
    )
    return {
        "message": str(stopped.value),
        "save_dir": str(save_dir),
        "files": sorted(p.name for p in save_dir.glob("*.pt")),
        "last_step": last and last["global_step"],
        "last_finite": last and all(t.isfinite().all() for t in last["model"].values()),
    }


def train_fp16_with_scaler(tmp_path: Path, world_size: int, data: PoisonedSample) -> dict[str, Any]:
    """The same training with fp16 autocast and a GradScaler: the step with the bad sample is skipped."""
    trainer = trainer_on(data, tmp_path, world_size)
    forward_dtypes = use_fp16_on_cpu(trainer)  # scale 1024
    taken = []
    trainer.optimizer.register_step_pre_hook(lambda *args: taken.append(1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit()
    logged = read_scalars(Path(trainer.config.tensorboard_dir)) if trainer.runtime.is_main else {}
    return {
        "steps": trainer.progress.global_step,
        "optimizer_steps": len(taken),
        "scale": trainer.scaler.get_scale(),
        "logged_skips": sum(value for _, value in logged.get("train/skipped_steps", [])),
        "finite": all(t.isfinite().all() for t in trainer.model.state_dict().values()),
        "float16_forwards": forward_dtypes.count(torch.float16) == len(forward_dtypes) > 0,
        "lines": [line for line in printed.getvalue().splitlines() if "loss scaler skipped" in line],
    }


def _rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    # The bad sample reaches rank 1 only, in the last step of epoch 2 (global step 16): that step is a sync
    # point followed by the epoch-end save, which must not happen.
    stopped = train_until_stopped(
        tmp_path / "fp32",
        world_size,
        rank,
        poisoned_at(epoch=1, step_in_epoch=8, rank=1, world_size=world_size, value=float("nan")),
    )
    # fp16: rank 1 again, in step 3 of epoch 1.
    fp16 = train_fp16_with_scaler(
        tmp_path / "fp16",
        world_size,
        poisoned_at(epoch=0, step_in_epoch=3, rank=1, world_size=world_size, value=float("nan")),
    )
    return {"stopped": stopped, "fp16": fp16}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp_path = tmp_path_factory.mktemp("nonfinite")
    return run_ranks(_rank, WORLD, tmp_path, tmp_path)


def test_nan_on_one_rank_stops_every_rank_naming_the_step_and_keeping_the_last_checkpoint(ranks):
    messages = {result["stopped"]["message"] for result in ranks}
    assert len(messages) == 1  # every rank stopped, with the same verdict (no rank left waiting)
    message = messages.pop()
    assert "loss became non-finite at step 16" in message
    stopped = ranks[0]["stopped"]
    assert message.endswith(f"last good checkpoint kept: {stopped['save_dir']}/last.pt")
    assert stopped["files"] == ["last.pt"]  # epoch 1's; step 16's epoch-end save did not happen
    assert stopped["last_step"] == 8 and stopped["last_finite"]


def test_inf_loss_stops_a_single_process_before_any_checkpoint(tmp_path):
    result = train_until_stopped(
        tmp_path, 1, 0, poisoned_at(epoch=0, step_in_epoch=3, rank=0, world_size=1, value=float("inf"))
    )
    assert "loss became non-finite at step 3" in result["message"]
    assert "none written by this run" in result["message"]
    assert result["files"] == []


def test_fp16_scaler_skips_the_bad_step_counts_it_once_and_keeps_training(ranks):
    for result in ranks:
        fp16 = result["fp16"]
        assert fp16["finite"] and fp16["float16_forwards"]
        assert fp16["steps"] == 16 and fp16["optimizer_steps"] == 15  # one step skipped on every rank
        assert fp16["scale"] == 2.0**9  # backed off once
    assert ranks[0]["fp16"]["logged_skips"] == 1  # one skip, not one per rank
    assert ranks[0]["fp16"]["lines"] == [
        "steps 1-5: the fp16 loss scaler skipped 1 step(s) with inf/NaN gradients "
        "(weights unchanged there); loss scale now 512"
    ]
    assert ranks[1]["fp16"]["lines"] == []
