"""Predictions over a data set: every sample exactly once, in dataset order, for any world size.

The set is cut into the same fixed batches as evaluation, and rank r runs
batches r, r+W, ... with no padding (docs/data.md, "Exact evaluation"),
so each batch holds the same samples as in one process and its outputs are
bit-identical to one process's. The ranks then exchange their outputs (as CPU
tensors) a chunk of batches at a time and put them back in batch order: on
every rank for an in-memory result, or on rank 0 alone, which streams them to
a file, when the set may not fit in memory (docs/prediction.md, "Prediction").
Every rank joins the same number of exchanges, so ranks with a batch more or
less cannot hang.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import struct
from collections.abc import Iterator, Mapping
from typing import IO, Any, Callable

import torch
from torch.utils.data import Dataset

from multigpu import safe_files
from multigpu.data import build_loader
from multigpu.data.batches import concat, to_device
from multigpu.data.sampler import ShardedBatchSampler
from multigpu.loop.amp import Amp
from multigpu.loop.forward import ForwardFn, ModelForward, default_forward, stand_in_forward, without_loss
from multigpu.parallel.distributed import Runtime, gather_objects, gather_objects_to_main

CHUNK_SAMPLES = 8192  # about how many samples one exchange moves: what streaming holds in memory at once
FILE_MAGIC = b"MULTIGPU-PREDICTIONS 1\n"
_LENGTH = struct.Struct("<Q")


class Predictor:
    """Runs a model over a data set and hands back its outputs in dataset order, exact over ranks."""

    def __init__(
        self,
        runtime: Runtime,
        amp: Amp,
        forward: ForwardFn = default_forward,
        num_workers: int | None = None,
        collate_fn: Callable | None = None,
    ):
        self.runtime, self.amp, self.forward = runtime, amp, forward
        self.num_workers, self.collate_fn = num_workers, collate_fn

    def run(
        self,
        model: torch.nn.Module,
        dataset: Dataset | None,
        batch_size: int,
        output_path: str | None = None,
        to: str | torch.device = "cpu",
    ) -> Any:
        """The outputs for every sample of `dataset`, concatenated along the batch dimension on device `to`,
        on every rank; with `output_path`, rank 0 streams them to that file instead and None is returned
        (read it with `load_predictions`). Every rank must call it."""
        if dataset is None:
            raise ValueError("predict() needs a dataset: none given and the trainer has no val_dataset")
        if output_path is not None:
            with written_whole(output_path) if self.runtime.is_main else contextlib.nullcontext() as file:
                if file is not None:
                    file.write(FILE_MAGIC)

                def append(chunk: Any) -> None:
                    assert (
                        file is not None
                    )  # chunks come to rank 0 only (everywhere=False), which has the file
                    _append(file, chunk)

                self.each_chunk(model, dataset, batch_size, append, everywhere=False)
            return None
        chunks: list[Any] = []
        self.each_chunk(model, dataset, batch_size, chunks.append, everywhere=True)
        return to_device(concat(chunks), torch.device(to))

    def each_chunk(
        self,
        model: torch.nn.Module,
        dataset: Dataset,
        batch_size: int,
        receive: Callable[[Any], None],
        everywhere: bool = True,
        with_targets: bool = False,
    ) -> None:
        """Call `receive(outputs)` for consecutive runs of samples from the first to the last, on every rank
        (`everywhere`) or on rank 0 only; `receive((outputs, targets))` `with_targets`. Every rank must call it."""
        rt = self.runtime
        size = len(dataset)  # type: ignore[arg-type]  # a map-style set: it has __len__
        if size == 0:
            raise ValueError("predict() got an empty data set")
        batches = ShardedBatchSampler(size, batch_size, rt.rank, rt.world_size)
        loader = iter(
            build_loader(
                dataset, rt.device, self.num_workers, batch_sampler=batches, collate_fn=self.collate_fn
            )
        )
        rounds = math.ceil(batches.num_batches / rt.world_size)  # a round: one batch on every rank
        per_chunk = max(1, CHUNK_SAMPLES // (batch_size * rt.world_size))
        was_training = model.training
        model.eval()
        try:
            for first in range(0, rounds, per_chunk):
                last = min(first + per_chunk, rounds)
                mine = [
                    self._outputs(model, next(loader), with_targets)
                    for round_ in range(first, last)
                    if round_ * rt.world_size + rt.rank < batches.num_batches
                ]
                if (
                    rt.forward_is_collective and len(mine) < last - first
                ):  # fsdp: join the others' all-gathers
                    with torch.no_grad(), self.amp.autocast():
                        stand_in_forward(
                            lambda model_, batch: forward_for_prediction(self.forward, model_, batch),
                            model,
                            dataset,
                            self.collate_fn,
                            lambda batch: to_device(batch, rt.device),
                        )
                by_rank = _exchange(mine, everywhere)
                if by_rank is not None:
                    numbers = range(first * rt.world_size, min(last * rt.world_size, batches.num_batches))
                    receive(concat([by_rank[n % rt.world_size][n // rt.world_size - first] for n in numbers]))
        finally:
            model.train(was_training)

    @torch.no_grad()
    def _outputs(self, model: torch.nn.Module, batch: Any, with_targets: bool) -> Any:
        """One batch's per-sample outputs (and targets), on the CPU (complete: the host waited for the copy)."""
        batch = to_device(batch, self.runtime.device)
        with self.amp.autocast():
            outputs, targets = forward_for_prediction(self.forward, model, batch)
        result = to_device(
            (_per_sample(outputs), targets) if with_targets else _per_sample(outputs), torch.device("cpu")
        )
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(
                self.runtime.device
            )  # non_blocking copies to the host are complete only now
        return result


