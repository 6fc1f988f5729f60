"""The save-dir's folders: numbered run folders, the checkpoints in one, and --overwrite's set-aside copy.

Run folders
-----------
Without --save-dir a run writes to a new `run-N` folder under the default
root (like Lightning's version folders), so running the same command twice
keeps both runs, and TensorBoard pointed at the root compares them. With
--resume auto it continues the newest folder whose run was trained with the
command's settings (multigpu/checkpoints/run_settings.py), and refuses when runs are there
but none matches, rather than continue another command's run.

--overwrite
-----------
`set_aside` moves the old checkpoints into `<save-dir>/.replaced-<time>/`
(never deleted at start); `drop_set_aside` removes that copy once the new
run's first checkpoint is safely written, and `put_back` returns every file
to where it was if the run ends before that. A run killed in between leaves
the folder behind: the next run to take the save-dir puts it back
(`leftovers` says which to put back and which to leave to the user).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from multigpu.checkpoints import run_settings
from multigpu.checkpoints.savedir import read_owner, restart_count
from multigpu.config import DEFAULT_SAVE_ROOT, TrainConfig
from multigpu.errors import UsageError

if TYPE_CHECKING:
    from multigpu.parallel.distributed import Runtime

RUN_PREFIX = "run-"
SET_ASIDE_PREFIX = ".replaced-"
# What --overwrite sets aside: checkpoint files, and sharded checkpoint folders (multigpu/checkpoints/sharded.py).
# A one-file checkpoint is a .pt (torch.save) or, with --checkpoint-format safetensors, a .safetensors file.
FILE_SUFFIXES = (".pt", ".safetensors")
CHECKPOINT_FILES = tuple(f"{name}{suffix}" for suffix in FILE_SUFFIXES for name in ("last", "best", "step-*"))
LAST_FILES = tuple(f"{name}{suffix}" for suffix in FILE_SUFFIXES for name in ("step-*", "last"))
CHECKPOINT_FOLDERS = ("last", "best", "step-[0-9]*[0-9]")
CHECKPOINT_PATTERNS = CHECKPOINT_FILES + CHECKPOINT_FOLDERS
SHARDED_MARKER = ".metadata"  # a sharded checkpoint folder's last file written: its time is the folder's
SHARDED_STATE_FILE = "trainer_state.pt"  # rank 0's part of a sharded checkpoint folder: config, progress, ...


def folder_numbers(root: str, prefix: str) -> list[int]:
    """The N of every folder `root/<prefix>N`, ascending (run-N here, the sweeps' sweep-N too)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        int(m.group(1))
        for m in map(pattern.match, names)
        if m and os.path.isdir(os.path.join(root, m.group(0)))
    )


def _run_numbers(root: str) -> list[int]:
    return folder_numbers(root, RUN_PREFIX)


def newest_run_dir(root: str) -> str | None:
    """`root/run-N` with the highest N, or None when `root` holds no run folder."""
    numbers = _run_numbers(root)
    return os.path.join(root, f"{RUN_PREFIX}{numbers[-1]}") if numbers else None


def next_run_dir(root: str) -> str:
    """The name `new_run_dir` would create now (the launcher names it in its command; nothing is created)."""
    return os.path.join(root, f"{RUN_PREFIX}{(_run_numbers(root) or [0])[-1] + 1}")


def sibling_dir(save_dir: str) -> str:
    """A folder beside `save_dir` that does not exist yet: `<save-dir>-2`, `-3`, ..."""
    number = 2
    while os.path.lexists(f"{save_dir.rstrip(os.sep)}-{number}"):
        number += 1
    return f"{save_dir.rstrip(os.sep)}-{number}"


