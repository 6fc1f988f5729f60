"""Checkpoint files: atomic writes, safe loads, and finding the newest good one.

A checkpoint holds only tensors and plain containers/numbers/strings, so it
loads with `torch.load(weights_only=True)`: a file that holds anything else is
refused instead of unpickled (PITFALLS 12). Only rank 0 calls `atomic_save`;
the trainer decides what goes in.
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Any, Callable, Optional

import torch

from multigpu.errors import UsageError

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scheduler", "scaler", "epoch", "global_step", "config")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: one line naming the file and why."""


def atomic_save(state: dict[str, Any], path: str) -> None:
    """Write `state` to `path` so that a crash at any instant leaves the old file intact.

    Temporary file in the same directory (same file system, so the rename is
    atomic), flushed and fsynced, then renamed over the target; the directory is
    fsynced so the rename itself survives a power cut.
    """
    directory = os.path.dirname(os.path.abspath(path))
    handle, tmp_path = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as tmp_file:
            torch.save(state, tmp_file)
            tmp_file.flush()
            os.fsync(tmp_file.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; a checkpoint is an ordinary file
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load(path: str) -> dict[str, Any]:
    """Load and validate a checkpoint on the CPU; CheckpointError (one line) if it is unusable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as error:  # truncated, random bytes, or a pickle that holds code
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {path} is not a valid weights-only checkpoint, refused: "
                              f"{reason[:200]}") from None
    missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: not written by this trainer")
    if state["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {state['format_version']}, newer than this code "
                              f"({FORMAT_VERSION}): update the code")
    return state


def step_checkpoint_path(save_dir: str, global_step: int) -> str:
    return os.path.join(save_dir, f"step-{global_step:09d}.pt")


def resumable_files(save_dir: str) -> list[str]:
    """Checkpoints in `save_dir` that a resume may use, newest first (best.pt is not one: it is older)."""
    files = glob.glob(os.path.join(save_dir, "step-*.pt")) + glob.glob(os.path.join(save_dir, "last.pt"))
    return sorted(files, key=os.path.getmtime, reverse=True)


def load_newest(save_dir: str, warn: Callable[[str], None]) -> Optional[tuple[str, dict[str, Any]]]:
    """The newest checkpoint in `save_dir` that loads and validates, skipping (and reporting) broken ones.

    Among files that load, the one with the highest global step wins, so a
    step checkpoint written after last.pt is preferred to it.
    """
    loaded = []
    for path in resumable_files(save_dir):
        try:
            loaded.append((path, load(path)))
        except CheckpointError as error:
            warn(f"{error}; trying an older one")
            continue
        if len(loaded) == 2:  # last.pt and the newest step file are all that can compete
            break
    if not loaded:
        return None
    return max(loaded, key=lambda item: (item[1]["global_step"], item[1].get("samples_in_epoch", 0) == 0))


def prune_step_checkpoints(save_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints (called only after a new one is in place)."""
    steps = sorted(glob.glob(os.path.join(save_dir, "step-*.pt")))
    for path in steps[:-keep]:
        os.unlink(path)


def check_writable(save_dir: str) -> None:
    """Fail at start, not after an epoch of training, when checkpoints cannot be written."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save_dir, prefix=".write-test-"):
            pass
    except OSError as error:
        raise UsageError(f"--save-dir {save_dir} is not writable ({error.strerror}); choose another directory") \
            from None
