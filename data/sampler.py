"""Samplers that give every rank its share of the data, resumable mid-epoch.

Training uses a DistributedSampler that can also start in the middle of an
epoch without iterating the skipped items (PITFALLS 10). Evaluation does not
use DistributedSampler at all: it pads the last shard with repeated samples,
which makes validation numbers wrong (PITFALLS 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler

from multigpu.errors import UsageError


def epoch_order(dataset_size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of one epoch, a pure function of (seed, epoch): the same on every rank and every rerun."""
    if not shuffle:
        return torch.arange(dataset_size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


class ResumableDistributedSampler(DistributedSampler):
    """Training sampler: rank r takes positions r, r+W, r+2W, ... of the epoch's global order.

    A DistributedSampler with drop_last=True (it is one, so code that checks for
    one finds it), plus `start_at`.

    Interleaving makes global batch i of W ranks with batch B exactly batch i of
    one process with batch W*B, so 1 and W devices see the same data.
    The order's tail is trimmed to a multiple of W so every rank has the same
    number of batches (unequal counts hang the next collective, PITFALLS 3);
    at most W-1 samples per epoch are left out, different ones each epoch.

    `start_at(epoch, consumed)` resumes after `consumed` global samples of that
    epoch without touching the skipped ones; it also works when the world size
    changed, because the position is counted in global samples.
    """

    def __init__(
        self, dataset_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True
    ):
        super().__init__(
            range(dataset_size),  # type: ignore[arg-type]  # it reads only the length of what it is given
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.dataset_size, self.world_size = dataset_size, world_size
        self.consumed = 0
        self.usable = dataset_size - dataset_size % world_size
        if self.usable == 0:
            raise UsageError(
                f"a training set of {dataset_size} sample(s) cannot be shared by {world_size} ranks, "
                f"each needs at least one: use a larger training set or fewer processes"
            )

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (call once per epoch, as with DistributedSampler)."""
        self.start_at(epoch, 0)

    def start_at(self, epoch: int, consumed: int) -> None:
        """Start `epoch` after its first `consumed` global samples."""
        self.epoch, self.consumed = epoch, min(consumed, self.dataset_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def indices(self) -> torch.Tensor:
        """This rank's sample indices for the rest of the epoch, in order, as one tensor (what __iter__ yields):
        data kept on the device gathers its batches with them (data/device_data.py)."""
        order = epoch_order(self.dataset_size, self.seed, self.epoch, self.shuffle)
        return order[self.consumed : self._end()][self.rank :: self.world_size]

    def __len__(self) -> int:
        return (self._end() - self.consumed) // self.world_size

    def _end(self) -> int:
        # What is left of the epoch's order is trimmed to this world size, not the whole epoch: after a resume
        # with another world size, trimming the epoch's remainder too would drop samples no rank saw.
        remaining = self.dataset_size - self.consumed
        return self.consumed + remaining - remaining % self.world_size


class ShardedBatchSampler(Sampler[list[int]]):
    """Evaluation batches: the set is cut into the same fixed batches whatever the world size,
    and rank r takes batches r, r+W, r+2W, ... with no padding.

    Every sample is seen exactly once, and each batch holds the same samples as in
    one process, so per-batch results are bit-identical for any world size. Ranks
    may get one batch more or less: fine, evaluation has no collective per batch.
    """

    def __init__(self, dataset_size: int, batch_size: int, rank: int = 0, world_size: int = 1):
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.num_batches = (dataset_size + batch_size - 1) // batch_size
        self.batch_indices = range(
            rank, self.num_batches, world_size
        )  # global numbers of this rank's batches

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batch_indices:
            yield list(range(batch * self.batch_size, min((batch + 1) * self.batch_size, self.dataset_size)))

    def __len__(self) -> int:
        return len(self.batch_indices)


def windows(
    batches: Iterator[Any], samples: int, micro_batch: int, micro_batches: int
) -> Iterator[tuple[Iterator[Any], int, list[int], bool]]:
    """This rank's optimizer steps over its `samples` left in the epoch, read from `batches` (the loader over
    the sampler): (the batches, the window's samples, each micro-batch's size, whether it is the epoch's last).
    The sampler gives every rank the same number of samples: full windows of `micro_batches` micro-batches of
    `micro_batch`, then what is left, so every rank takes the same number of steps."""
    full_window = micro_batches * micro_batch
    full_sizes = [micro_batch] * micro_batches  # built once: most steps are full windows
    while samples > 0:
        window = min(full_window, samples)
        samples -= window
        sizes = (
            full_sizes
            if window == full_window
            else [micro_batch] * ((window - 1) // micro_batch)
            + [window - (window - 1) // micro_batch * micro_batch]
        )
        yield batches, window, sizes, samples == 0
