"""--packing: a causal language model's tokenized texts in --block-size windows, the same windows on every machine.

- documents: whole texts packed together, best-fit decreasing (the longest text first, each into the window it
  fills best, a new window when none has room), each text attending to itself alone. A window is
  {"input_ids", "labels", "position_ids"}: the position_ids restart at 0 at each text and at the padding after the
  last one, which is a text of its own that counts nowhere (labels -100, input_ids the padding token); the label
  of each text's first token is -100, so the last token of one text predicts nothing of the next. DocumentMask
  (which models/hf.py installs on the model) turns the restarts into the block-diagonal causal mask on the
  device: a text's logits in a window are its logits alone (docs/language-models.md, "Packing"). A text longer
  than the window is cut into pieces of --block-size tokens, each piece after the first starting with the last
  token of the one before (its label -100): every token but the text's first is a target exactly once.
- stream: the texts' tokens joined in file order, as run_clm groups them, and cut into windows of --block-size
  tokens, {"input_ids", "labels", "attention_mask"}: a token attends to the text before it in its window.
  Training drops the tokens past the last whole window; validation pads the last window (labels -100 there).

Either way the windows are planned after datasets.map has tokenized every row, over the whole table and in one
process, from the tokens' own lengths: so the number of map processes (num_proc, which follows the CPU count),
the map's batches and whether datasets' cache was there already change nothing (docs/language-models.md, "The
same windows on every machine"). The tokens are read from the table's Arrow columns without a copy (memory-
mapped from datasets' cache); a window is assembled from them when the loader asks for it.

A stream (--streaming) cannot be planned before it is read: each map batch of its rows (1000) is packed as it
comes, the same way (PackRows).
"""

from __future__ import annotations

import inspect
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

IGNORE_INDEX = -100  # a label that counts nowhere: PyTorch's cross-entropy default, Hugging Face's
KINDS = ("documents", "stream")
# The attention implementations that keep packed documents apart: sdpa and eager through DocumentMask's mask,
# flash attention through the restarting position_ids themselves (transformers derives cu_seqlens from them).
DOCUMENT_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


# ------------------------------------------------------------------ which packing
def packing_of(config: TrainConfig, model_settings: Any) -> str:
    """--packing for this model (a transformers config): as given, or under auto documents where the model's
    attention takes them (`takes_documents`), else stream; UsageError for documents asked of a model that cannot."""
    why_not = documents_refused(model_settings)
    if config.packing == "auto":
        return "stream" if why_not else "documents"
    if config.packing == "documents" and why_not:
        raise UsageError(f"--packing documents: {why_not}; use --packing stream")
    return config.packing


def documents_refused(model_settings: Any) -> str | None:
    """Why a causal LM of this transformers config cannot keep packed documents apart (None: it can): its forward
    must take position_ids (which restart at each document) and its attention one of DOCUMENT_ATTENTION."""
    from .hf import import_transformers

    transformers = import_transformers("--model hf")
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(model_settings), None)
    if model_class is None:
        return f"transformers has no causal language model for a {model_settings.model_type} model"
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        return f"{model_class.__name__}'s forward takes no position_ids to restart at each document"
    chosen = getattr(model_settings, "_attn_implementation", None)
    if chosen is not None and chosen not in DOCUMENT_ATTENTION:
        return f"its attention ({chosen}) is none of {', '.join(DOCUMENT_ATTENTION)}"
    return None


