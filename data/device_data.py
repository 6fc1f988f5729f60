"""--data-on-device: the training set moved to the device once, each step's batch gathered there
(docs/speed.md, "Data on the device").

A step then costs an index_select per column: no loader workers, no pinned copies, no host work per sample.
The batches hold the samples the loader would give in the same order (the sampler's indices, gathered on the
device), stacked as the loader's collate stacks them, so training is bit-identical to the loader's path.

What qualifies, decided from the data set's type without reading it:
- a TensorDataset: its tensors as they are (on the CPU nothing is copied);
- a data set whose `fixed_samples` is True, which promises that sample i is always the same tensors or numbers
  of one shape (the built-in synthetic, fake, MNIST-family, CIFAR and text sets): read once, through the
  loader and its workers, into one tensor per field;
- either of these inside data.augment.RandomCropFlip: gathered from the inner set, each batch then cropped and
  flipped on the device, from a generator seeded by (seed, rank, epoch, the batch's place in the epoch), so a
  rerun and a resume draw the same crops without any generator state in the checkpoint.
Every rank holds the whole set: its sampler's share changes every epoch. The evaluation keeps its loader (one
pass an epoch); a stream (IterableDataset) has no index to gather by and keeps its loader too.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from typing import Any, Callable

import numpy
import torch
from torch.utils.data import Dataset, TensorDataset

from multigpu.config import AUTO, TrainConfig
from multigpu.errors import UsageError

DEVICE_SHARE = 0.25  # of a GPU's memory (of the memory available, shared by the local processes, on the CPU)
READ_BATCH = 256  # samples per batch of the one read of a `fixed_samples` set


class DeviceData:
    """The run's --data-on-device choice: `line` says it for the plan; where `on`, the training set is on the
    device already (`columns`, one tensor per field of its samples) and `batches` gives the training loader's
    stand-in."""

    def __init__(
        self,
        dataset: Dataset,
        config: TrainConfig,
        device: torch.device,
        world_size: int,
        collate_fn: Callable | None,
        stream: bool,
    ):
        self.on = False
        self.columns: list[torch.Tensor] = []  # one tensor per field of the samples, on the device
        self.augment: Callable | None = None
        self.bare = False
        self.measured = False  # auto: the first steps measure it against the loader, and the faster way stays
        if config.data_on_device == "off":
            self.line = "data: read by the loader (--data-on-device off)"
            return
        why_not = _why_not(dataset, config, device, world_size, collate_fn, stream)
        if why_not is not None:
            if config.data_on_device == "on":
                raise UsageError(
                    f"--data-on-device on: {why_not}; use --data-on-device auto (or off) to read it "
                    f"with the loader"
                )
            self.line = f"data: read by the loader: {why_not}"
            return
        source = (
            "already in this process's memory, used as it is"
            if _new_bytes(dataset, device) == 0
            else "read once into this process's memory"
            if device.type == "cpu"
            else f"moved to {device} once"
        )
        ranks = "; each rank holds all of it (its share changes every epoch)" if world_size > 1 else ""
        augmented = ", each batch cropped and flipped there" if _inner(dataset) is not dataset else ""
        loader = (
            "the loader's instead if the first steps measure it faster (--data-on-device auto)"
            if config.data_on_device == AUTO
            else "no loader"
        )
        self.line = (
            f"data: the training set on the device ({len(dataset):,} samples, "  # type: ignore[arg-type]  # map-style
            f"{_megabytes(_set_bytes(dataset))}, {source}{ranks}), batches gathered there{augmented}; "
            f"{loader}"
        )
        try:
            self.columns, self.bare = columns(dataset, device, config.num_workers)
        except UsageError as error:  # a field that is not a tensor, or changes shape: seen only while reading
            if config.data_on_device == "on":
                raise
            self.line = f"data: read by the loader: {str(error).split(': ', 1)[1].split('; give')[0]}"
            return
        self.on, self.measured = True, config.data_on_device == AUTO
        self.augment = dataset.augment if _inner(dataset) is not dataset else None  # type: ignore[attr-defined]  # a wrapper's
        self.device = device

    def batches(self, sampler: Any, batch_size: int, seed: int) -> DeviceBatches:
        """What the trainer iterates instead of a loader: batches of `batch_size` from `sampler`'s indices."""
        return DeviceBatches(self, sampler, batch_size, seed)


