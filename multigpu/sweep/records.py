"""The sweep directory's own files: results, progress, the fingerprint, and the locks that keep writers apart.

    DIR/sweep.json                  the fingerprint (base config, grid), written once by the first process
    DIR/results.jsonl               one line per finished experiment, appended (results.shard-I-of-N.jsonl per shard)
    DIR/progress.json               what runs now and how far the sweep is, rewritten atomically
    DIR/<grid point>/seed-<k>/      each run's own save dir (checkpoints, TensorBoard, train.log)

Each shard appends only to its own results file, so shards on several machines never write one file
(appends to one file from several NFS clients can interleave); readers merge them all.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
from collections.abc import Iterator
from typing import Any

from multigpu import safe_files
from multigpu.errors import UsageError
from multigpu.sweep.plan import SWEEP_FILE, fingerprint_difference


def _suffix(shard: tuple[int, int]) -> str:
    index, count = shard
    return "" if count == 1 else f".shard-{index}-of-{count}"


def results_path(sweep_dir: str, shard: tuple[int, int]) -> str:
    return os.path.join(sweep_dir, f"results{_suffix(shard)}.jsonl")


def progress_path(sweep_dir: str, shard: tuple[int, int]) -> str:
    return os.path.join(sweep_dir, f"progress{_suffix(shard)}.json")


def append_result(path: str, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write to an O_APPEND file, then fsync.

    A process killed at any instant leaves whole lines only (a torn last line at worst, after a power
    cut, which `read_results` skips).
    """
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    handle = safe_files.open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(handle, line)
        os.fsync(handle)
    finally:
        os.close(handle)


def read_results(sweep_dir: str) -> dict[str, dict[str, Any]]:
    """The latest record of every experiment, merged over every shard's results file."""
    latest: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(sweep_dir, "results*.jsonl"))):
        with open(path, encoding="utf-8") as file:
            for line in file:
                try:
                    record = json.loads(line)
                    name, finished = record["experiment"], float(record["finished"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line
                if name not in latest or finished >= float(latest[name]["finished"]):
                    latest[name] = record
    return latest


def write_json_atomic(path: str, data: Any) -> None:
    """Write `data` as JSON to `path` atomically (see write_text_atomic)."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old file or the new one."""
    safe_files.write_atomically(path, text, 0o644)


def check_fingerprint(sweep_dir: str, fingerprint: dict[str, Any]) -> bool:
    """Record the sweep's fingerprint, or check it against the recorded one; True if this started the sweep.

    The file is created with a hard link, which fails if it exists, so of several shards starting at
    once exactly one writes it and the others compare with it.
    """
    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, SWEEP_FILE)
    current = json.loads(json.dumps(fingerprint))  # compared as it will read back
    if safe_files.create_once(path, json.dumps(current, indent=1, sort_keys=True), 0o644):
        return True
    with open(path, encoding="utf-8") as file:
        saved = json.load(file)
    difference = fingerprint_difference(saved, current)
    if difference is not None:
        raise UsageError(
            f"--sweep-dir {sweep_dir} holds a sweep with other settings: {difference}; rerun "
            f"with the sweep's settings to continue it, or choose another --sweep-dir"
        )
    return False


@contextlib.contextmanager
def exclusive(sweep_dir: str, shard: tuple[int, int]) -> Iterator[None]:
    """Hold the lock of this shard: a second process running the same shard is refused in one line.

    An flock dies with its process, so a killed sweep never leaves a stale lock behind.
    """
    path = os.path.join(sweep_dir, f".lock{_suffix(shard)}")
    handle = safe_files.open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(handle, 32, 0).decode(errors="replace").strip() or "another process"
            shard_text = f" (shard {shard[0]}/{shard[1]})" if shard[1] > 1 else ""
            raise UsageError(
                f"--sweep-dir {sweep_dir}{shard_text} is in use by pid {owner}; wait for it to end or stop it"
            ) from None
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(handle)


@contextlib.contextmanager
def summary_lock(sweep_dir: str) -> Iterator[None]:
    """Shards that finish together write the merged summary one after another, the last one seeing all results."""
    with shared_lock(sweep_dir, ".summary.lock"):
        yield


@contextlib.contextmanager
def shared_lock(sweep_dir: str, name: str) -> Iterator[None]:
    """Hold DIR/`name` (an flock: it dies with its process) while every shard's driver waits for it."""
    handle = safe_files.open_fd(os.path.join(sweep_dir, name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)
