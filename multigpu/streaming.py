"""Streaming training data: a `torch.utils.data.IterableDataset`, split over ranks and DataLoader workers,
ended together by every rank, and resumed at the exact sample (MULTI_GPU_GUIDE.md, "Your own data").

Sharding. A dataset that shards itself declares it with `shards_itself = True`
and reads its rank from the RANK and WORLD_SIZE variables torchrun sets (they
reach DataLoader workers, where the process group is not to be relied on) and
its worker from `torch.utils.data.get_worker_info()` in `__iter__`; the trainer
then takes what each (rank, worker) yields.
Any other stream is split by the trainer: every (rank, worker) reads the
stream and keeps positions `slot, slot + S, slot + 2S, ...` where
`S = world size x workers` and `slot = worker x world size + rank`, so every
sample of a pass goes to exactly one (rank, worker).

Uneven ends. A step happens only if every rank has a full window of
micro-batches: one all-reduce (MIN) of a 1-element flag per step, for streams
only. When some rank runs out, all end the pass at the same step, and the
samples the others still held are counted and reported.

Resume. The checkpoint's "stream_state" holds the pass, the steps of the epoch
and the samples each slot has handed to training. A trainer-split stream skips
exactly those positions at any world size or worker count; a self-sharding one
skips each slot's count and needs the same world size and workers.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from multigpu.distributed import all_reduce_sum, gather_objects, is_distributed
from multigpu.errors import UsageError

Window = tuple[Iterator[Any], int, list[int], bool]  # (micro-batches, samples, their sizes, last of the epoch)


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read as a stream (an IterableDataset) rather than by index."""
    return isinstance(dataset, IterableDataset)


def shards_itself(dataset: Any) -> bool:
    """The sharding protocol: a dataset that splits itself by rank and worker says so with this attribute."""
    return bool(getattr(dataset, "shards_itself", False))


def stream_length(dataset: Any) -> Optional[int]:
    """len(dataset) where the stream has one, else None."""
    try:
        return len(dataset)
    except TypeError:
        return None


class StreamShard(IterableDataset):
    """What one rank reads of `dataset`: its (rank, worker) share, as (slot, sample) pairs, minus what a
    resumed run already trained on (`skip`: the saved stream state of this pass)."""

    def __init__(self, dataset: Any, rank: int, world_size: int, tagged: bool = True):
        self.dataset, self.rank, self.world_size, self.tagged = dataset, rank, world_size, tagged
        # A resumed pass: the worker that gives the first batch plays the slot that was next (rotate), after
        # rotate_base batches taken before the resume.
        self.rotate, self.rotate_base = 0, 0
        self.pass_number, self.skip = 0, None  # skip: a resumed pass's layers [{"slots": S, "counts": [...]}, ...]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        worker = (worker + self.rotate) % workers  # the DataLoader takes batches from workers 0, 1, ... in turn
        slot, slots = worker * self.world_size + self.rank, workers * self.world_size
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.pass_number)
        for sample in (self._own(slot) if shards_itself(self.dataset) else self._split(slot, slots)):
            yield (slot, sample) if self.tagged else sample

    def _own(self, slot: int) -> Iterator[Any]:
        skip = self.skip[-1]["counts"][slot] if self.skip else 0  # one layer: the layout cannot change
        for position, sample in enumerate(self.dataset):
            if position >= skip:
                yield sample

    def _split(self, slot: int, slots: int) -> Iterator[Any]:
        layers = self.skip or []
        seen = [[0] * layer["slots"] for layer in layers]  # per layer and slot: positions it dealt so far
        for position, sample in enumerate(self.dataset):
            if _trained_before(position, layers, seen):
                continue
            if position % slots == slot:
                yield sample


def _trained_before(position: int, layers: list[dict[str, Any]], seen: list[list[int]]) -> bool:
    """Whether an earlier run trained on this position. Layer k is a run's (slots, counts): its slot s dealt,
    in order, the positions = s (mod slots) that no earlier layer had trained on, and trained the first
    counts[s] of them. Every reader walks the whole stream, so this is exact at any layout."""
    for layer, dealt in zip(layers, seen):
        slot = position % layer["slots"]
        dealt[slot] += 1
        if dealt[slot] <= layer["counts"][slot]:
            return True
    return False


class TaggedCollate:
    """Collates a worker's (slot, sample) pairs: (slot, samples, the user's batch)."""

    def __init__(self, collate_fn: Optional[Callable]):
        self.collate_fn = collate_fn or default_collate

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[int, int, Any]:
        return items[0][0], len(items), self.collate_fn([sample for _, sample in items])


