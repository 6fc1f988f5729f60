"""Checkpoint files: atomic writes, safe loads, and finding the newest good one.

A checkpoint holds only tensors and plain containers/numbers/strings, so it
loads with `torch.load(weights_only=True)`: a file that holds anything else is
refused instead of unpickled (PITFALLS 12). Only rank 0 calls `atomic_save`;
the trainer decides what goes in.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import math
import os
import pickle
import resource
import stat
import tempfile
import warnings
from typing import Any, Callable, Optional

import torch

from multigpu import safe_files
from multigpu.checkpoints import tensor_files
from multigpu.checkpoints import run_folders
from multigpu.errors import UsageError
from multigpu.checkpoints.run_folders import newest_first, resumable_files

# 2: records the optimizer/scheduler classes and the monitored metric (best.pt may follow any metric).
FORMAT_VERSION = 2
TMP_SUFFIX = safe_files.TMP_SUFFIX  # unfinished saves: never loaded, removed at the next start
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scheduler", "scaler", "epoch", "global_step", "config")
# A sharded checkpoint folder (multigpu/checkpoints/sharded.py): DCP's shards and its metadata, written last, and rank 0's
# file of the rest (every key above but the model's and optimizer's).
MARKER = run_folders.SHARDED_MARKER
STATE_FILE = run_folders.SHARDED_STATE_FILE


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: one line naming the file and why."""


def atomic_save(state: dict[str, Any], path: str, before_rename: Optional[Callable[[], None]] = None) -> None:
    """Write `state` to `path` so that a crash at any instant leaves the old file intact.

    Temporary file in the same directory (same file system, so the rename is
    atomic), flushed and fsynced, then renamed over the target; the directory is
    fsynced so the rename itself survives a power cut (`safe_files.replacing`,
    which refuses a symbolic link planted at `path`). A failed write (full disk,
    file too large) raises the OSError that caused it and leaves no temporary file.
    `before_rename` runs between the fsync and the rename: the test-only fault
    injector kills the process there.
    """
    if path.endswith(tensor_files.SUFFIX):  # --checkpoint-format safetensors: no pickle
        tensor_files.save_state(state, path, before_rename=before_rename)
        return
    with safe_files.replacing(path, "wb", sync_folder=True, before_rename=before_rename) as tmp_file:
        _save_to(state, tmp_file)


class _RecordingWriter:
    """A file wrapper that remembers the OSError of a failed write.

    torch.save turns a failed write into an opaque RuntimeError ("unexpected pos
    ..."); the recorded error says what really happened (No space left on device).
    """

    def __init__(self, file: Any):
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def _save_to(state: dict[str, Any], file: Any) -> None:
    writer = _RecordingWriter(file)
    try:
        torch.save(state, writer)
    except RuntimeError:
        if writer.error is not None:
            raise writer.error from None
        raise


def is_sharded(path: str) -> bool:
    """Whether `path` names a sharded checkpoint folder (complete or not), not a folder of checkpoints."""
    name = os.path.basename(os.path.normpath(path))
    return os.path.isdir(path) and (name in ("last", "best") or fnmatch.fnmatch(name, "step-[0-9]*[0-9]")
                                    or any(os.path.exists(os.path.join(path, part)) for part in (MARKER, STATE_FILE)))


def check_complete(path: str) -> Any:
    """DCP's metadata of the sharded folder `path`, read safely (`read_metadata`); CheckpointError (one line)
    unless the folder holds that metadata, its state file, and every shard file the metadata names, whole."""
    missing = [part for part in (MARKER, STATE_FILE) if not os.path.isfile(os.path.join(path, part))]
    if missing:
        raise CheckpointError(f"checkpoint {path} refused: an incomplete sharded checkpoint (no "
                              f"{' or '.join(missing)}: its save did not finish)")
    metadata = read_metadata(path)
    damage = _storage_problem(metadata) or _shard_files_problem(path, metadata)
    if damage:
        raise CheckpointError(f"checkpoint {path} refused: {damage}")
    return metadata


