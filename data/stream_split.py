"""What a stream already splits over ranks and DataLoader workers, so that the trainer splits only the rest
(docs/data.md, "Your own data").

Every (rank, worker) iterates the same IterableDataset. Some split themselves: the pattern of PyTorch's
IterableDataset documentation reads `torch.utils.data.get_worker_info()` in `__iter__` and gives each worker
its own range; others read their rank (the RANK and WORLD_SIZE variables, `torch.distributed.get_rank()`); a
Hugging Face `datasets.IterableDataset` gives each worker its own files, and each rank its part after
`split_dataset_by_node`. Splitting such a stream again loses samples (half of them at 2 workers); leaving a
plain one unsplit reads every sample everywhere. How it is found, in this order:

- a `shards_itself` attribute: True, the stream splits over ranks and workers; False, over neither. Nothing
  is probed (a stream that cannot be read twice says so this way). Such a stream that also has a `ranks_join`
  attribute is told whether the ranks that run out join the others' steps (else it may split by example).
- a Hugging Face IterableDataset: read, not guessed. It splits over workers (its shards, `num_shards` of
  them; workers beyond them get none); over ranks when its distributed config says so, and that config must
  be this run's ranks. Without one the trainer applies `split_dataset_by_node` itself.
- any other stream is read, over ranks: at more than one rank each rank reads its first few samples
  (FINGERPRINT_SAMPLES, in this process, as the only loader worker, the random generators seeded alike) and
  the ranks compare a hash of them, one small gather: the same samples everywhere, the trainer splits the
  stream over ranks; different ones, the stream splits by rank itself, however it learnt its rank (in
  `__iter__`, in `__init__`, at import), and the trainer leaves that split alone.
- and probed, over workers (over ranks too at one rank, for the checkpoint's layout): its first sample is read
  in this process while `get_worker_info()` answers "worker 0 of 2", RANK and WORLD_SIZE answer "rank 0 of 2",
  and so do torch.distributed's get_rank and get_world_size, each read by the probing thread recorded. The
  answers are put where the dataset reads them, whatever name it imported them by: torch's WorkerInfo in the
  module global get_worker_info returns, and `os.environ`'s own class swapped for one that watches those two
  keys. A stream that read its worker's id or count is read again as worker 1 of 2, one that read its rank as
  rank 1 of 2, with the random generators seeded alike (and restored after): only a different first sample
  counts as splitting, so a stream that reads the rank to print on rank 0 alone, or the worker to seed itself,
  is not taken for one that splits. A stream that cannot be read in this process is split by the trainer.

A stream whose ranks read everything in an order of their own (shuffled by a generator seeded by the rank)
looks split by rank: it says `shards_itself = False`. What no reading sees, the counts of the first pass show
(data/streaming.py says so in one line when they do not add up to `__len__`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data._utils import worker as worker_module

from multigpu import rng
from multigpu.errors import UsageError
from multigpu.parallel.distributed import gather_objects, is_distributed

RANK_VARIABLES = ("RANK", "WORLD_SIZE")  # what torchrun sets and DataLoader workers inherit
PROBE_WORLD = 2  # the probe's ranks and workers: the fewest that show a split
FINGERPRINT_SAMPLES = 4  # the first samples each rank reads and hashes, to compare with the other ranks


@dataclasses.dataclass(frozen=True)
class Split:
    """What a stream splits by itself (the trainer splits the rest), and how that was found, in words."""

    ranks: bool
    workers: bool
    found: str

    def words(self) -> str:
        """What the stream splits, for messages."""
        over = [name for name, splits in (("ranks", self.ranks), ("workers", self.workers)) if splits]
        return f"splits over {' and '.join(over)} by itself" if over else "does not split itself"


def find_split(dataset: Any, rank: int, world_size: int, joins: bool | None = None) -> tuple[Any, Split]:
    """(the stream to read, what it splits by itself) for `rank` of `world_size`; a Hugging Face stream not yet
    split by node comes back split (`split_dataset_by_node`, whole files per rank where they divide) unless the
    ranks that run out cannot join the others' steps (`joins` False): then it is split by example. `joins` None:
    not for training, where uneven ends do not matter. Every rank calls it at once (the ranks compare their first
    samples). UsageError for a Hugging Face stream split for other ranks than this run's."""
    declared = getattr(dataset, "shards_itself", None)
    if declared is not None:
        if joins is not None and hasattr(dataset, "ranks_join"):  # it may split by example (data/hf.py)
            dataset.ranks_join = joins
        return dataset, Split(bool(declared), bool(declared), "its shards_itself attribute")
    if is_hugging_face(dataset):
        return _hugging_face(dataset, rank, world_size, joins is not False)
    return dataset, _probed(dataset, world_size)


def is_hugging_face(dataset: Any) -> bool:
    """Whether `dataset` is a Hugging Face `datasets.IterableDataset` (load_dataset(..., streaming=True))."""
    return type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "_ex_iterable")


