"""Streaming training data: a `torch.utils.data.IterableDataset`, split over ranks and DataLoader workers,
ended together by every rank, and resumed at the exact sample (docs/data.md, "Your own data").

Sharding. data/stream_split.py finds what the stream splits by itself
(over workers: it reads get_worker_info(); over ranks: it reads its rank; a
Hugging Face stream; or a `shards_itself` attribute) and the trainer splits the
rest: every (rank, worker) reads the stream and keeps positions
`slot, slot + S, ...` of what it is given, with `S` the ranks x workers (or
only the ranks, or only the workers) the stream does not split over, so every
sample of a pass goes to exactly one (rank, worker). What no probe sees, the
first pass's counts show: one line when they do not add up to `__len__`.

Epochs. An epoch is one pass (`__len__`, when there is one, sizes it in steps;
without one the steps are unknown until the pass ends), or `--steps-per-epoch`
steps (`--max-steps` alone on a stream without `__len__`: one epoch of them),
passes following one another: a pass that runs out mid-epoch is said once.

Uneven ends. Before each step the ranks count, in one all-reduce of two
numbers (streams only), those with a full window of micro-batches and those
with any batch left. Every rank full: a step as any other. Under DDP the ranks
that ran out then join the others' steps (`joins`): each step of the uneven end
is taken by every rank, those with batches training them and those without
adding zero gradients (multigpu/loop/join.py), until no rank holds a batch:
every sample of the pass is trained once. Where ranks cannot join (fsdp: a rank
without a batch cannot take part in the others' sharded forward), all end the
pass at the first step some rank lacks a full window, and the samples the
others still held are counted and reported. A pass that gives some rank no
batch at all (no step, where ranks cannot join) is refused in one line.

Resume. The checkpoint's "stream_state" holds the pass, the steps of the epoch,
the samples each slot has handed to training and which worker gives each rank
its next batch. A DataLoader takes batches from its workers in turn, dropping
one that ran out; a resumed pass starts at the worker whose turn it was, and
that worker plays that role for the dataset too (its get_worker_info() says so:
a stream that splits over workers gives it that worker's samples). A stream the
trainer splits alone skips exactly the trained positions at any world size or
worker count; any other skips each slot's count and needs the same layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from multigpu.data.stream_split import Split, find_split, play_worker
from multigpu.errors import UsageError
from multigpu.parallel.distributed import all_reduce_sum, gather_objects, is_distributed

Window = tuple[
    Iterator[Any], int, list[int], bool
]  # (micro-batches, samples, their sizes, last of the epoch)


@dataclasses.dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on before a step: how many train it (0 ends the pass), and whether every rank has a
    full window (even: a step as any other)."""

    ranks: int
    even: bool

    def __bool__(self) -> bool:
        return self.ranks > 0