# ------------------------------------------------------------------ the plan: which tokens make each window
def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each holding at most `capacity` in all: the items by decreasing length (ties in index
    order), each into the bin it leaves with the least room, a new bin when none has room. Deterministic.

    `tree` is a max-tree over the amounts of room: leaf r (at `leaves + r`) holds r while some bin has r left, so
    the leftmost leaf holding at least a length is the least room that fits it; `room[r]` the bins, first opened
    first."""
    leaves = 1 << max(1, capacity).bit_length()
    tree = [0] * (2 * leaves)
    room: dict[int, deque[int]] = defaultdict(deque)
    bins: list[list[int]] = []
    for item in np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist():
        length = int(lengths[item])
        if length == 0:
            continue
        left = _least_room(tree, leaves, length)
        if left:
            chosen = room[left].popleft()
            if not room[left]:
                _set_room(tree, leaves, left, 0)
        else:
            chosen, left = len(bins), capacity
            bins.append([])
        bins[chosen].append(item)
        left -= length
        if left:
            if not room[left]:
                _set_room(tree, leaves, left, left)
            room[left].append(chosen)
    return bins


def _least_room(tree: list[int], leaves: int, length: int) -> int:
    """The least room of a bin that holds `length`, or 0 where none does."""
    if tree[1] < length:
        return 0
    node = 1
    while node < leaves:
        node = 2 * node if tree[2 * node] >= length else 2 * node + 1
    return tree[node]


def _set_room(tree: list[int], leaves: int, amount: int, value: int) -> None:
    node = leaves + amount
    tree[node] = value
    while node > 1:
        node //= 2
        tree[node] = max(tree[2 * node], tree[2 * node + 1])


def document_pieces(starts: np.ndarray, lengths: np.ndarray, block: int) -> np.ndarray:
    """(start, stop) flat token offsets of every text's pieces, in text order: a text of at most `block` tokens
    whole, a longer one cut into pieces of `block` tokens, each after the first starting at the last token of the
    one before (the last piece shorter)."""
    pieces = []
    for start, length in zip(starts.tolist(), lengths.tolist()):
        stop = start + length
        pieces.append((start, min(stop, start + block)))
        while pieces[-1][1] < stop:
            begin = pieces[-1][1] - 1
            pieces.append((begin, min(stop, begin + block)))
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 2)


class Plan:
    """Which tokens make each window: window w is the pieces `pieces[bounds[w]:bounds[w + 1]]`, each a (start,
    stop) range of the flat token columns, in order; `documents`: each piece attends to itself alone."""

    def __init__(self, pieces: np.ndarray, bounds: np.ndarray, documents: bool):
        self.pieces, self.bounds, self.documents = pieces, bounds, documents

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def window(self, index: int) -> np.ndarray:
        return self.pieces[self.bounds[index] : self.bounds[index + 1]]

    @classmethod
    def of_documents(cls, starts: np.ndarray, lengths: np.ndarray, block: int) -> Plan:
        """--packing documents: the texts (and the pieces of the long ones) in best-fit-decreasing windows."""
        pieces = document_pieces(starts, lengths, block)
        bins = best_fit_decreasing((pieces[:, 1] - pieces[:, 0]).tolist(), block)
        order = np.asarray([piece for window in bins for piece in window], dtype=np.int64)
        bounds = np.cumsum([0, *(len(window) for window in bins)], dtype=np.int64)
        return cls(pieces[order] if len(order) else pieces[:0], bounds, documents=True)

    @classmethod
    def of_stream(cls, total: int, block: int, keep_remainder: bool) -> Plan:
        """--packing stream: the joined tokens cut every `block`; the remainder a last, shorter window where kept."""
        whole = total // block
        pieces = [(start, start + block) for start in range(0, whole * block, block)]
        if keep_remainder and total % block:
            pieces.append((whole * block, total))
        return cls(np.asarray(pieces, dtype=np.int64).reshape(-1, 2), np.arange(len(pieces) + 1), False)


# ------------------------------------------------------------------ the tokens, and a window made of them
class TokenColumns:
    """A tokenized table's input_ids (and labels, where it has them) as flat arrays, each row one text: `starts`
    and `lengths` of the rows in them. From a datasets table, without a copy (`of_table`), or from a map batch's
    lists (`of_lists`)."""

    def __init__(self, ids: list[np.ndarray], labels: list[np.ndarray] | None, lengths: np.ndarray):
        self.ids, self.labels, self.lengths = ids, labels, lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)[: len(lengths)]
        # Where each chunk's tokens begin in the flat numbering: a range is looked up in its chunk.
        self.chunk_starts = np.cumsum([0, *(len(chunk) for chunk in ids)], dtype=np.int64)

    @property
    def total(self) -> int:
        return int(self.chunk_starts[-1])

    @classmethod
    def of_table(cls, table: Any) -> TokenColumns:
        """The columns of a datasets.Dataset (after map: no index mapping), memory-mapped where it is."""
        assert table._indices is None  # a map's output: its rows in table order
        arrow = table.data
        ids, lengths = _flat_chunks(arrow.column("input_ids"))
        labels = _flat_chunks(arrow.column("labels"))[0] if "labels" in arrow.column_names else None
        return cls(ids, labels, lengths)

    @classmethod
    def of_lists(cls, ids: list[list[int]], labels: list[list[int]] | None) -> TokenColumns:
        lengths = np.asarray([len(row) for row in ids], dtype=np.int64)
        flat = [np.asarray([token for row in ids for token in row], dtype=np.int64)]
        flat_labels = (
            None if labels is None else [np.asarray([t for row in labels for t in row], dtype=np.int64)]
        )
        return cls(flat, flat_labels, lengths)

    def take(self, labels: bool, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the flat input_ids, or of the labels (the input_ids where there are none)."""
        chunks = self.labels if labels and self.labels is not None else self.ids
        first = int(np.searchsorted(self.chunk_starts, start, side="right")) - 1
        offset = start - int(self.chunk_starts[first])
        if stop <= self.chunk_starts[first + 1]:
            return chunks[first][offset : offset + stop - start]
        return np.concatenate(
            [chunks[first][offset:], self.take(labels, int(self.chunk_starts[first + 1]), stop)]
        )