def new_run_dir(root: str) -> str:
    """Create and return `root/run-N`, N one above the highest there (two runs starting together get two)."""
    os.makedirs(root, exist_ok=True)
    number = (_run_numbers(root) or [0])[-1] + 1
    while True:
        path = os.path.join(root, f"{RUN_PREFIX}{number}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            number += 1


def run_folder(config: TrainConfig, runtime: Runtime) -> tuple[TrainConfig, str | None]:
    """`config` with its save-dir chosen when --save-dir was not given, and the line that says so.

    Each run then gets a folder of its own under checkpoints/ (run-1, run-2, ...),
    so running one command twice keeps both runs; --resume auto continues the
    newest. Rank 0 chooses, every rank learns its choice.
    """
    # Imported here: the rest of this module serves the launcher's rule set, which imports no torch.
    from multigpu.parallel.distributed import gather_objects

    if config.save_dir is not None:
        return config, None
    choice: tuple[str, str | None, str | None] | None = None
    if runtime.is_main:
        try:
            choice = (*choose_run_dir(DEFAULT_SAVE_ROOT, config), None)
        except UsageError as error:  # runs are there, none with these settings: every rank stops
            choice = ("", "", str(error))
    main_choice = gather_objects(choice)[0]
    assert main_choice is not None  # rank 0's, made above
    path, line, refusal = main_choice
    if refusal:
        raise UsageError(refusal)
    return dataclasses.replace(config, save_dir=path), line


def choose_run_dir(root: str, config: TrainConfig) -> tuple[str, str]:
    """The run folder of a run without --save-dir, and the line that says so. Rank 0 only (it may create one).

    A torchrun restart continues the folder its job owned (else the newest);
    --resume auto continues the newest run with the command's settings
    (`run_to_continue`; UsageError when runs are there but none matches);
    anything else starts a new one.
    """
    restarted = restart_count() > 0
    if restarted:
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        for number in reversed(_run_numbers(root)):
            path = os.path.join(root, f"{RUN_PREFIX}{number}")
            owner = read_owner(path)
            if owner is not None and job is not None and owner.job == job:
                return path, f"torchrun restart {restart_count()}: continuing this job's run folder {path}"
    newest = newest_run_dir(root)
    if restarted and newest is not None:
        return newest, f"--save-dir not given: continuing the newest run folder {newest}"
    continued = run_to_continue(root, config) if config.resume == "auto" else None
    if continued is not None:
        return continued
    path = new_run_dir(root)
    return path, (
        f"--save-dir not given: this run writes to {path} (a new folder per run; "
        f"--resume auto continues the newest with the same settings)"
    )


def run_to_continue(root: str, config: TrainConfig) -> tuple[str, str] | None:
    """(folder, line): the newest run folder under `root` whose checkpoints were trained with `config`'s
    settings (--epochs may differ), for --resume auto without --save-dir; None when no folder holds a
    checkpoint. UsageError naming the newest run and how it differs when none matches."""
    newest_other: tuple[str, list[str]] | None = None
    for number in reversed(_run_numbers(root)):
        folder = os.path.join(root, f"{RUN_PREFIX}{number}")
        # A folder with no checkpoint but a killed --overwrite run's set-aside copy gets it back when it is taken.
        files = resumable_files(folder) or [
            path for aside in set_aside_folders(folder) for path in resumable_files(aside)
        ]
        saved = next(filter(None, (run_settings.saved_settings(settings_file(path)) for path in files)), None)
        if saved is None:
            continue  # nothing to continue there
        differing = run_settings.differences(saved, config)
        if not differing:
            skipped = f" ({newest_other[0]} has other settings)" if newest_other else ""
            return (
                folder,
                f"--save-dir not given: continuing {folder}, the newest run with these settings{skipped}",
            )
        newest_other = newest_other or (folder, differing)
    if newest_other is None:
        return None
    folder, differing = newest_other
    raise UsageError(
        f"--resume auto without --save-dir: no run under {root} has this command's settings; the newest, "
        f"{folder}, differs in {'; '.join(differing)}: continue it with these settings by naming it "
        f"(--save-dir {folder} --resume auto), or drop --resume auto to start a new run"
    )


def newest_first(paths: list[str]) -> list[str]:
    """Most recently written first (a sharded folder when its marker was written). On an equal mtime (coarse
    file-system clocks) last.pt, written after the step checkpoint of the same step, and then the higher step
    count as newer. A path gone by the time it is dated is left out: replica groups share one save-dir, and the
    leading group prunes its old step checkpoints while a restarted group looks for the newest."""
    dated = []
    for path in paths:
        try:
            written = written_at(path)
        except FileNotFoundError:
            continue
        dated.append((written, os.path.basename(path).split(".")[0] == "last", os.path.basename(path), path))
    return [path for *_, path in sorted(dated, reverse=True)]


def written_at(path: str) -> float:
    """When the checkpoint at `path` was written: a file's mtime, a sharded folder's marker's (the folder's own
    when it has none: a half folder, refused when loaded)."""
    marker = os.path.join(path, SHARDED_MARKER)
    return os.path.getmtime(marker if os.path.isdir(path) and os.path.exists(marker) else path)


def settings_file(path: str) -> str:
    """The file that holds the config of the checkpoint at `path`: itself, or a sharded folder's state file."""
    return os.path.join(path, SHARDED_STATE_FILE) if os.path.isdir(path) else path


def resumable_files(save_dir: str) -> list[str]:
    """Checkpoints in `save_dir` that a resume may use, files and sharded folders, newest first (best is not
    one: it is older)."""
    return newest_first(matching(save_dir, LAST_FILES, ("step-[0-9]*[0-9]", "last")))


def matching(save_dir: str, files: tuple[str, ...], folders: tuple[str, ...] = ()) -> list[str]:
    """The paths in `save_dir` that match one of the glob patterns `files`, or one of `folders` and are folders
    (no file a pattern of sharded checkpoint folders happens to match)."""
    found = {path for pattern in files for path in glob.glob(os.path.join(save_dir, pattern))}
    found |= {
        path
        for pattern in folders
        for path in glob.glob(os.path.join(save_dir, pattern))
        if os.path.isdir(path)
    }
    return sorted(found)


# ---------------------------------------------------------------- --overwrite
def checkpoint_files(save_dir: str) -> list[str]:
    """The checkpoints in `save_dir` that a new run would replace."""
    return matching(save_dir, CHECKPOINT_FILES, CHECKPOINT_FOLDERS)


def set_aside(save_dir: str, extra: tuple[str, ...] = ()) -> str | None:
    """Move the checkpoints (and the `extra` paths inside save_dir, e.g. its TensorBoard folder) into
    `<save-dir>/.replaced-<time>/`; return that folder, or None when there was nothing to move.

    Renames within one directory: nothing is copied or deleted, and a crash
    leaves every file either in place or in the set-aside folder.
    """
    paths = checkpoint_files(save_dir) + [path for path in extra if os.path.lexists(path)]
    if not paths:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, suffix = os.path.join(save_dir, SET_ASIDE_PREFIX + stamp), 1
    while True:
        try:
            os.mkdir(target)
            break
        except FileExistsError:
            suffix += 1
            target = os.path.join(save_dir, f"{SET_ASIDE_PREFIX}{stamp}-{suffix}")
    for path in paths:
        os.rename(path, os.path.join(target, os.path.basename(path)))
    return target


def set_aside_folders(save_dir: str) -> list[str]:
    """Set-aside folders still in `save_dir` (an --overwrite run that ended before its first checkpoint)."""
    return sorted(glob.glob(os.path.join(save_dir, SET_ASIDE_PREFIX + "*")))


def drop_set_aside(folder: str | None) -> None:
    """Delete a set-aside folder: call it once the new run's first checkpoint is written (by all ranks' agreement)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def put_back(folder: str) -> None:
    """Return every file of a set-aside folder to the save-dir it came from, and remove the folder.

    Renames within one directory, so each file is back byte for byte with its
    times, or still in `folder`. What the ending run wrote under the same name
    meanwhile is replaced: a file by the rename itself, a folder (its tb/ logs)
    removed first. SIGINT/SIGTERM wait until it is done.
    """
    save_dir = os.path.dirname(folder)
    with _signals_deferred():
        for name in sorted(os.listdir(folder)):
            source, target = os.path.join(folder, name), os.path.join(save_dir, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            elif os.path.lexists(target) and os.path.isdir(source):
                os.unlink(target)
            os.replace(source, target)
        os.rmdir(folder)


def put_back_command(folder: str) -> str:
    """The shell command that does what `put_back` does, for a user to run."""
    save_dir, names = os.path.dirname(folder), sorted(os.listdir(folder))
    folders_in_the_way = [
        os.path.join(save_dir, name) for name in names if os.path.isdir(os.path.join(save_dir, name))
    ]
    steps = [f"rm -rf {' '.join(map(shlex.quote, folders_in_the_way))}"] if folders_in_the_way else []
    steps.append(
        f"mv -f {' '.join(shlex.quote(os.path.join(folder, name)) for name in names)} "
        f"{shlex.quote(save_dir + os.sep)}"
    )
    return " && ".join([*steps, f"rmdir {shlex.quote(folder)}"])


def leftovers(save_dir: str, adopt: bool) -> tuple[str | None, list[str]]:
    """What to do with the set-aside folders that runs killed before their first checkpoint left in `save_dir`
    (the caller owns it). Newest first: one with no checkpoint beside it goes back where it came from (`put_back`),
    or, with `adopt` (a torchrun restart of an --overwrite run: its own earlier attempt set it aside), stays as this
    run's set-aside copy; one with checkpoints beside it is named with the command that puts it back.
    Returns (the adopted folder or None, one line per folder)."""
    adopted, lines = None, []
    for folder in reversed(set_aside_folders(save_dir)):
        if checkpoint_files(save_dir) or adopted:
            lines.append(
                f"--save-dir {save_dir} still holds {folder}, checkpoints an --overwrite run set aside before "
                f"newer ones were written (left as they are); to go back to them: {put_back_command(folder)}"
            )
        elif adopt:
            adopted = folder
            lines.append(
                f"torchrun restart {restart_count()}: the previous run's files stay in {folder} until this "
                f"run's first checkpoint is written"
            )
        else:
            put_back(folder)
            lines.append(
                f"--save-dir {save_dir}: put the previous run's files back from {folder}, where an "
                f"--overwrite run that ended before its first checkpoint had left them"
            )
    return adopted, lines


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM are held until the block ends, then delivered (Python sets handlers in the main thread
    only; elsewhere the block runs unguarded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for number in caught:
            signal.raise_signal(number)


def resumed_settings(config: TrainConfig) -> TrainConfig:
    """`config` with the settings a resume takes from its checkpoint (run_settings.FROM_THE_CHECKPOINT: a LoRA
    run's adapters) where the command left them out. Read before the model is built, from the checkpoint the
    resume will find: --resume PATH's, else the save-dir's newest (--resume auto, a torchrun restart, a
    replica group's start). Reads no tensor."""
    if not run_settings.taken_from_the_checkpoint(config):
        return config
    source = _resume_source(config)
    saved = run_settings.saved_settings(settings_file(source)) if source else None
    return run_settings.with_saved_adapters(config, saved)


def _resume_source(config: TrainConfig) -> str | None:
    """The checkpoint a resume of `config` reads first, or None where it starts afresh."""
    resume = config.resume or ("auto" if config.fault_tolerance or restart_count() > 0 else None)
    if resume is None:
        return None
    if resume != "auto":
        if os.path.isdir(resume) and not os.path.exists(os.path.join(resume, SHARDED_STATE_FILE)):
            return next(iter(resumable_files(resume)), None)
        return resume
    folder = config.save_dir
    if folder is None:
        try:
            continued = run_to_continue(DEFAULT_SAVE_ROOT, config)
        except UsageError:  # none matches: the run folder's own choice says so in its line
            return None
        folder = continued[0] if continued else None
    return next(iter(resumable_files(folder)), None) if folder else None