def _hugging_face(dataset: Any, rank: int, world_size: int, joins: bool) -> tuple[Any, Split]:
    # datasets' IterableDataset._iter_pytorch gives each DataLoader worker its shards
    # (split_shard_indices_by_worker), and _prepare_ex_iterable_for_iteration each node its part when
    # `_distributed` is set: the node's shards, or every world_size-th example.
    node = dataset._distributed
    if node is None:
        if world_size > 1 and not joins:  # whole files of unequal length would leave a rank's tail untrained
            return dataset, Split(
                False,
                True,
                f"a Hugging Face stream of {_shards(dataset)} shard(s), split over ranks by example (ranks "
                f"cannot join here: whole files per rank would leave the longer files' tails untrained)",
            )
        if world_size == 1:
            return dataset, Split(True, True, f"a Hugging Face stream of {_shards(dataset)} shard(s)")
        from datasets.distributed import split_dataset_by_node

        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        return dataset, Split(
            True,
            True,
            f"a Hugging Face stream of {_shards(dataset)} shard(s), split over "
            f"ranks here with split_dataset_by_node",
        )
    if (node.rank, node.world_size) != (rank, world_size):
        raise UsageError(
            f"the Hugging Face stream was split with split_dataset_by_node(rank={node.rank}, "
            f"world_size={node.world_size}), but this process is rank {rank} of {world_size}: split "
            f"it with the RANK and WORLD_SIZE torchrun sets, or pass it unsplit (the trainer splits it)"
        )
    by_files = world_size > 1 and not joins and _by_files(dataset, node)
    return dataset, Split(
        True,
        True,
        f"a Hugging Face stream split by split_dataset_by_node, {_shards(dataset)} shard(s) on this rank"
        + (
            " (whole files per rank, and ranks cannot join here: unequal files leave the longer ranks' tails "
            "unused; pass it unsplit to have it split by example)"
            if by_files
            else ""
        ),
    )


def _by_files(dataset: Any, node: Any) -> bool:
    """Whether split_dataset_by_node gives each node whole files (else every world_size-th example)."""
    strategy = getattr(node, "strategy", "auto")  # older datasets have no strategy: they split as auto does
    files = dataset._ex_iterable.num_shards
    return strategy == "shards" or (strategy == "auto" and files % node.world_size == 0)


def _shards(dataset: Any) -> Any:
    return getattr(dataset, "num_shards", None) or getattr(
        dataset, "n_shards", "?"
    )  # n_shards: older datasets


# ---------------------------------------------------------------- the probe
_known: dict[int, tuple[Any, Split]] = {}  # id(dataset) -> (a weak reference to it, its split): probed once


def _probed(dataset: Any, world_size: int) -> Split:
    try:
        ref, split = _known[id(dataset)]
        if ref() is dataset:
            return split
    except KeyError:
        pass
    split = _probe(dataset, ranks=world_size == 1 or not is_distributed())
    if world_size > 1 and is_distributed():
        split = _compared(dataset, split)
    with contextlib.suppress(TypeError):  # a stream that takes no weak reference is probed at each use
        _known[id(dataset)] = (weakref.ref(dataset), split)
    return split


def _probe(dataset: Any, ranks: bool = True) -> Split:
    """Whether the stream's first sample changes with its worker (and with its rank, where `ranks`)."""
    try:
        first, watch = _first_sample(dataset, rank=0, worker=0)
        workers = watch.read_worker and not _same(first, _first_sample(dataset, rank=0, worker=1)[0])
        by_rank = ranks and watch.read_rank and not _same(first, _first_sample(dataset, rank=1, worker=0)[0])
    except (
        Exception
    ):  # it reads only inside loader workers, say: the trainer splits it, the first pass's counts check
        return Split(False, False, "not readable in the main process")
    return Split(
        by_rank, workers, f"its first sample read as {'rank 0 and 1, ' if ranks else ''}worker 0 and 1"
    )


# ---------------------------------------------------------------- what the ranks read
def _compared(dataset: Any, probed: Split) -> Split:
    """Whether the stream splits over ranks, from what the ranks really read: each hashes its first samples
    (one small gather); different hashes, it splits by rank itself, however it learnt its rank."""
    prints = gather_objects(fingerprint(dataset))
    if any(each is None for each in prints):  # some rank cannot read it here: the trainer splits it
        return dataclasses.replace(probed, ranks=False)
    if len(set(prints)) == 1:
        return Split(
            False, probed.workers, f"every rank read the same first samples; {probed.found} for the workers"
        )
    return Split(
        True, probed.workers, f"the ranks read different first samples; {probed.found} for the workers"
    )