class JoinedWindow:
    """The micro-batches of a step at a stream's uneven end on this rank (none, where it ran out): `training` of
    the `world_size` ranks hold batches. The step sums the gradients over every rank itself, those that ran out
    adding zeros (multigpu/loop/join.py)."""

    def __init__(self, batches: list[Any], training: int, world_size: int):
        self._batches = iter(batches)
        self.training = training
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._batches)


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read as a stream (an IterableDataset) rather than by index."""
    return isinstance(dataset, IterableDataset)


def stream_length(dataset: Any) -> int | None:
    """len(dataset) where the stream has one, else None."""
    try:
        return len(dataset)
    except TypeError:
        return None


class StreamShard(IterableDataset):
    """What one rank reads of `dataset`: its (rank, worker) share, as (slot, sample) pairs, minus what a
    resumed run already trained on (`skip`: the saved stream state of this pass)."""

    def __init__(
        self, dataset: Any, rank: int, world_size: int, tagged: bool = True, joins: bool | None = None
    ):
        self.dataset, self.split = find_split(dataset, rank, world_size, joins)
        self.rank, self.world_size, self.tagged = rank, world_size, tagged
        self.rotate = (
            0  # a resumed pass: the worker whose turn it was gives the first batch (the module docstring)
        )
        self.pass_number = 0
        # A resumed pass's layers [{"slots": S, "counts": [...]}, ...].
        self.skip: list[dict[str, Any]] | None = None

    @property
    def pass_number(self) -> int:
        """The pass over the stream (an epoch of a stream): set here, in the rank's process, before the pass's
        loader workers start, so each worker starts with the stream's epoch already set."""
        return self._pass_number

    @pass_number.setter
    def pass_number(self, value: int) -> None:
        self._pass_number = value
        # Not in each worker: a Hugging Face stream keeps its epoch in a tensor shared with the workers and
        # set_epoch adds the difference in place, so two workers setting it at once could leave it at 2 for pass 1,
        # and the epoch picks the shard order: a worker read another rank's shard.
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(value)

    @property
    def split_by_trainer(self) -> bool:
        """Whether the trainer alone splits the stream (then a resume may change the layout)."""
        return not (self.split.ranks or self.split.workers)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        role = (worker + self.rotate) % workers  # the DataLoader takes batches from workers 0, 1, ... in turn
        if role != worker:
            play_worker(role)
        slot, slots = role * self.world_size + self.rank, workers * self.world_size
        if self.split_by_trainer:
            samples = self._split(slot, slots)
        else:  # keep every `every`-th of what the stream gives this (rank, worker): the dimension it does not split
            every, mine = (
                (1, 0)
                if self.split.ranks and self.split.workers
                else (self.world_size, self.rank)
                if self.split.workers
                else (workers, role)
            )
            samples = self._own(slot, every, mine)
        for sample in samples:
            yield (slot, sample) if self.tagged else sample

    def _own(self, slot: int, every: int, mine: int) -> Iterator[Any]:
        skip = self.skip[-1]["counts"][slot] if self.skip else 0  # one layer: the layout cannot change
        kept = 0
        for position, sample in enumerate(self.dataset):
            if position % every == mine:
                kept += 1
                if kept > skip:
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

    def __init__(self, collate_fn: Callable | None):
        self.collate_fn = collate_fn or default_collate

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[int, int, Any]:
        return items[0][0], len(items), self.collate_fn([sample for _, sample in items])