def _flat_chunks(column: Any) -> tuple[list[np.ndarray], np.ndarray]:
    """A ChunkedArray of lists as its chunks' flat values (numpy views of Arrow's buffers) and the rows' lengths."""
    values, lengths = [], []
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        lengths.append(np.diff(offsets))
        values.append(chunk.flatten().to_numpy(zero_copy_only=False))
    return values, (np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, dtype=np.int64))


def assemble(tokens: TokenColumns, pieces: np.ndarray, block: int, documents: bool, pad_id: int) -> dict:
    """One window of `pieces` as numpy arrays of `block` tokens: input_ids, labels and, for documents, position_ids
    restarting at each piece and at the padding (the first label of each piece -100); for the stream, the
    attention_mask (0 on the padding of a last, shorter window)."""
    ids = np.full(block, pad_id, dtype=np.int64)
    labels = np.full(block, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(block, dtype=np.int64)
    at = 0
    for start, stop in pieces.tolist():
        length = stop - start
        ids[at : at + length] = tokens.take(False, start, stop)
        labels[at : at + length] = tokens.take(True, start, stop)
        positions[at : at + length] = np.arange(length)
        if documents:
            labels[at] = IGNORE_INDEX  # predicted by nothing of this window's text: the one before is another
        at += length
    positions[at:] = np.arange(block - at)  # the padding: a text of its own
    if documents:
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
    return {"input_ids": ids, "labels": labels, "attention_mask": (np.arange(block) < at).astype(np.int64)}


class PackedWindows(Dataset):
    """A tokenized table's windows (`Plan`), each assembled when asked for: {"input_ids", "labels",
    "position_ids"} (documents) or {"input_ids", "labels", "attention_mask"} (stream), tensors of --block-size.
    Pickled (into loader workers that do not fork) as the table and the plan: the worker maps the columns again."""

    def __init__(self, table: Any, plan: Plan, block: int, pad_id: int, columns: TokenColumns | None = None):
        self.table, self.plan, self.block, self.pad_id = table, plan, block, pad_id
        self._columns = columns

    @classmethod
    def of(cls, table: Any, kind: str, block: int, pad_id: int, keep_remainder: bool) -> PackedWindows:
        """The windows of `table` for --packing `kind`; `keep_remainder`: pad the stream's last window (validation)."""
        columns = TokenColumns.of_table(table)
        if kind == "documents":
            plan = Plan.of_documents(columns.starts, columns.lengths, block)
        else:
            plan = Plan.of_stream(columns.total, block, keep_remainder)
        return cls(table, plan, block, pad_id, columns)

    @property
    def columns(self) -> TokenColumns:
        if self._columns is None:
            self._columns = TokenColumns.of_table(self.table)
        return self._columns

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = assemble(
            self.columns, self.plan.window(int(index)), self.block, self.plan.documents, self.pad_id
        )
        return {name: torch.from_numpy(values) for name, values in window.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_columns": None}

    def filled(self) -> float:
        """The share of the windows' positions that hold tokens (not padding)."""
        pieces = self.plan.pieces
        return float((pieces[:, 1] - pieces[:, 0]).sum()) / max(1, len(self) * self.block)


class PackRows:
    """datasets.map's function that packs each batch of a stream's tokenized rows as it is read: windows of
    `block` tokens as PackedWindows makes them, planned over the batch alone."""

    def __init__(self, kind: str, block: int, pad_id: int, keep_remainder: bool):
        self.kind, self.block, self.pad_id, self.keep_remainder = kind, block, pad_id, keep_remainder

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        tokens = TokenColumns.of_lists(batch["input_ids"], batch.get("labels"))
        if self.kind == "documents":
            plan = Plan.of_documents(tokens.starts, tokens.lengths, self.block)
        else:
            plan = Plan.of_stream(tokens.total, self.block, self.keep_remainder)
        windows = [
            assemble(tokens, plan.window(w), self.block, plan.documents, self.pad_id)
            for w in range(len(plan))
        ]
        names = ("input_ids", "labels", "position_ids" if plan.documents else "attention_mask")
        return {name: [window[name].tolist() for window in windows] for name in names}


def window_sample(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A packed stream's row (PackRows) as the trainer's sample: its lists as tensors."""
    return {name: torch.tensor(values, dtype=torch.long) for name, values in example.items()}


# ------------------------------------------------------------------ the model's side: each document to itself
class DocumentMask:
    """A forward pre-hook of a transformers causal LM (models/hf.py installs it under --packing documents): where
    the call gives position_ids and no attention_mask, the restarts of the position_ids at 0 mark where each
    document begins, and the hook adds the attention mask that keeps every token to the earlier tokens of its own
    document, made on the model's device from the (B, T) position_ids (no (B, 1, T, T) mask copied from the host,
    no host sync), in the form the model's attention takes: True/False for sdpa, 0 or the lowest float added to
    the scores for eager. Flash attention takes the restarting position_ids themselves: nothing is added there."""

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        positions = kwargs.get("position_ids")
        if positions is None or kwargs.get("attention_mask") is not None or positions.dim() != 2:
            return None
        implementation = getattr(module.config, "_attn_implementation", None) or "sdpa"
        if implementation.startswith("flash"):
            return None
        return args, {**kwargs, "attention_mask": document_mask(positions, implementation == "eager")}


def document_mask(positions: torch.Tensor, additive: bool) -> torch.Tensor:
    """The (B, 1, T, T) mask of documents that begin where `positions` (B, T) are 0: causal within each document,
    nothing across; boolean (True: attend), or `additive` (0 where attended, float32's lowest elsewhere)."""
    document = (positions == 0).cumsum(-1)
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    allowed = allowed[:, None]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, device=positions.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min
    )


def keep_documents_apart(model: torch.nn.Module) -> None:
    """Install DocumentMask on a transformers causal LM; UsageError (one line) where its attention implementation
    cannot keep documents apart."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in DOCUMENT_ATTENTION:
        raise UsageError(
            f"--packing documents: the model's attention ({implementation}) is none of "
            f"{', '.join(DOCUMENT_ATTENTION)}, which keep packed documents apart; use --packing stream"
        )
    model.register_forward_pre_hook(DocumentMask(), with_kwargs=True)