class TrainStream:
    """The training loop's side of a stream: windows of micro-batches that every rank agrees on, and the
    stream's position for checkpoints. Also the few sampler attributes the trainer reads (seed, dataset_size,
    usable, start_at, len)."""

    def __init__(self, dataset: Any, runtime: Any, loader_batch: int, grad_accum: int, steps_per_epoch: int,
                 num_workers: Optional[int], seed: int, collate_fn: Optional[Callable], build_loader: Callable,
                 max_steps: int = 0):
        self.runtime, self.loader_batch, self.grad_accum = runtime, loader_batch, grad_accum
        self.seed, self.dataset_size = seed, stream_length(dataset) or -1
        self.shard = StreamShard(dataset, runtime.rank, runtime.world_size)
        self.loader: DataLoader = build_loader(self.shard, runtime.device, num_workers, seed + runtime.rank,
                                               batch_size=loader_batch, collate_fn=TaggedCollate(collate_fn),
                                               persistent_workers=False)  # each pass's workers see its skip
        length = stream_length(dataset)
        if not steps_per_epoch and length is None:
            if not max_steps:
                raise UsageError("a training stream without __len__ needs --steps-per-epoch N or --max-steps N "
                                 "(steps_per_epoch=N, max_steps=N): the LR schedule, warm-up and progress bar need a "
                                 "length; or give the dataset a __len__")
            steps_per_epoch = max_steps  # an endless stream bounded by --max-steps alone: one epoch of them
        self.fixed_steps = steps_per_epoch  # --steps-per-epoch (0: an epoch is one pass)
        self.steps_per_epoch = steps_per_epoch or max(1, math.ceil(length / (loader_batch * grad_accum
                                                                              * runtime.world_size)))
        self.usable = length if length is not None else self.steps_per_epoch * loader_batch * grad_accum
        self.counts: dict[int, int] = {}  # samples each of this rank's slots handed to training, this pass
        self.batches_taken = 0  # micro-batches this rank trained on, this pass (which worker gives the next)
        self.steps_in_epoch, self.checked = 0, False
        self._batches: Optional[Iterator[Any]] = None  # the pass's loader, kept across --steps-per-epoch epochs

    # --- what the trainer reads of a sampler ---
    def start_at(self, epoch: int, consumed: int) -> None:
        """Nothing to point: the stream's position is its own state."""

    def __len__(self) -> int:
        # A length-sized estimate may fall short of the real pass (workers' partial last batches): never below 0.
        return max(0, self.steps_per_epoch - self.steps_in_epoch) * self.loader_batch * self.grad_accum

    # --- training ---
    def windows(self, report: Callable[[str], None]) -> Iterator[Window]:
        """This epoch's steps: every rank gets the same number; the last is flagged for the sync point.
        An epoch that would start at the end of a pass starts the next pass instead."""
        for _ in range(2):
            if self._batches is None:
                self._batches = iter(self.loader)
            window = self._next_window()
            agreed = self._all_have(window)
            if agreed or self.steps_in_epoch:
                break
            self._end_of_pass(window, report)
        while agreed:
            self.steps_in_epoch += 1
            epoch_full = bool(self.fixed_steps) and self.steps_in_epoch >= self.fixed_steps
            following = None if epoch_full else self._next_window()
            following_agreed = not epoch_full and self._all_have(following)
            for slot, samples, _ in window:  # type: ignore[union-attr]
                self.counts[slot] = self.counts.get(slot, 0) + samples
            self.batches_taken += len(window)  # type: ignore[arg-type]
            self._check_shards(window, report)  # type: ignore[arg-type]
            sizes = [samples for _, samples, _ in window]  # type: ignore[union-attr]
            yield iter([batch for _, _, batch in window]), sum(sizes), sizes, not following_agreed  # type: ignore
            if epoch_full:  # --steps-per-epoch: the pass goes on in the next epoch
                self.steps_in_epoch = 0
                return
            window, agreed = following, following_agreed
        self._end_of_pass(window, report)

    def _next_window(self) -> Optional[list[tuple[int, int, Any]]]:
        window = []
        for item in self._batches:  # type: ignore[union-attr]
            window.append(item)
            if len(window) == self.grad_accum:
                return window
        return window or None  # a short window still counts toward the unused samples

    def _all_have(self, window: Optional[list]) -> bool:
        """Whether every rank has a full window: one MIN all-reduce of a 1-element flag (a host sync per step,
        for streams only: the price of never hanging at an uneven end)."""
        mine = window is not None and len(window) == self.grad_accum
        if not is_distributed():
            return mine
        # Through the project's own all-reduce, so the hang watchdog and --debug-collectives see it too:
        # every rank has a full window exactly when the flags sum to the world size.
        flag = all_reduce_sum(torch.tensor([float(mine)], device=self.runtime.device))
        return bool(flag.item() == self.runtime.world_size)

    def _end_of_pass(self, window: Optional[list], report: Callable[[str], None]) -> None:
        """Count what this rank still held, tell the user, and start the next pass at its beginning."""
        unused = sum(samples for _, samples, _ in window or ())
        unused += sum(samples for _, samples, _ in self._batches)  # type: ignore[union-attr]
        counts = gather_objects(unused)
        if any(counts):
            report(f"end of the stream's pass {self.shard.pass_number + 1}: ranks ran out at different steps and "
                   f"ended it together; samples left unused: " +
                   ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts)))
        self.shard.pass_number += 1
        self.shard.skip, self.shard.rotate, self.shard.rotate_base = None, 0, 0
        self.counts, self.steps_in_epoch = {}, 0
        self._batches, self.batches_taken = None, 0

    def _check_shards(self, window: list, report: Callable[[str], None]) -> None:
        """Once: a self-sharding stream whose ranks all read the same first batch reads everything everywhere."""
        if self.checked or not shards_itself(self.shard.dataset):
            return
        self.checked = True
        digests = gather_objects(_digest(window[0][2]))
        if len(digests) > 1 and len(set(digests)) == 1:
            report("warning: every rank read the same first batch: the dataset says shards_itself but does not "
                   "split by rank; read the RANK and WORLD_SIZE variables in its __iter__, or drop shards_itself "
                   "and let the trainer split it (MULTI_GPU_GUIDE.md, \"Your own data\")")

    # --- checkpoints ---
    def state_dict(self) -> dict[str, Any]:
        """The position of the stream (every rank must call it: the ranks' counts are gathered)."""
        workers = max(1, self.loader.num_workers)
        slots = workers * self.runtime.world_size
        counts = [0] * slots
        for rank_counts in gather_objects(self.counts):
            for slot, n in rank_counts.items():  # type: ignore[union-attr]
                counts[slot] = n
        layers = [dict(layer) for layer in self.shard.skip or []]
        if layers and layers[-1]["slots"] == slots:  # the same layout continues its last layer
            layers[-1]["counts"] = [n + old for n, old in zip(counts, layers[-1]["counts"])]
        else:
            layers.append({"slots": slots, "counts": counts})
        return {"pass": self.shard.pass_number, "steps_in_epoch": self.steps_in_epoch, "layers": layers,
                "batches_taken": gather_objects(self.batches_taken + self.shard.rotate_base),
                "world_size": self.runtime.world_size, "workers": workers,
                "shards_itself": shards_itself(self.shard.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved pass where it stopped; a self-sharding stream needs the same layout."""
        if not state:
            raise UsageError("the checkpoint holds no stream position (saved with map-style data): resume it with "
                             "that data, or start this stream with a new --save-dir")
        workers, world = max(1, self.loader.num_workers), self.runtime.world_size
        if state["shards_itself"] and (state["world_size"], state["workers"]) != (world, workers):
            raise UsageError(f"the checkpoint holds the position of a stream that shards itself over {state['world_size']} "
                             f"rank(s) x {state['workers']} worker(s), which cannot be re-split for {world} x "
                             f"{workers}: resume with that layout, or drop shards_itself so the trainer splits it")
        self.shard.pass_number, self.steps_in_epoch = state["pass"], state["steps_in_epoch"]
        self.shard.skip, self.counts = [dict(layer) for layer in state["layers"]], {}
        if (state["world_size"], state["workers"]) == (world, workers):  # the same batches in the same order
            self.shard.rotate_base = state["batches_taken"][self.runtime.rank]
            self.shard.rotate = self.shard.rotate_base % workers


def _digest(batch: Any) -> str:
    """A short fingerprint of a batch's tensors, to compare ranks' first batches once."""
    digest = hashlib.sha1()
    from multigpu.batches import map_tensors
    map_tensors(lambda tensor: digest.update(tensor.detach().cpu().contiguous().numpy().tobytes()), batch)
    return digest.hexdigest()
