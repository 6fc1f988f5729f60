"""Where each training step's samples come from: a map-style set's sampler and its batches (gathered on the
device, or read by a loader), or a stream's split over ranks and workers; the epoch as windows of micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

from multigpu.config import TrainConfig
from multigpu.data import build_loader, streaming
from multigpu.data.device_data import DeviceData
from multigpu.data.sampler import ResumableDistributedSampler, windows
from multigpu.lr_scaling import effective_batch
from multigpu.parallel.distributed import Runtime


@dataclass
class BatchSizes:
    """--batch-size is per device; DataParallel splits its process's bigger batch over its GPUs."""

    loader: int  # samples per micro-batch of one process
    evaluation: int  # per process, for evaluation and prediction
    effective: int  # samples per optimizer step, all devices and micro-steps together


def batch_sizes(config: TrainConfig, runtime: Runtime) -> BatchSizes:
    per_step = max(1, len(runtime.dp_device_ids))
    assert isinstance(config.batch_size, int), "--batch-size auto is resolved before"
    return BatchSizes(
        config.batch_size * per_step,
        (config.eval_batch_size or config.batch_size) * per_step,
        effective_batch(config, runtime.devices_per_step * runtime.replica_groups),
    )


@dataclass
class TrainingData:
    """Where each step's samples come from."""

    sampler: Any  # this rank's share of every epoch, resumable mid-epoch (a stream keeps its own position)
    stream: streaming.TrainStream | None  # an IterableDataset's split, ends and position; None for map-style
    loader: Any  # the batches in use: a DataLoader, or the device's (data/device_data.py)
    steps_per_epoch: (
        int  # 0: a stream without __len__, whose epoch is one pass of steps unknown until it ends
    )
    loader_batch: int  # samples per micro-batch of this process
    grad_accum_steps: int  # micro-batches per optimizer step
    ways: dict[bool, Any] = field(
        default_factory=dict
    )  # --data-on-device auto's two: on the device (True), loader
    _epoch: _Batches | None = None  # the batches the epoch's windows read

    def windows(self, say: Callable[[str], None]) -> Iterator[streaming.Window]:
        """The rest of the epoch's steps: (micro-batches, samples, their sizes, last step of the epoch), the
        same number on every rank."""
        if self.stream is not None:
            return self.stream.windows(say)
        self._epoch = _Batches(iter(self.loader))
        return windows(self._epoch, len(self.sampler), self.loader_batch, self.grad_accum_steps)

    def use_device(self, on: bool, epoch: int, samples_in_epoch: int) -> None:
        """--data-on-device auto's trials, between two steps: the rest of the epoch's batches gathered on the
        device (`on`) or read by the loader, from where the epoch is (`samples_in_epoch`, all ranks together):
        the same batches either way."""
        if self.loader is self.ways[on]:
            return
        self.loader = self.ways[on]
        if self._epoch is not None:
            self.sampler.start_at(epoch, samples_in_epoch)
            self._epoch.iterator = iter(self.loader)

    def device_step_seconds(self, clock: Callable[[], float]) -> float:
        """What a step's batches cost on the device, by `clock`: the loader's way can save at most that."""
        return self.ways[True].batch_seconds(clock) * self.grad_accum_steps

    def steps_done(self, epoch: int, samples_in_epoch: int) -> int:
        """Optimizer steps of the epoch already taken, `samples_in_epoch` into it; also points the sampler at the
        rest."""
        if self.stream is not None:
            return self.stream.steps_in_epoch
        self.sampler.start_at(epoch, samples_in_epoch)
        return self.steps_per_epoch - math.ceil(
            len(self.sampler) / (self.loader_batch * self.grad_accum_steps)
        )


class _Batches:
    """An epoch's batches, from whichever way `iterator` reads them now."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        return next(self.iterator)


def why_ranks_cannot_join(config: TrainConfig, runtime: Runtime) -> str | None:
    """Why the ranks that run out of a stream cannot join the others' steps (data/streaming.py, "Uneven ends");
    None where they can: DDP, whose gradient all-reduce the step can take over (multigpu/loop/join.py)."""
    if runtime.world_size == 1:
        return ""
    if runtime.mode == "fsdp":
        return "fsdp: a rank without a batch cannot take part in the others' sharded forward and backward"
    if runtime.mode != "ddp":
        return f"--multi-gpu {runtime.mode}"
    if config.sync_bn and runtime.device.type == "cuda":  # what multigpu/parallel/wrapping.py converts
        return "--sync-bn: each forward gathers the batch statistics of every rank"
    return None


def training_data(
    dataset: Any,
    config: TrainConfig,
    runtime: Runtime,
    loader_batch: int,
    collate_fn: Callable | None,
    on_device: DeviceData,
) -> TrainingData:
    """A map-style set's sampler and its batches, gathered on the device (--data-on-device) or read by a
    loader (workers, pinned memory on CUDA); or a stream's split over ranks and workers (data/streaming.py)."""
    accumulate = config.grad_accum_steps
    if streaming.is_stream(dataset):
        stream = streaming.TrainStream(
            dataset,
            runtime,
            loader_batch,
            accumulate,
            config.steps_per_epoch,
            config.num_workers,
            config.seed,
            collate_fn,
            build_loader,
            config.max_steps,
            why_ranks_cannot_join(config, runtime),
        )
        return TrainingData(
            stream, stream, stream.loader, stream.steps_per_epoch or 0, loader_batch, accumulate
        )
    # Each process's share of every step; with --fault-tolerance each replica group's processes read their own.
    sampler = ResumableDistributedSampler(len(dataset), runtime.data_rank, runtime.data_ranks, config.seed)
    ways = {}
    if on_device.on:
        ways[True] = on_device.batches(sampler, loader_batch, config.seed)
    if not on_device.on or on_device.measured:  # a DataLoader starts no worker before it is iterated
        ways[False] = build_loader(
            dataset,
            runtime.device,
            config.num_workers,
            config.seed + runtime.data_rank,
            sampler=sampler,
            batch_size=loader_batch,
            collate_fn=collate_fn,
        )
    return TrainingData(
        sampler,
        None,
        ways[on_device.on],
        math.ceil(len(sampler) / (loader_batch * accumulate)),
        loader_batch,
        accumulate,
        ways,
    )