class TrainStream:
    """The training loop's side of a stream: windows of micro-batches that every rank agrees on, and the
    stream's position for checkpoints. Also the few sampler attributes the trainer reads (seed, dataset_size,
    usable, start_at)."""

    def __init__(
        self,
        dataset: Any,
        runtime: Any,
        loader_batch: int,
        grad_accum: int,
        steps_per_epoch: int,
        num_workers: int | None,
        seed: int,
        collate_fn: Callable | None,
        build_loader: Callable,
        max_steps: int = 0,
        cannot_join: str | None = "",
    ):
        """`cannot_join`: why ranks that run out cannot join the others' steps (fsdp, say); None where they can
        ("": one rank, nothing to join)."""
        self.runtime, self.loader_batch, self.grad_accum = runtime, loader_batch, grad_accum
        self.length = length = stream_length(dataset)
        self.seed, self.dataset_size = seed, length if length is not None else -1
        self.joins = cannot_join is None and runtime.world_size > 1
        self.cannot_join = cannot_join or ""
        self.shard = StreamShard(dataset, runtime.rank, runtime.world_size, joins=self.joins)
        _agree_on(self.shard.split)
        self.loader: DataLoader = build_loader(
            self.shard,
            runtime.device,
            num_workers,
            seed + runtime.rank,
            batch_size=loader_batch,
            collate_fn=TaggedCollate(collate_fn),
            persistent_workers=False,
        )  # each pass's workers see its skip
        self.workers = max(1, self.loader.num_workers)
        # --steps-per-epoch N: N steps an epoch; --max-steps alone on a stream without __len__: one epoch of them.
        self.fixed_steps = steps_per_epoch or (max_steps if length is None else 0)  # 0: an epoch is one pass
        self.fixed_by = (
            f"--steps-per-epoch {steps_per_epoch}" if steps_per_epoch else f"--max-steps {max_steps}"
        )
        step_samples = loader_batch * grad_accum
        self.steps_per_epoch: int | None = self.fixed_steps or (  # None: a pass of unknown length
            max(1, math.ceil(length / (step_samples * runtime.world_size))) if length is not None else None
        )
        self.usable = length if length is not None else (self.steps_per_epoch or 0) * step_samples
        self.counts: dict[int, int] = {}  # samples each of this rank's slots handed to training, this pass
        self.next_worker = 0  # the worker whose batch this rank takes next: DataLoader takes them in turn
        self.steps_in_epoch = self.steps_in_pass = 0
        self.uneven_in_pass = 0  # steps of this pass where some rank lacked a full window (the ranks joined)
        self.ranks_checked, self.warned, self.counted, self.said_wrap = False, False, False, False
        # slot -> its first batch's digest (None: no tensor in it), in the first whole pass
        self.first_batches: dict[int, str | None] = {}
        self._batches: Iterator[Any] | None = None  # the pass's loader, kept across --steps-per-epoch epochs

    def plan_line(self) -> str:
        """The plan's line on the stream: who splits it over ranks and workers and how that was found, and what
        happens at its uneven ends."""
        split, world = self.shard.split, self.runtime.world_size
        ranks = f"ranks {'by itself' if split.ranks else 'by the trainer'}, " if world > 1 else ""
        workers = "by itself" if split.workers else "by the trainer"
        if self.joins:
            ends = "ranks that run out join the others' steps, every sample trained once a pass"
        elif world > 1:
            ends = (
                f"the ranks end each pass together at the first that runs out, what the others hold counted as "
                f"unused ({self.cannot_join})"
            )
        else:
            ends = ""
        return f"data: a stream, split over {ranks}workers {workers} ({split.found})" + (
            f"; uneven ends: {ends}" if ends else ""
        )

    # --- what the trainer reads of a sampler ---
    def start_at(self, epoch: int, consumed: int) -> None:
        """Nothing to point: the stream's position is its own state."""

    # --- training ---
    def windows(self, report: Callable[[str], None]) -> Iterator[Window]:
        """This epoch's steps: every rank gets the same number; the last is flagged for the sync point."""
        if self.fixed_steps:
            yield from self._fixed_epoch(report)
        else:
            yield from self._rest_of_pass(report)

    def _fixed_epoch(self, report: Callable[[str], None]) -> Iterator[Window]:
        """--steps-per-epoch (or --max-steps) steps, the stream carrying on across epochs; a pass that runs out
        mid-epoch is followed by the next, from the stream's start, and that is said once."""
        while self.steps_in_epoch < self.fixed_steps:
            window = self._next_window()
            training = self._ranks_training(window, self._at_start())
            while not training:
                ran_out = (self.shard.pass_number + 1, self.steps_in_pass) if self.steps_in_epoch else None
                self._end_of_pass(window, report)
                if ran_out and not self.said_wrap:
                    self.said_wrap = True
                    report(
                        f"the training stream ran out after {ran_out[1]} steps (pass {ran_out[0]}), "
                        f"{self.steps_in_epoch} steps into an epoch of {self.fixed_by}: the epoch goes on with "
                        f"pass {ran_out[0] + 1}, from the stream's start (said once)"
                    )
                window = self._next_window()
                training = self._ranks_training(window, self._at_start())
            self.steps_in_epoch += 1
            yield self._step(window, report, self.steps_in_epoch >= self.fixed_steps, training)
        self.steps_in_epoch = 0

    def _rest_of_pass(self, report: Callable[[str], None]) -> Iterator[Window]:
        """An epoch is the rest of the pass (the next pass, when the epoch starts where one ended)."""
        window = self._next_window()
        training = self._ranks_training(window, self._at_start())
        if not training and not self.steps_in_epoch:
            self._end_of_pass(window, report)
            window = self._next_window()
            training = self._ranks_training(window, self._at_start())
        while training:
            following = self._next_window()
            following_training = self._ranks_training(following, False)
            self.steps_in_epoch += 1
            yield self._step(window, report, not following_training, training)
            window, training = following, following_training
        self._end_of_pass(window, report)
        self.steps_in_epoch = 0

    def _next_window(self) -> list[tuple[int, int, Any]] | None:
        if self._batches is None:
            self._batches = iter(self.loader)
        window = []
        for item in self._batches:
            window.append(item)
            if len(window) == self.grad_accum:
                return window
        self._batches = iter(())  # ran out: a rank that joins the others asks again, and gets nothing
        return window or None  # a short window: trained by a joined step, or counted as unused

    def _at_start(self) -> bool:
        """Whether the next step is the first of a pass this run reads from its start."""
        return not self.steps_in_pass and self.shard.skip is None

    def _ranks_training(self, window: list | None, at_start: bool) -> Agreed:
        """Which ranks train the next step. All of them when every rank has a full window; where ranks join,
        every rank with a batch left (an uneven step), unless some rank has none at the start of a pass (it
        would never train: refused); else none, which ends the pass. One all-reduce of two numbers, a host sync
        per step for streams only: the price of never hanging at an uneven end."""
        full = window is not None and len(window) == self.grad_accum
        world = self.runtime.world_size
        if not is_distributed():  # one process: a short window is a step as any other, as map-style's last
            return Agreed(world if window is not None else 0, True)
        # Through the project's own all-reduce, so the hang watchdog and --debug-collectives see it too.
        flags = torch.tensor([float(full), float(window is not None)], device=self.runtime.device)
        full_ranks, holding = (round(count) for count in all_reduce_sum(flags).tolist())
        if full_ranks == world:
            return Agreed(world, True)
        if not self.joins or (at_start and holding < world):
            return Agreed(0, True)
        return Agreed(holding, False)

    def _step(
        self,
        window: list[tuple[int, int, Any]] | None,
        report: Callable[[str], None],
        last: bool,
        training: Agreed,
    ) -> Window:
        """Count a window as trained (its samples per slot, the worker whose turn is next) and hand it over: as a
        JoinedWindow in an uneven step (this rank's window may then be short, or None)."""
        self.steps_in_pass += 1
        items = window or []
        for slot, samples, batch in items:
            self.counts[slot] = self.counts.get(slot, 0) + samples
            if self.length is None and not self.counted and slot not in self.first_batches:
                self.first_batches[slot] = _digest(
                    batch
                )  # once per slot, in the first pass (None: no tensor)
        if items:
            self.next_worker = (items[-1][0] // self.runtime.world_size + 1) % self.workers
        if not self.ranks_checked and self.shard.split.ranks:
            self.ranks_checked = True
            self._check_ranks(items, report)
        sizes = [samples for _, samples, _ in items]
        batches = [batch for _, _, batch in items]
        if not training.even:
            self.uneven_in_pass += 1
            return JoinedWindow(batches, training.ranks, self.runtime.world_size), sum(sizes), sizes, last
        return iter(batches), sum(sizes), sizes, last

    def _end_of_pass(self, window: list | None, report: Callable[[str], None]) -> None:
        """Count what this rank still held, tell the user, check the first whole pass's counts, and start the
        next pass at its beginning."""
        whole = self.shard.skip is None  # this pass was read from its start by this run
        unused = sum(samples for _, samples, _ in window or ())
        unused += sum(samples for _, samples, _ in (self._batches if self._batches is not None else ()))
        facts = gather_objects((unused, sum(self.counts.values()), self.first_batches if whole else {}))
        held = [rank_unused for rank_unused, _, _ in facts]
        if any(held):
            report(
                f"end of the stream's pass {self.shard.pass_number + 1}: ranks ran out at different steps and "
                f"ended it together; samples left unused: "
                + ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(held))
            )
        if whole and not self.steps_in_pass:
            raise UsageError(self._too_few([rank_unused + trained for rank_unused, trained, _ in facts]))
        if whole and not self.counted:
            self.counted = True
            line = self._count_line(facts)  # type: ignore[arg-type]
            if line and not self.warned:
                report(line)
            longer = self._longer_line([rank_unused + trained for rank_unused, trained, _ in facts])
            if longer:
                report(longer)
        self.shard.pass_number += 1
        self.shard.skip, self.shard.rotate = None, 0
        self.counts, self.next_worker, self.steps_in_pass = {}, 0, 0
        self.uneven_in_pass = 0
        self._batches, self.first_batches = None, {}

    def _longer_line(self, samples: list[int]) -> str | None:
        """Once: a first pass whose uneven end made it longer than the steps `__len__` plans an epoch (the ranks'
        shares differ), which the LR schedule and the progress bar count."""
        planned, steps = self.steps_per_epoch, self.steps_in_pass
        if self.fixed_steps or not planned or not self.uneven_in_pass or steps <= planned:
            return None
        return (
            f"the training stream's first pass took {steps} steps, not the {planned} its __len__ plans: the "
            f"ranks' shares were "
            + ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(samples))
            + f" samples, and the ranks that ran out joined the others' last {self.uneven_in_pass} steps; the LR "
            f"schedule and progress bar count {planned} steps an epoch (--steps-per-epoch {steps} plans by the pass)"
        )

    def _too_few(self, samples: list[int]) -> str:
        if not any(samples):
            return (
                "the training stream gave no sample in a whole pass: it is empty; check its files, or what its "
                "__iter__ yields"
            )
        world = self.runtime.world_size
        counts = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(samples))
        if self.joins:
            return (
                f"the training stream is too small for {world} ranks: a whole pass gave {counts} sample(s), "
                f"and every rank needs at least one batch; use fewer ranks, or more data"
            )
        return (
            f"the training stream is too small for {world} ranks: a whole pass gave {counts} sample(s), "
            f"and every step needs {self.grad_accum} batch(es) on every rank; use fewer ranks"
            f"{' or a smaller --grad-accum-steps' if self.grad_accum > 1 else ''}, or more data"
        )

    def _count_line(self, facts: list[tuple[int, int, dict[int, str]]]) -> str | None:
        """One warning when the first whole pass's samples, over every (rank, worker), do not add up: more
        or fewer than __len__, or (without __len__) two of them starting with the same batch."""
        world = self.runtime.world_size
        took = f"the trainer took it as a stream that {self.shard.split.words()} ({self.shard.split.found})"
        if self.length is not None:
            total = sum(rank_unused + trained for rank_unused, trained, _ in facts)
            if total == self.length:
                return None
            ratio = total / self.length if self.length else math.inf
            how = (
                f"each sample read about {round(ratio)} times, by several (rank, worker)s"
                if ratio >= 1.5
                else f"about 1/{round(1 / ratio)} of them: the stream is split twice, by itself and by the trainer"
                if 0 < ratio <= 2 / 3
                else "its __len__ is off, or samples are read twice or never"
            )
            return (
                f"warning: the first pass of the training stream gave {total} samples over {world} rank(s) x "
                f"{self.workers} worker(s), and its __len__ is {self.length}: {how}; {took}. Read the rank and "
                f'worker in __iter__, or set shards_itself (docs/data.md, "Your own data")'
            )
        firsts: dict[str, int] = {}
        for _, _, digests in facts:
            for slot, digest in digests.items():
                if digest is None:
                    continue
                if digest in firsts:
                    return (
                        f"warning: in the first pass of the training stream {_slot_words(firsts[digest], world)} "
                        f"and {_slot_words(slot, world)} read the same first batch: samples are read more than "
                        f"once; {took}. Read the rank and worker in __iter__, or set shards_itself "
                        f'(docs/data.md, "Your own data")'
                    )
                firsts[digest] = slot
        return None

    def _check_ranks(self, window: list[tuple[int, int, Any]], report: Callable[[str], None]) -> None:
        """Once: a stream that splits over ranks itself whose ranks all read the same first batch reads
        everything everywhere."""
        digests = gather_objects(_digest(window[0][2]) if window else None)
        if len(digests) > 1 and len(set(digests)) == 1 and digests[0] is not None:
            self.warned = True
            report(
                f"warning: every rank read the same first batch: the dataset {self.shard.split.words()} "
                f"({self.shard.split.found}) but does not split by rank; read the RANK and WORLD_SIZE variables "
                f"in its __iter__, or drop shards_itself and let the trainer split it (docs/data.md, "
                f'"Your own data")'
            )

    # --- checkpoints ---
    def state_dict(self) -> dict[str, Any]:
        """The position of the stream (every rank must call it: the ranks' counts are gathered)."""
        slots = self.workers * self.runtime.world_size
        counts, ranks = [0] * slots, gather_objects((self.counts, self.next_worker))
        for rank_counts, _ in ranks:
            for slot, n in rank_counts.items():
                counts[slot] = n
        layers = [dict(layer) for layer in self.shard.skip or []]
        if layers and layers[-1]["slots"] == slots:  # the same layout continues its last layer
            layers[-1]["counts"] = [n + old for n, old in zip(counts, layers[-1]["counts"])]
        else:
            layers.append({"slots": slots, "counts": counts})
        return {
            "pass": self.shard.pass_number,
            "steps_in_epoch": self.steps_in_epoch,
            "steps_in_pass": self.steps_in_pass,
            "layers": layers,
            "next_worker": [turn for _, turn in ranks],
            "world_size": self.runtime.world_size,
            "workers": self.workers,
            "shards_itself": not self.shard.split_by_trainer,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved pass where it stopped; a stream that splits itself needs the same layout."""
        if not state:
            raise UsageError(
                "the checkpoint holds no stream position (saved with map-style data): resume it with "
                "that data, or start this stream with a new --save-dir"
            )
        workers, world = self.workers, self.runtime.world_size
        same_layout = (state["world_size"], state["workers"]) == (world, workers)
        if state["shards_itself"] and not same_layout:
            raise UsageError(
                f"the checkpoint holds the position of a stream that shards itself over {state['world_size']} "
                f"rank(s) x {state['workers']} worker(s), which cannot be re-split for {world} x "
                f"{workers}: resume with that layout, or drop shards_itself so the trainer splits it"
            )
        self.shard.pass_number, self.steps_in_epoch = state["pass"], state["steps_in_epoch"]
        self.steps_in_pass = state.get("steps_in_pass", 0)
        self.shard.skip, self.counts = [dict(layer) for layer in state["layers"]], {}
        if same_layout:  # the same batches in the same order: the worker whose turn it was goes first
            turn = (
                state["next_worker"][self.runtime.rank]
                if "next_worker" in state
                else state["batches_taken"][self.runtime.rank] % workers
            )  # saved before next_worker was
            self.shard.rotate = self.next_worker = turn


def _agree_on(split: Split) -> None:
    """Every rank must take the stream alike (the first-batch check is a collective): UsageError if not."""
    splits = gather_objects((split.ranks, split.workers))
    if len(set(splits)) > 1:
        raise UsageError(
            "the ranks see the training stream split differently ("
            + ", ".join(f"rank {rank}: ranks {r}, workers {w}" for rank, (r, w) in enumerate(splits))
            + '): give it a shards_itself attribute, True or False (docs/data.md, "Your own data")'
        )


def _slot_words(slot: int, world: int) -> str:
    return f"rank {slot % world} worker {slot // world}"


def _digest(batch: Any) -> str | None:
    """A short fingerprint of a batch's tensors, to compare first batches once (None: it holds no tensor)."""
    digest, tensors = hashlib.sha1(), []
    from multigpu.data.batches import map_tensors

    def add(tensor: torch.Tensor) -> None:
        tensors.append(tensor)
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())

    map_tensors(add, batch)
    return digest.hexdigest() if tensors else None