def _why_not(
    dataset: Dataset,
    config: TrainConfig,
    device: torch.device,
    world_size: int,
    collate_fn: Callable | None,
    stream: bool,
) -> str | None:
    """Why this training set cannot (or, under auto, should not) live on the device; None where it can."""
    if stream:
        return "a stream (IterableDataset) has no index to gather a batch by"
    if collate_fn is not None:
        return "a collate_fn makes its batches"
    if config.data_on_device == AUTO and config.num_workers:
        return f"--num-workers {config.num_workers} asks for loader workers"
    inner = _inner(dataset)
    if not (isinstance(inner, TensorDataset) or getattr(inner, "fixed_samples", False)):
        return (
            f"a {type(dataset).__name__} is neither a TensorDataset nor a set whose samples never change "
            f"(fixed_samples = True)"
        )
    needed, budget = _new_bytes(dataset, device), _budget(device)
    if needed > budget:
        shared = ", shared by the local processes" if device.type == "cpu" else ""
        return (
            f"its {_megabytes(needed)} are more than the {_megabytes(budget)} data may take on {device} "
            f"({DEVICE_SHARE:.0%} of its memory{shared})"
        )
    if (
        config.data_on_device == AUTO
        and not isinstance(inner, TensorDataset)
        and config.max_steps
        and isinstance(config.batch_size, int)
    ):
        planned = config.max_steps * config.batch_size * config.grad_accum_steps  # this rank's, at most
        size = len(dataset)  # type: ignore[arg-type]  # a map-style set (not a stream): it has __len__
        if planned * world_size < size:
            return (
                f"--max-steps {config.max_steps} reads {planned:,} samples per rank, fewer than the set's "
                f"{size:,}, which would all be read once first"
            )
    return None


def _inner(dataset: Dataset) -> Dataset:
    """The set that holds the samples: `dataset`, or the one a RandomCropFlip augments."""
    from multigpu.data.augment import RandomCropFlip

    return dataset.dataset if isinstance(dataset, RandomCropFlip) else dataset


def _in_place(dataset: Dataset, device: torch.device) -> bool:
    inner = _inner(dataset)
    return isinstance(inner, TensorDataset) and all(tensor.device == device for tensor in inner.tensors)


def _set_bytes(dataset: Dataset) -> int:
    """The training set's bytes as tensors: its tensors', or its first sample's times its length."""
    inner = _inner(dataset)
    if isinstance(inner, TensorDataset):
        return sum(tensor.numel() * tensor.element_size() for tensor in inner.tensors)
    fields = inner[0]
    fields = fields if isinstance(fields, (tuple, list)) else (fields,)
    per_sample = sum(
        field.numel() * field.element_size() if isinstance(field, torch.Tensor) else 8 for field in fields
    )
    return len(inner) * per_sample  # type: ignore[arg-type]  # a map-style set (not a stream): it has __len__


def _new_bytes(dataset: Dataset, device: torch.device) -> int:
    return 0 if _in_place(dataset, device) else _set_bytes(dataset)


