"""Batches of any structure, as the data arrive: their size, moving them to a device, cutting and joining them.

A batch is an `(inputs, targets)` pair, a dict (Hugging Face style), or any
nesting of tuples, lists, namedtuples and dicts of tensors; every function
here keeps that structure. How a batch becomes outputs, targets and a loss is
multigpu/loop/forward.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils.data import default_collate


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """`batch` with `fn` applied to every tensor in it, its structure (dicts, lists, tuples, namedtuples) kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {key: map_tensors(fn, value) for key, value in batch.items()}
        return mapped if type(batch) is dict else type(batch)(mapped)  # type: ignore[call-arg]  # its own class
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(map_tensors(fn, value) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, value) for value in batch)
    return batch


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """`batch` with every tensor in it on `device` (non_blocking: pinned host memory overlaps the copy).

    With `channels_last`, image batches (4-D floating-point tensors) are made
    channels-last on the device, after the copy, where the conversion is cheap.
    """

    def move(tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(device, non_blocking=True)
        if channels_last and moved.dim() == 4 and moved.is_floating_point():
            return moved.contiguous(memory_format=torch.channels_last)
        return moved

    return map_tensors(move, batch)


def batch_mover(device: torch.device, channels_last: bool = False) -> Callable[[Any], Any]:
    """What the training loop calls on each batch: `to_device`, or nothing on the CPU without channels-last,
    where the loader's batches already are (a per-step saving, docs/speed.md "Speed")."""
    if device.type == "cpu" and not channels_last:
        return _as_it_is
    return functools.partial(to_device, device=device, channels_last=channels_last)


def _as_it_is(batch: Any) -> Any:
    return batch


def batch_size(batch: Any) -> int:
    """Samples in `batch`: the first dimension of its first tensor."""
    if (
        type(batch) is list or type(batch) is tuple
    ):  # the usual (inputs, targets) pair, without the general walk
        first = batch[0] if batch else None
        if type(first) is torch.Tensor and first.dim():
            return first.shape[0]
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = (
        batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    )
    for value in values:
        size = batch_size(value)
        if size >= 0:
            return size
    return -1


def split(batch: Any, sizes: list[int]) -> list[Any]:
    """`batch` cut along its first dimension into consecutive parts of `sizes` samples, each with the
    batch's structure (views, no copies); what is not a tensor is shared by every part."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(sizes))
    if isinstance(batch, Mapping):
        columns = {key: split(value, sizes) for key, value in batch.items()}
        parts = [{key: column[i] for key, column in columns.items()} for i in range(len(sizes))]
        return parts if type(batch) is dict else [type(batch)(part) for part in parts]  # type: ignore[call-arg]  # its own class
    if isinstance(batch, (list, tuple)):
        rows = zip(*(split(value, sizes) for value in batch)) if batch else [()] * len(sizes)
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    return [batch] * len(sizes)


def concat(parts: list[Any]) -> Any:
    """The inverse of `split`: parts of one structure joined along the first dimension of each tensor.

    ValueError for a tensor without a batch dimension (a batch's loss, say): it cannot be
    given back per sample.
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(
                "an output without a batch dimension (a 0-dim tensor) cannot be joined sample by "
                "sample; return per-sample outputs, or pass a forward_fn that selects them"
            )
        return torch.cat(parts)
    if isinstance(first, Mapping):
        joined = {key: concat([part[key] for part in parts]) for key in first}
        return joined if type(first) is dict else type(first)(joined)  # type: ignore[call-arg]  # its own class
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat(list(column)) for column in zip(*parts)))
    if isinstance(first, (list, tuple)):
        return type(first)(concat(list(column)) for column in zip(*parts))
    if first is None or all(part == first for part in parts[1:]):
        return first
    raise ValueError(
        f"outputs must be tensors or tuples/lists/dicts of them to be joined sample by sample; "
        f"got {type(first).__name__} values that differ between batches"
    )


def sample_batch(dataset: Any, size: int, collate_fn: Callable | None = None) -> Any:
    """A batch of the data set's first `size` samples (fewer if it has fewer), collated as the loader does.
    For measuring a step at start (FLOPs, the batch size that fits), not for training."""
    return (collate_fn or default_collate)([dataset[index] for index in range(min(size, len(dataset)))])


def repeat_batch(batch: Any, size: int) -> Any:
    """`batch` with every tensor's first dimension cycled to `size` rows (structure kept)."""
    return map_tensors(
        lambda tensor: tensor[torch.arange(size) % tensor.shape[0]] if tensor.dim() else tensor, batch
    )