def forward_for_prediction(forward: ForwardFn, model: torch.nn.Module, batch: Any) -> tuple[Any, Any]:
    """(outputs, targets) of `batch`: through `forward` (the trainer's forward_fn, or the default pair/dict
    handling), except that inputs alone (a tensor, or the 1-tuple TensorDataset(inputs) gives) go straight
    in, with no targets: a prediction set often has none."""
    if isinstance(forward, ModelForward):  # the trainer's own way through the model, not a user's forward_fn
        if isinstance(batch, torch.Tensor):
            return model(batch), None
        if isinstance(batch, (list, tuple)) and len(batch) == 1:
            return model(batch[0]), None
    return forward(model, batch)


def _per_sample(outputs: Any) -> Any:
    """The outputs that belong to samples, with their whole structure (every head of a dict, the logits next
    to other entries): all of them but the batch's scalar loss, and tensors only: a transformers model's
    cache of attention keys and values (`past_key_values`, an object) or a None entry is no prediction."""
    kept = _tensors_only(without_loss(outputs))
    return None if kept is _NOTHING else kept


_NOTHING = object()  # what _tensors_only leaves of a value that holds no tensor


def _tensors_only(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        kept = {key: _tensors_only(item) for key, item in value.items()}
        kept = {key: item for key, item in kept.items() if item is not _NOTHING}
        return kept if kept else _NOTHING
    if isinstance(value, (list, tuple)):
        items = [item for item in map(_tensors_only, value) if item is not _NOTHING]
        if hasattr(value, "_fields") and len(items) == len(value):  # a named tuple, whole
            return type(value)(*items)
        return (list if isinstance(value, list) else tuple)(items) if items else _NOTHING
    return _NOTHING


def _exchange(mine: list[Any], everywhere: bool) -> list[list[Any]] | None:
    """Every rank's list of outputs, in rank order: on every rank, or on rank 0 (None elsewhere)."""
    return gather_objects(mine) if everywhere else gather_objects_to_main(mine)


# ---------------------------------------------------------------- the streamed file
# A header line and then, per chunk, its length and its torch.save bytes (tensors in plain
# dicts/lists/tuples, so that it loads with weights_only=True).
@contextlib.contextmanager
def written_whole(path: str, mode: str = "wb", **open_args: Any) -> Iterator[IO]:
    """A file written under a temporary name and renamed to `path` only once complete, so a run that
    fails never leaves a file that looks finished (nor touches an older one). Neither `path` nor
    `<path>.partial` is written through a symbolic link planted there (safe_files): refused in one line."""
    partial = f"{path}.partial"
    safe_files.refuse_link(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    file = safe_files.open_no_follow(partial, mode, **open_args)
    try:
        with file:
            yield file
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    os.replace(partial, path)


def _append(file: IO, outputs: Any) -> None:
    buffer = io.BytesIO()
    torch.save(_plain(outputs), buffer)
    file.write(_LENGTH.pack(buffer.tell()))
    file.write(buffer.getbuffer())


def iter_predictions(path: str) -> Iterator[Any]:
    """The chunks of a file written by `predict(output_path=...)`, in order, one at a time."""
    with open(path, "rb") as file:
        if file.read(len(FILE_MAGIC)) != FILE_MAGIC:
            raise ValueError(f"{path} is not a predictions file written by predict(output_path=...)")
        while True:
            head = file.read(_LENGTH.size)
            if not head:
                return
            if len(head) < _LENGTH.size:
                raise ValueError(f"{path} is truncated")
            (length,) = _LENGTH.unpack(head)
            data = file.read(length)
            if len(data) < length:
                raise ValueError(f"{path} is truncated")
            yield torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load_predictions(path: str) -> Any:
    """The whole content of a predictions file, as `predict()` would have returned it (on the CPU)."""
    return concat(list(iter_predictions(path)))


def _plain(outputs: Any) -> Any:
    """`outputs` with mappings as dicts and named tuples as tuples: what weights_only loading accepts."""
    if isinstance(outputs, Mapping):
        return {key: _plain(value) for key, value in outputs.items()}
    if isinstance(outputs, list):
        return [_plain(value) for value in outputs]
    if isinstance(outputs, tuple):
        return tuple(_plain(value) for value in outputs)
    return outputs