def _budget(device: torch.device) -> int:
    """Bytes the training set may take on `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(min(DEVICE_SHARE * total, free))
    from multigpu.data import available_memory

    available = available_memory() or 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return int(DEVICE_SHARE * available / max(1, local))


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB" if count >= 100_000 else f"{count / 1e3:,.1f} kB"


# ---------------------------------------------------------------------------- the set on the device
def columns(
    dataset: Dataset, device: torch.device, num_workers: int | None
) -> tuple[list[torch.Tensor], bool]:
    """The training set as one tensor per field of its samples, on `device` (row i of each is sample i's), and
    whether a sample is one bare tensor rather than a tuple of fields (its batches are then one tensor too)."""
    inner = _inner(dataset)
    if isinstance(inner, TensorDataset):
        return [tensor.to(device) for tensor in inner.tensors], False
    return _read_once(inner, device, num_workers)


def _read_once(
    dataset: Dataset, device: torch.device, num_workers: int | None
) -> tuple[list[torch.Tensor], bool]:
    """Every sample read once, in order, through a loader (its workers, its collate: the dtypes the training
    loader's batches have), into preallocated tensors on `device`; UsageError where a field is not a tensor or
    number, or changes shape."""
    from multigpu.data import build_loader

    size = len(dataset)  # type: ignore[arg-type]  # a map-style set: it has __len__
    loader = build_loader(dataset, device, num_workers, batch_size=READ_BATCH, persistent_workers=False)
    stored: list[torch.Tensor] = []
    start, bare = 0, False
    for batch in loader:
        bare = isinstance(batch, torch.Tensor)
        fields = [batch] if bare else batch if isinstance(batch, (tuple, list)) else [batch]
        if not stored:
            for field in fields:
                if not isinstance(field, torch.Tensor):
                    raise UsageError(
                        f"--data-on-device: a sample of {type(dataset).__name__} holds a "
                        f"{type(field).__name__}, not only tensors and numbers; give --data-on-device "
                        f"off"
                    )
            stored = [
                torch.empty((size, *field.shape[1:]), dtype=field.dtype, device=device) for field in fields
            ]
        for column, field in zip(stored, fields):
            if field.shape[1:] != column.shape[1:]:
                raise UsageError(
                    f"--data-on-device: the samples of {type(dataset).__name__} change shape "
                    f"({tuple(column.shape[1:])} then {tuple(field.shape[1:])}); give --data-on-device "
                    f"off"
                )
            column[start : start + len(field)].copy_(field, non_blocking=True)
        start += len(fields[0])
    return stored, bare


class DeviceBatches:
    """The training loader's stand-in: iterating it gives the rest of the epoch's batches, gathered on the device
    from `sampler`'s indices (and augmented there); `num_workers` is 0, as telemetry asks a loader."""

    num_workers = 0

    def __init__(self, data: DeviceData, sampler: Any, batch_size: int, seed: int):
        self.columns, self.augment, self.device, self.bare = (
            data.columns,
            data.augment,
            data.device,
            data.bare,
        )
        self.sampler, self.batch_size, self.seed = sampler, batch_size, seed
        self.generator = torch.Generator(device=self.device) if self.augment is not None else None
        # On the CPU, numpy's take copies whole rows on one thread: index_select of images there parallelises a
        # 64-row copy over the intra-op threads, 3-8x slower than the loader's stack when the cores are busy
        # (docs/speed.md, "Data on the device").
        self.arrays = [_as_array(column) for column in self.columns] if self.device.type == "cpu" else []

    def __iter__(self) -> Iterator[Any]:
        sampler, size = self.sampler, self.batch_size
        epoch, consumed, order = sampler.epoch, sampler.consumed, sampler.indices().to(self.device)
        for first in range(0, len(order), size):
            index = order[first : first + size]
            batch = self._gather(index)
            if self.augment is not None:
                # Seeded by where the batch is in the epoch: a rerun and a resume draw the same crops and flips.
                place = consumed + first * sampler.world_size
                self.generator.manual_seed(_key(self.seed, sampler.rank, epoch, place))  # type: ignore[union-attr]  # set with augment
                batch[0] = self.augment(batch[0], self.generator)
            yield batch[0] if self.bare else batch

    def batch_seconds(self, clock: Callable[[], float], repeats: int = 3) -> float:
        """What a batch costs on the device, by `clock` (the autotuner's): the median of `repeats` gathers (and
        augmentations) of a batch of the set's first rows, leaving the epoch's batches and generator alone."""
        index = torch.arange(min(self.batch_size, len(self.columns[0])), device=self.device)
        generator = torch.Generator(device=self.device)
        times = []
        for _ in range(repeats):
            started = clock()
            batch = self._gather(index)
            if self.augment is not None:
                self.augment(batch[0], generator)
            times.append(clock() - started)
        return statistics.median(times)

    def _gather(self, index: torch.Tensor) -> list[torch.Tensor]:
        if not self.arrays:
            return [column.index_select(0, index) for column in self.columns]
        rows = index.numpy()
        return [
            column.index_select(0, index)
            if array is None
            else torch.from_numpy(numpy.take(array, rows, axis=0))
            for column, array in zip(self.columns, self.arrays)
        ]


def _as_array(column: torch.Tensor) -> Any | None:
    """A numpy view of a CPU column whose rows are worth numpy's copy (a label's are not), else None."""
    if column[0].numel() < 64:
        return None
    try:
        return column.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a tensor that needs grad
        return None


def _key(*parts: int) -> int:
    """A 63-bit generator seed of `parts`, different for any two tuples a run meets."""
    key = 0
    for part in parts:
        key = (key * 1_000_003 + part) % (2**63)
    return key