# What DCP's `.metadata` (a pickle) is made of, as torch 2.14 writes it: the dataclasses of
# torch.distributed.checkpoint.metadata, the file system writer's entry, torch.Size, dtypes and layouts, the
# checkpoint's path, plain containers. Nothing else is built: a `.metadata` that names anything else (os.system
# in a __reduce__) is refused before DCP reads it (MULTI_GPU_GUIDE.md, "Sharded checkpoints: every rank writes
# its own shards").
_DCP = "torch.distributed.checkpoint."
METADATA_GLOBALS = frozenset(
    {(_DCP + "metadata", name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                            "_MEM_FORMAT_ENCODING")}
    | {(_DCP + "filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
       ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")})


class _Refused(pickle.UnpicklingError):
    """A global that DCP's metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # vars(), not getattr(): torch's module __getattr__ imports submodules by name
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
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
        raise CheckpointError(f"checkpoint {path} refused: its {MARKER} names {refused}, which DCP's metadata never "
                              f"holds and loading would call; nothing in it was run") from None
    except Exception as error:  # garbage, cut short: whatever the unpickler met first
        raise CheckpointError(f"checkpoint {path} refused: its {MARKER} is not DCP's metadata, truncated or corrupt "
                              f"({type(error).__name__}: {str(error)[:120]})") from None
    from torch.distributed.checkpoint.metadata import Metadata
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path} refused: its {MARKER} holds a {type(metadata).__name__}, not DCP's "
                              f"metadata")
    return metadata


def _storage_problem(metadata: Any) -> Optional[str]:
    """What in DCP's `metadata` DCP would fail on (an entry DCP does not write, a tensor without its stored
    bytes), in words; None when every tensor piece and value has its place in a shard file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
    where, entries, paths = metadata.storage_data, metadata.state_dict_metadata, metadata.planner_data
    malformed = f"its {MARKER} is malformed (entries DCP does not write)"
    if not (isinstance(where, dict) and isinstance(entries, dict) and isinstance(paths, (dict, type(None)))):
        return malformed
    if not all(isinstance(key, MetadataIndex) and isinstance(info, _StorageInfo) and _counts(info.offset, info.length)
               and isinstance(info.relative_path, str) and info.relative_path not in ("", ".", "..")
               and os.path.basename(info.relative_path) == info.relative_path for key, info in where.items()):
        return malformed
    # An export rebuilds each value where these paths say: an index past the entries would grow a list for good.
    if not all(isinstance(path, tuple) and all(isinstance(part, str) or _counts(part) and part < len(entries)
                                               for part in path) for path in (paths or {}).values()):
        return malformed
    for name, entry in entries.items():
        try:  # each piece's offsets in the tensor and bytes of data; an entry of other types fails here
            pieces = [(None, 0)] if isinstance(entry, BytesStorageMetadata) else [
                (chunk.offsets, math.prod(chunk.sizes) * entry.properties.dtype.itemsize)
                for chunk in entry.chunks if _counts(*entry.size, *chunk.offsets, *chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)]
        except (AttributeError, TypeError, ValueError):
            return malformed
        if not isinstance(name, str) or not isinstance(entry, (BytesStorageMetadata, TensorStorageMetadata)) \
                or len(pieces) != len(getattr(entry, "chunks", [None])):
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


def _shard_files_problem(path: str, metadata: Any) -> Optional[str]:
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
            problems.append(f"shard file {name} is cut short ({there.st_size} bytes of the {size} its {MARKER} "
                            f"names)")
    return f"its {', '.join(problems)}" if problems else None


def load(path: str) -> dict[str, Any]:
    """Load and validate a checkpoint on the CPU; CheckpointError (one line) if it is unusable. Of a sharded
    folder, everything but the model's and optimizer's shards (multigpu/checkpoints/sharded.py reads those)."""
    if is_sharded(path):
        check_complete(path)
        return _load_file(os.path.join(path, STATE_FILE), path, [key for key in REQUIRED_KEYS
                                                                 if key not in ("model", "optimizer")])
    return _load_file(path, path, REQUIRED_KEYS)


def _load_file(path: str, name: str, required: Any) -> dict[str, Any]:
    """Load and validate the checkpoint file `path` (`name` in messages: its folder for a sharded one), which
    must hold the `required` keys."""
    try:
        kind = _file_kind(path)
        if kind == SAFETENSORS_KIND:
            state = tensor_files.load_state(path)
        elif kind is not None:
            raise CheckpointError(f"checkpoint {name} refused: not a checkpoint ({kind})")
        else:
            with warnings.catch_warnings():  # its multi-line pickle-protocol warning would break the one line
                warnings.filterwarnings("ignore", module="torch._weights_only_unpickler")
                state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {name} does not exist") from None
    except OSError as error:
        if error.errno == errno.EINVAL:  # torch's reader seeking past the end of a file cut short
            raise CheckpointError(f"checkpoint {name} refused: truncated or corrupt ({error.strerror})") from None
        raise CheckpointError(f"checkpoint {name} cannot be read: {error.strerror or error}") from None
    except CheckpointError:
        raise
    except tensor_files.NotACheckpoint as error:  # a safetensors file of weights alone
        raise CheckpointError(f"checkpoint {name} refused: {error}") from None
    except Exception as error:  # truncated, random bytes, or a pickle that holds code
        raise CheckpointError(f"checkpoint {name} refused: {load_failure(error)}") from None
    missing = [key for key in required if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {name} lacks {', '.join(missing)}: not written by this trainer")
    if state["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {name} has format {state['format_version']}, newer than this code "
                              f"({FORMAT_VERSION}): update the code")
    return _upgrade(state)


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A format-1 checkpoint in today's terms: it trained a built-in optimizer and schedule, best by val_acc."""
    if state["format_version"] == 1:
        best = state.pop("best_val_acc", -1.0)
        state.update(format_version=2, monitor="val_acc", best_value=None if best < 0 else best,
                     optimizer_class={"sgd": "SGD"}.get(state["config"].get("optimizer"), "AdamW"),
                     scheduler_class="LambdaLR", scheduler_interval="step")
    return state


# How torch.save files begin: a zip archive (the default since torch 1.6), or the legacy pickle's protocol mark.
TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")


SAFETENSORS_KIND = "a safetensors file"  # what _file_kind says of one: a checkpoint (--checkpoint-format
# safetensors) when its header holds the trainer's state


_SPECIAL_FILES = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                  stat.S_IFBLK: "a block device"}


def _file_kind(path: str) -> Optional[str]:
    """None for what may be a torch.save file; SAFETENSORS_KIND for a safetensors file; else what the file is
    instead, in a few words.

    Without this, torch's unpickler reports a text file as a bare opcode number, and
    reading a named pipe waits for a writer forever.
    """
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        return "a folder, not a checkpoint file"
    if not stat.S_ISREG(mode):
        return f"{_SPECIAL_FILES.get(stat.S_IFMT(mode), 'a special file')}, not a regular file"
    with open(path, "rb") as file:
        head = file.read(512)
    if not head:
        return "the file is empty"
    if tensor_files.is_safetensors(path):  # first: its header's length may begin with the pickle mark, 0x80
        return SAFETENSORS_KIND
    if head.startswith(TORCH_SAVE_MAGIC):
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:  # possibly a multi-byte character cut at 512 bytes: still text if the rest is
        text = head[:-4].decode("utf-8", errors="replace")
    if "\ufffd" not in text and all(char.isprintable() or char.isspace() for char in text):
        return "it holds text; a checkpoint is what torch.save writes"
    return "not a file written by torch.save"


def load_failure(error: Exception) -> str:
    """Why torch.load(weights_only=True) failed, in a few words plus torch's one telling line.

    torch's messages run over many lines and suggest weights_only=False, which
    would run whatever code the file holds: never repeat that advice.
    """
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation", "(1)", "(2)")
    lines = [line.replace("WeightsUnpickler error:", "").strip() for line in str(error).splitlines()]
    telling = [line for line in lines if line and not line.startswith(boilerplate)]
    detail = (telling or [type(error).__name__])[0]
    if isinstance(error, pickle.UnpicklingError):
        kind = "it holds something other than tensors and plain data, or is not a checkpoint"
    else:
        kind = "truncated or corrupt"
    return f"{kind} ({detail.split('. ')[0][:160]})"


def step_checkpoint_name(global_step: int, suffix: str = ".pt") -> str:
    """File name of the step checkpoint of `global_step` (zero-padded, so names sort by step)."""
    return f"step-{global_step:09d}{suffix}"


def step_checkpoint_path(save_dir: str, global_step: int, suffix: str = ".pt") -> str:
    return os.path.join(save_dir, step_checkpoint_name(global_step, suffix))


def load_newest(save_dir: str, warn: Callable[[str], None]) -> Optional[tuple[str, dict[str, Any]]]:
    """The most recently written checkpoint in `save_dir` that loads and validates, or None.

    A broken newer file (truncated by a full disk, overwritten by something
    else) is reported through `warn` in one line (why it was refused) and
    skipped for the next one.
    """
    for path in resumable_files(save_dir):
        try:
            return path, load(path)
        except CheckpointError as error:
            warn(str(error))
    return None


def prune_step_checkpoints(save_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints, files or folders (called only after a new one is in
    place)."""
    for path in newest_first(run_folders.matching(save_dir, tuple(f"step-*{suffix}" for suffix in run_folders.FILE_SUFFIXES),
                                                  ("step-[0-9]*[0-9]",)))[keep:]:
        safe_files.remove(path)


def remove_unfinished(save_dir: str) -> list[str]:
    """Delete the temporary files and folders of saves that a killed process never finished; return their names.
    A sharded checkpoint a kill caught between its two renames (safe_files.replace_folder) is put back first.

    Only one run may use a save dir at a time, so no other process is writing them.
    """
    for old in glob.glob(os.path.join(save_dir, "*" + safe_files.OLD_SUFFIX)):
        if not os.path.lexists(old[:-len(safe_files.OLD_SUFFIX)]):
            os.rename(old, old[:-len(safe_files.OLD_SUFFIX)])
    unfinished = run_folders.matching(save_dir, (*(f"*{suffix}.*{TMP_SUFFIX}" for suffix in run_folders.FILE_SUFFIXES),
                                             "*" + safe_files.OLD_SUFFIX),
                                  tuple(folder + TMP_SUFFIX for folder in run_folders.CHECKPOINT_FOLDERS))
    for path in unfinished:
        safe_files.remove(path)
    return [os.path.basename(path) for path in unfinished]


def size_of(path: str) -> int:
    """Bytes of the checkpoint at `path`: a file's, or a sharded folder's files together."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


PROBE_BYTES = 64 * 1024  # real bytes: an empty file can be created on a full disk
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def check_writable(directory: str, flag: str = "--save-dir", inside: Optional[str] = None) -> None:
    """Fail at start, not after an epoch of training, when files cannot be written to `directory`.

    Creates the directory (`safe_files.make_folder`: a symbolic link planted
    below `inside`, a folder the user named, is refused), writes PROBE_BYTES
    real bytes, fsyncs (network file systems report a full disk or quota there)
    and deletes them; UsageError naming `flag` if that fails.
    """
    try:
        safe_files.make_folder(directory, inside)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-") as probe:
            probe.write(b"\0" * PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        fix = "free some space or choose another directory" if error.errno in _NO_ROOM else "choose another directory"
        raise UsageError(f"{flag} {directory} is not writable ({error.strerror or error}); {fix}") from None


def room_shortfall(directory: str, need_bytes: int, file_bytes: int, what: str) -> Optional[tuple[str, str]]:
    """Why `need_bytes` of checkpoints (`what` they are), each file about `file_bytes`, will not fit in
    `directory`, its free space or the file size limit (ulimit -f) against the need, and what would make
    them fit, both in words; None when they fit."""
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if free < need_bytes:
        return (f"has {megabytes(free)} free, but this run's checkpoints need about {megabytes(need_bytes)} ({what})",
                f"free some space, choose another directory")
    if limit != resource.RLIM_INFINITY and limit < file_bytes:
        return (f"is under a file size limit (ulimit -f) of {megabytes(limit)}, but one checkpoint needs about "
                f"{megabytes(file_bytes)}", "raise the limit (ulimit -f unlimited)")
    return None


def megabytes(count: int) -> str:
    """A byte count for people: "1.1 MB"."""
    return f"{count / 1e6:.1f} MB"


def estimate_size(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                  model_copies: int = 1) -> int:
    """About how many bytes one checkpoint of `model` takes: its state (`model_copies` times: 2 with an EMA's
    average), plus the optimizer's per-parameter state (created at the first step, so counted from the
    optimizer's kind: 2 tensors for Adam-like optimizers, 1 for SGD with momentum), plus a little for the rest."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if optimizer is None:
        slots = 0
    elif isinstance(optimizer, torch.optim.SGD):
        slots = 1 if any(group.get("momentum") for group in optimizer.param_groups) else 0
    else:
        slots = 2  # Adam, AdamW and most others keep two tensors per parameter
    return model_copies * model_bytes + slots * params + 64 * 1024