def fingerprint(dataset: Any, count: int = FINGERPRINT_SAMPLES) -> str | None:
    """A hash of the stream's first `count` samples (fewer if it has fewer) as this process reads them as the
    only loader worker, the random generators seeded alike and restored after; None when it cannot be read
    here."""
    cpu = torch.device("cpu")
    saved, saved_info = rng.rng_state(cpu), worker_module._worker_info
    digest = hashlib.sha1()
    try:
        rng.seed_all(0)
        worker_module._worker_info = worker_module.WorkerInfo(id=0, num_workers=1, seed=0, dataset=dataset)
        samples = iter(dataset)
        try:
            for _, sample in zip(range(count), samples):
                _hash_into(digest, sample)
        finally:
            close = getattr(samples, "close", None)  # a generator: its files are closed now
            if close is not None:
                close()
    except Exception:  # it reads only inside loader workers, say
        return None
    finally:
        worker_module._worker_info = saved_info
        rng.set_rng_state(saved, cpu)
    return digest.hexdigest()


def _hash_into(digest: Any, value: Any) -> None:
    """Feed a sample to `digest`: tensors and arrays by type, shape and bytes, containers item by item, numbers
    and text by their repr, anything else pickled (or by its type's name)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {value.dtype} {tuple(value.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        digest.update(b"dict")
        for key in sorted(value, key=str):
            _hash_into(digest, key)
            _hash_into(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)}".encode())
        for item in value:
            _hash_into(digest, item)
    elif value is None or isinstance(value, (str, bytes, int, float, complex)):
        digest.update(repr(value).encode())
    else:
        try:
            digest.update(pickle.dumps(value))
        except Exception:  # not picklable: only its type
            digest.update(type(value).__qualname__.encode())


class _Watch:
    """What the probing thread is told (rank and worker, of PROBE_WORLD each) and what it asked for."""

    def __init__(self, rank: int, worker: int):
        self.thread, self.rank, self.worker = threading.get_ident(), rank, worker
        self.read_rank = self.read_worker = False

    def here(self) -> bool:
        return threading.get_ident() == self.thread


_WATCH: _Watch | None = None
_NOTHING = object()  # the first sample of a stream that gave none


class _WatchedWorkerInfo(worker_module.WorkerInfo):
    """torch's WorkerInfo, noting that the probing thread read the worker's id or count."""

    def __getattribute__(self, name: str) -> Any:
        watch = _WATCH
        if name in ("id", "num_workers") and watch is not None and watch.here():
            watch.read_worker = True
        return super().__getattribute__(name)


class _WatchedEnviron(type(os.environ)):  # type: ignore[misc]
    """os.environ's class, answering the probing thread's reads of RANK and WORLD_SIZE with the probe's."""

    def __getitem__(self, key: str) -> str:
        watch = _WATCH
        if key in RANK_VARIABLES and watch is not None and watch.here():
            watch.read_rank = True
            return str(watch.rank if key == "RANK" else PROBE_WORLD)
        return super().__getitem__(key)


def _watched_call(original: Any, answer: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        watch = _WATCH
        if watch is not None and watch.here():
            watch.read_rank = True
            return watch.rank if answer == "rank" else PROBE_WORLD
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def _seen_as(dataset: Any, rank: int, worker: int) -> Iterator[_Watch]:
    """For the block: this thread is `worker` of PROBE_WORLD loader workers on `rank` of PROBE_WORLD ranks, as
    far as the dataset can ask; everything is put back after."""
    global _WATCH
    watch, saved_info, environ_class = _Watch(rank, worker), worker_module._worker_info, type(os.environ)
    calls = {
        (module, name): getattr(module, name)
        for module in (dist, dist.distributed_c10d)
        for name in ("get_rank", "get_world_size")
    }
    _WATCH = watch
    worker_module._worker_info = _WatchedWorkerInfo(
        id=worker, num_workers=PROBE_WORLD, seed=0, dataset=dataset
    )
    os.environ.__class__ = _WatchedEnviron
    for (module, name), original in calls.items():
        setattr(module, name, _watched_call(original, "rank" if name == "get_rank" else "world"))
    try:
        yield watch
    finally:
        for (module, name), original in calls.items():
            setattr(module, name, original)
        os.environ.__class__ = environ_class
        worker_module._worker_info, _WATCH = saved_info, None


def _first_sample(dataset: Any, rank: int, worker: int) -> tuple[Any, _Watch]:
    """The stream's first sample as `rank` and `worker` see it, with the random generators seeded alike."""
    cpu = torch.device("cpu")
    saved = rng.rng_state(cpu)
    try:
        rng.seed_all(0)
        with _seen_as(dataset, rank, worker) as watch:
            samples = iter(dataset)
            try:
                first = next(samples, _NOTHING)
            finally:
                close = getattr(samples, "close", None)  # a generator: its files are closed now
                if close is not None:
                    close()
    finally:
        rng.set_rng_state(saved, cpu)
    return first, watch


def _same(a: Any, b: Any) -> bool:
    """Whether two samples are equal: tensors and arrays by value, containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object without a usable ==: not known to be the same
        return False


def play_worker(role: int) -> None:
    """In a DataLoader worker: from now on `get_worker_info()` says this worker is `role` (the worker whose turn
    it is when a resumed pass starts), so a stream that splits over workers gives it that worker's samples."""
    info = worker_module._worker_info
    if info is not None and info.id != role:
        worker_module._worker_info = dataclasses.replace(info, id=role)
