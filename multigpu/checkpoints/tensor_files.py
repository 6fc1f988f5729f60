"""safetensors files: tensors without pickle, written atomically; a checkpoint's nested state in one of them.

safetensors holds a flat {name: tensor} map and a header of strings, nothing that
runs code when read. Two rules of the format shape this module: a tensor is
stored once, so tied weights (two names, one storage) keep one name and record
the other in the header (`TIED_KEY`); and a checkpoint's nested state (progress,
schedule, RNG, the optimizer's per-parameter slots) is split into its tensors,
stored by path, and the rest as JSON in the header (`STATE_KEY`), so the whole
checkpoint is one file, replaced by one rename (docs/checkpoints.md, "Checkpoints
without pickle").
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch

from multigpu import safe_files
from multigpu.checkpoints import run_settings
from multigpu.errors import UsageError

SUFFIX = ".safetensors"
TIED_KEY = "multigpu.tied_weights"  # header entry: JSON {alias: the name its tensor is stored under}
STATE_KEY = (
    run_settings.TRAINER_STATE_KEY
)  # header entry of a checkpoint: its state as JSON, tensors as references
_TENSOR, _TUPLE, _PAIRS = "__tensor__", "__tuple__", "__pairs__"  # JSON markers of what JSON has no type for
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header


def library(what: str) -> Any:
    """safetensors.torch, or UsageError naming the extra that brings it (`what` needs it)."""
    try:
        import safetensors.torch
    except ImportError:
        raise UsageError(
            f"{what} needs the safetensors library, which is not installed: pip install '.[hf]'"
        ) from None
    return safetensors.torch


def is_safetensors(path: str) -> bool:
    """Whether the file at `path` begins as a safetensors file does: an 8-byte header length, then a JSON object."""
    try:
        with open(path, "rb") as file:
            head = file.read(9)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9:
        return False
    length = struct.unpack("<Q", head[:8])[0]
    return head[8:9] == b"{" and 0 < length <= min(MAX_HEADER, size - 8)


def header(path: str) -> dict[str, str]:
    """The string metadata in the header of the safetensors file `path` (empty when it has none)."""
    with library("reading safetensors").safe_open(path, framework="pt") as file:
        return dict(file.metadata() or {})


def stored_once(
    tensors: dict[str, torch.Tensor], tied: dict[str, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`tensors` as safetensors can hold them: each storage once. A name whose tensor is another's (the same
    storage, shape and strides: tied weights), or that `tied` names an alias, becomes an alias of the first
    name; one that only overlaps another's storage (a view) is copied; each is made contiguous."""
    tied = {alias: source for alias, source in (tied or {}).items() if alias in tensors and source in tensors}
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        if name in tied:
            aliases[name] = tied[name]
            continue
        identity = (
            (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
            )
            if tensor.device.type != "meta"
            else None
        )
        if identity is not None and identity in seen and tensor.numel():
            aliases[name] = seen[identity]
            continue
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in storages:  # a view into a storage already written: its own copy
            tensor = tensor.clone()
        elif tensor.numel():
            storages.add(pointer)
            if identity is not None:
                seen[identity] = name
        kept[name] = tensor.contiguous()
    # An alias of an alias points at the stored name.
    return kept, {alias: _stored(source, aliases) for alias, source in aliases.items()}


def _stored(name: str, aliases: dict[str, str]) -> str:
    while name in aliases:
        name = aliases[name]
    return name


def with_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """`tensors` with each alias of a tied weight back, the very tensor of its source."""
    return {**tensors, **{alias: tensors[source] for alias, source in aliases.items() if source in tensors}}


def save(
    tensors: dict[str, torch.Tensor],
    path: str,
    metadata: dict[str, str] | None = None,
    tied: dict[str, str] | None = None,
    before_rename: Any = None,
) -> None:
    """Write `tensors` (each storage once, aliases in the header) to `path` atomically: the old file, or the
    new one whole, whatever happens (safe_files.replacing)."""
    kept, aliases = stored_once(tensors, tied)
    header_entries = {
        "format": "pt",
        **(metadata or {}),
        **({TIED_KEY: json.dumps(aliases)} if aliases else {}),
    }
    data = library("writing safetensors").save(
        {name: tensor.detach().cpu() for name, tensor in kept.items()}, metadata=header_entries
    )
    with safe_files.replacing(path, "wb", sync_folder=True, before_rename=before_rename) as file:
        file.write(data)


def load(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the safetensors file `path` on the CPU (tied aliases restored) and its header."""
    tensors = library("reading safetensors").load_file(path)
    metadata = header(path)
    return with_aliases(tensors, json.loads(metadata.get(TIED_KEY, "{}"))), metadata


# ---------------------------------------------------------------- a checkpoint's nested state
def split_state(state: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """A checkpoint's nested state as (JSON with a reference in place of each tensor, {path: tensor})."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value
            return {_TENSOR: path}
        if isinstance(value, dict):
            if all(isinstance(key, str) and not key.startswith("__") for key in value):
                return {key: encode(item, f"{path}/{key}") for key, item in value.items()}
            return {
                _PAIRS: [
                    [encode(key, f"{path}/{index}k"), encode(item, f"{path}/{index}")]
                    for index, (key, item) in enumerate(value.items())
                ]
            }
        if isinstance(value, tuple):
            return {_TUPLE: [encode(item, f"{path}/{index}") for index, item in enumerate(value)]}
        if isinstance(value, list):
            return [encode(item, f"{path}/{index}") for index, item in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(
            f"{path or 'the state'} holds a {type(value).__name__}, which a safetensors checkpoint "
            f"cannot hold (tensors, numbers, strings, lists and dicts only)"
        )

    return json.dumps(encode(state, "")), tensors


def join_state(text: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The nested state `split_state` split, with its tensors back in place."""

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if _TENSOR in value:
                return tensors[value[_TENSOR]]
            if _TUPLE in value:
                return tuple(decode(item) for item in value[_TUPLE])
            if _PAIRS in value:
                return {decode(key): decode(item) for key, item in value[_PAIRS]}
            return {key: decode(item) for key, item in value.items()}
        if isinstance(value, list):
            return [decode(item) for item in value]
        return value

    return decode(json.loads(text))


def save_state(state: dict[str, Any], path: str, before_rename: Any = None) -> None:
    """A checkpoint's state as one safetensors file: its tensors, and the rest as JSON in the header."""
    text, tensors = split_state(state)
    save(tensors, path, {STATE_KEY: text}, before_rename=before_rename)


class NotACheckpoint(ValueError):
    """A safetensors file of weights alone, without a trainer state."""


def load_state(path: str) -> Any:
    """The checkpoint state in the safetensors file `path`; NotACheckpoint when the file is weights alone."""
    tensors, metadata = load(path)
    if STATE_KEY not in metadata:
        raise NotACheckpoint("it holds weights only, no trainer state: start from them with --init-from")
    return join_state(metadata[STATE_KEY], tensors)
