"""A sharded checkpoint folder's DCP metadata, read without running code, and checked against its shard files.

DCP's `.metadata` is a pickle: unpickled as it is, a crafted one runs whatever its `__reduce__` names. Here it
is built by an unpickler that admits only what DCP's metadata is made of, then checked (every entry well
formed, every shard file there and as long as the entries say) before DCP is handed it (multigpu/checkpoints/
sharded.py), so a damaged or hostile folder is one line naming what is wrong (docs/checkpoints.md, "Sharded
checkpoints: every rank writes its own shards").
"""

from __future__ import annotations

import math
import os
import pickle
import stat
from typing import Any

import torch

from multigpu.checkpoints.run_folders import SHARDED_MARKER as MARKER
from multigpu.checkpoints.run_folders import SHARDED_STATE_FILE as STATE_FILE
from multigpu.errors import CheckpointError


def check_complete(path: str) -> Any:
    """DCP's metadata of the sharded folder `path`, read safely (`read_metadata`); CheckpointError (one line)
    unless the folder holds that metadata, its state file, and every shard file the metadata names, whole."""
    missing = [part for part in (MARKER, STATE_FILE) if not os.path.isfile(os.path.join(path, part))]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} refused: an incomplete sharded checkpoint (no "
            f"{' or '.join(missing)}: its save did not finish)"
        )
    metadata = read_metadata(path)
    damage = _storage_problem(metadata) or _shard_files_problem(path, metadata)
    if damage:
        raise CheckpointError(f"checkpoint {path} refused: {damage}")
    return metadata


# What DCP's `.metadata` (a pickle) is made of, as torch 2.14 writes it: the dataclasses of
# torch.distributed.checkpoint.metadata, the file system writer's entry, torch.Size, dtypes and layouts, the
# checkpoint's path, plain containers. Nothing else is built: a `.metadata` that names anything else (os.system
# in a __reduce__) is refused before DCP reads it (docs/checkpoints.md, "Sharded checkpoints: every rank writes
# its own shards").
_DCP = "torch.distributed.checkpoint."
METADATA_GLOBALS = frozenset(
    {
        (_DCP + "metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        (_DCP + "filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class _Refused(pickle.UnpicklingError):
    """A global that DCP's metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # vars(), not getattr(): torch's module __getattr__ imports submodules by name
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}"[:100])


def read_metadata(path: str) -> Any:
    """The `.metadata` of the sharded folder `path`, built by an unpickler that admits only what DCP's metadata is
    made of (METADATA_GLOBALS); anything else, or a file that is not DCP's metadata, is a CheckpointError."""
    file = os.path.join(path, MARKER)
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):  # a named pipe would block the read for good
            raise CheckpointError(f"checkpoint {path} refused: its {MARKER} is not a regular file")
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except CheckpointError:
        raise
    except _Refused as refused:
        raise CheckpointError(
            f"checkpoint {path} refused: its {MARKER} names {refused}, which DCP's metadata never "
            f"holds and loading would call; nothing in it was run"
        ) from None
    except Exception as error:  # garbage, cut short: whatever the unpickler met first
        raise CheckpointError(
            f"checkpoint {path} refused: its {MARKER} is not DCP's metadata, truncated or corrupt "
            f"({type(error).__name__}: {str(error)[:120]})"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint {path} refused: its {MARKER} holds a {type(metadata).__name__}, not DCP's metadata"
        )
    return metadata


def _storage_problem(metadata: Any) -> str | None:
    """What in DCP's `metadata` DCP would fail on (an entry DCP does not write, a tensor without its stored
    bytes), in words; None when every tensor piece and value has its place in a shard file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    where, entries, paths = metadata.storage_data, metadata.state_dict_metadata, metadata.planner_data
    malformed = f"its {MARKER} is malformed (entries DCP does not write)"
    if not (isinstance(where, dict) and isinstance(entries, dict) and isinstance(paths, (dict, type(None)))):
        return malformed
    if not all(
        isinstance(key, MetadataIndex)
        and isinstance(info, _StorageInfo)
        and _counts(info.offset, info.length)
        and isinstance(info.relative_path, str)
        and info.relative_path not in ("", ".", "..")
        and os.path.basename(info.relative_path) == info.relative_path
        for key, info in where.items()
    ):
        return malformed
    # An export rebuilds each value where these paths say: an index past the entries would grow a list for good.
    if not all(
        isinstance(path, tuple)
        and all(isinstance(part, str) or _counts(part) and part < len(entries) for part in path)
        for path in (paths or {}).values()
    ):
        return malformed
    for name, entry in entries.items():
        try:  # each piece's offsets in the tensor and bytes of data; an entry of other types fails here
            pieces = (
                [(None, 0)]
                if isinstance(entry, BytesStorageMetadata)
                else [
                    (chunk.offsets, math.prod(chunk.sizes) * entry.properties.dtype.itemsize)
                    for chunk in entry.chunks
                    if _counts(*entry.size, *chunk.offsets, *chunk.sizes)
                    and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                ]
            )
        except (AttributeError, TypeError, ValueError):
            return malformed
        if (
            not isinstance(name, str)
            or not isinstance(entry, (BytesStorageMetadata, TensorStorageMetadata))
            or len(pieces) != len(getattr(entry, "chunks", [None]))
        ):
            return malformed
        for offsets, data_bytes in pieces:
            info = where.get(MetadataIndex(name, offsets))
            if info is None:
                return f"its {MARKER} names {name} but not where it is stored"
            if not info.transform_descriptors and data_bytes > info.length:
                return f"its {MARKER} gives {name} more bytes than it stores"
    return None


def _counts(*numbers: Any) -> bool:
    """Whether every one of `numbers` is a count: an int, 0 or more."""
    return all(isinstance(number, int) and number >= 0 for number in numbers)


def _shard_files_problem(path: str, metadata: Any) -> str | None:
    """Which shard files of the folder `path` are missing or cut short, against the offsets and lengths its
    `metadata` gives them; None when every one is there, whole."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        try:
            there = os.stat(os.path.join(path, name))
        except FileNotFoundError:
            problems.append(f"shard file {name} is missing")
            continue
        if not stat.S_ISREG(there.st_mode):
            problems.append(f"shard file {name} is not a regular file")
        elif there.st_size < size:
            problems.append(
                f"shard file {name} is cut short ({there.st_size} bytes of the {size} its {MARKER} names)"
            )
    return f"its {', '.join(problems)}" if problems else None
