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
import os
import pickle
import resource
import stat
import tempfile
import warnings
from typing import Any, Callable

import torch

from multigpu import safe_files
from multigpu.checkpoints import run_folders, tensor_files
from multigpu.checkpoints.dcp_metadata import check_complete
from multigpu.checkpoints.run_folders import newest_first, resumable_files
from multigpu.errors import CheckpointError, UsageError
from multigpu.parallel import lora

# 2: records the optimizer/scheduler classes and the monitored metric (best.pt may follow any metric).
FORMAT_VERSION = 2
TMP_SUFFIX = safe_files.TMP_SUFFIX  # unfinished saves: never loaded, removed at the next start
REQUIRED_KEYS = (
    "format_version",
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "epoch",
    "global_step",
    "config",
)
# A sharded checkpoint folder (multigpu/checkpoints/sharded.py): DCP's shards and its metadata, written last, and
# rank 0's file of the rest (every key above but the model's and optimizer's).
MARKER = run_folders.SHARDED_MARKER
STATE_FILE = run_folders.SHARDED_STATE_FILE


def atomic_save(state: dict[str, Any], path: str, before_rename: Callable[[], None] | None = None) -> None:
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
        self.file = file
        self.error: OSError | None = None

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
        torch.save(state, writer)  # type: ignore[arg-type]  # torch.save takes any object with write and flush
    except RuntimeError:
        if writer.error is not None:
            raise writer.error from None
        raise


def is_sharded(path: str) -> bool:
    """Whether `path` names a sharded checkpoint folder (complete or not), not a folder of checkpoints."""
    name = os.path.basename(os.path.normpath(path))
    return os.path.isdir(path) and (
        name in ("last", "best")
        or fnmatch.fnmatch(name, "step-[0-9]*[0-9]")
        or any(os.path.exists(os.path.join(path, part)) for part in (MARKER, STATE_FILE))
    )


def load(path: str) -> dict[str, Any]:
    """Load and validate a checkpoint on the CPU; CheckpointError (one line) if it is unusable. Of a sharded
    folder, everything but the model's and optimizer's shards (multigpu/checkpoints/sharded.py reads those)."""
    if is_sharded(path):
        check_complete(path)
        return _load_file(
            os.path.join(path, STATE_FILE),
            path,
            [key for key in REQUIRED_KEYS if key not in ("model", "optimizer")],
        )
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
            raise CheckpointError(
                f"checkpoint {name} refused: truncated or corrupt ({error.strerror})"
            ) from None
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
        raise CheckpointError(
            f"checkpoint {name} has format {state['format_version']}, newer than this code "
            f"({FORMAT_VERSION}): update the code"
        )
    return _upgrade(state)


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A format-1 checkpoint in today's terms: it trained a built-in optimizer and schedule, best by val_acc."""
    if state["format_version"] == 1:
        best = state.pop("best_val_acc", -1.0)
        state.update(
            format_version=2,
            monitor="val_acc",
            best_value=None if best < 0 else best,
            optimizer_class={"sgd": "SGD"}.get(state["config"].get("optimizer"), "AdamW"),
            scheduler_class="LambdaLR",
            scheduler_interval="step",
        )
    return state


# How torch.save files begin: a zip archive (the default since torch 1.6), or the legacy pickle's protocol mark.
TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")


SAFETENSORS_KIND = "a safetensors file"  # what _file_kind says of one: a checkpoint (--checkpoint-format
# safetensors) when its header holds the trainer's state


_SPECIAL_FILES = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _file_kind(path: str) -> str | None:
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
    if path.endswith(tensor_files.SUFFIX) and not head.startswith(TORCH_SAVE_MAGIC):
        return SAFETENSORS_KIND  # one cut short within its header: safetensors' reader says what is wrong
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
    boilerplate = (
        "Weights only load failed",
        "Please file an issue",
        "Check the documentation",
        "(1)",
        "(2)",
    )
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


def load_newest(save_dir: str, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
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
    for path in newest_first(
        run_folders.matching(
            save_dir, tuple(f"step-*{suffix}" for suffix in run_folders.FILE_SUFFIXES), ("step-[0-9]*[0-9]",)
        )
    )[keep:]:
        safe_files.remove(path)


def remove_unfinished(save_dir: str) -> list[str]:
    """Delete the temporary files and folders of saves that a killed process never finished; return their names.
    A sharded checkpoint a kill caught between its two renames (safe_files.replace_folder) is put back first.

    Only one run may use a save dir at a time, so no other process is writing them.
    """
    for old in glob.glob(os.path.join(save_dir, "*" + safe_files.OLD_SUFFIX)):
        if not os.path.lexists(old[: -len(safe_files.OLD_SUFFIX)]):
            os.rename(old, old[: -len(safe_files.OLD_SUFFIX)])
    unfinished = run_folders.matching(
        save_dir,
        (*(f"*{suffix}.*{TMP_SUFFIX}" for suffix in run_folders.FILE_SUFFIXES), "*" + safe_files.OLD_SUFFIX),
        tuple(folder + TMP_SUFFIX for folder in run_folders.CHECKPOINT_FOLDERS),
    )
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


def check_writable(directory: str, flag: str = "--save-dir", inside: str | None = None) -> None:
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
        fix = (
            "free some space or choose another directory"
            if error.errno in _NO_ROOM
            else "choose another directory"
        )
        raise UsageError(f"{flag} {directory} is not writable ({error.strerror or error}); {fix}") from None


def room_shortfall(directory: str, need_bytes: int, file_bytes: int, what: str) -> tuple[str, str] | None:
    """Why `need_bytes` of checkpoints (`what` they are), each file about `file_bytes`, will not fit in
    `directory`, its free space or the file size limit (ulimit -f) against the need, and what would make
    them fit, both in words; None when they fit."""
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if free < need_bytes:
        return (
            f"has {megabytes(free)} free, but this run's checkpoints need about {megabytes(need_bytes)} ({what})",
            "free some space, choose another directory",
        )
    if limit != resource.RLIM_INFINITY and limit < file_bytes:
        return (
            f"is under a file size limit (ulimit -f) of {megabytes(limit)}, but one checkpoint needs about "
            f"{megabytes(file_bytes)}",
            "raise the limit (ulimit -f unlimited)",
        )
    return None


def megabytes(count: int) -> str:
    """A byte count for people: "1.1 MB"."""
    return f"{count / 1e6:.1f} MB"


def estimate_size(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, model_copies: int = 1
) -> int:
    """About how many bytes one checkpoint of `model` takes: its state (`model_copies` times: 2 with an EMA's
    average), plus the optimizer's per-parameter state (created at the first step, so counted from the
    optimizer's kind: 2 tensors for Adam-like optimizers, 1 for SGD with momentum, of the parameters that train),
    plus a little for the rest. A LoRA run's checkpoint holds its adapters alone (multigpu/parallel/lora.py)."""
    state = model.state_dict()
    kept = lora.trainable_part(model, state) if lora.is_adapted(model) else state
    model_bytes = sum(t.numel() * t.element_size() for t in kept.values() if torch.is_tensor(t))
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if optimizer is None:
        slots = 0
    elif isinstance(optimizer, torch.optim.SGD):
        slots = 1 if any(group.get("momentum") for group in optimizer.param_groups) else 0
    else:
        slots = 2  # Adam, AdamW and most others keep two tensors per parameter
    return model_copies * model_bytes + slots * params + 64 * 1024
