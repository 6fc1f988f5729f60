"""The search's journal (DIR/study.journal) checked before a driver writes to it, and a cut-short last record set
aside. Imported where a search runs (it needs Optuna).

Optuna appends each record as one line of JSON, and its reader skips a last line that has no end (a driver killed
while writing one), but a writer then appends its next record onto that partial line, and the journal is unreadable
from there on, by Optuna too. So before a driver opens the study, under the journal's own lock:

- a last record cut short (no line end) is set aside: the journal as it was is copied to
  study.journal.partial-<time>, the partial line cut off, and that said in one line;
- any other damage (a line that is not JSON, bytes overwritten mid-file, a record Optuna cannot replay) is one line,
  exit status 2, with the journal unchanged: a search cannot tell what it lost;
- a journal that does not know trials whose runs are in DIR (trial folders, results) is refused too: an emptied or
  replaced journal would draw those trials afresh and run them again over their folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

from optuna.storages.journal import BaseJournalBackend

from multigpu import safe_files
from multigpu.errors import UsageError
from multigpu.sweep.records import read_results
from multigpu.sweep.search import ASK_LOCK
from multigpu.sweep.study import STUDY_FILE, STUDY_NAME

LOCK_SUFFIX = ".lock"  # Optuna's link lock of a file F is the symbolic link F.lock

BACKUP_INFIX = ".partial-"  # DIR/study.journal.partial-<time>: the journal as it was before its repair
_TRIAL_RUN = re.compile(r"trial-(\d+)(?:/|$)")


def check(sweep_dir: str, alone: bool) -> str | None:
    """Check DIR/study.journal against damage and against the runs in DIR; set a cut-short last record aside.
    `alone`: this is the sweep's only driver, so a lock of the journal's that is there was left by a killed one
    (removed, not waited on for Optuna's 30 s). Returns the line that says what was set aside or removed (None:
    nothing was), or raises UsageError (nothing changed)."""
    path = os.path.join(sweep_dir, STUDY_FILE)
    if not os.path.exists(path):
        _refuse_unknown_runs(sweep_dir, path, set())
        return None
    # The lock Optuna's writers hold, so that no driver appends meanwhile; alone, nobody else writes.
    with contextlib.nullcontext() if alone else _journal_lock(path):
        safe_files.refuse_link(path)
        with open(path, "rb") as file:
            data = file.read()
        whole = data[: data.rfind(b"\n") + 1]
        _refuse_unknown_runs(sweep_dir, path, _trial_numbers(path, whole))
        removed = _remove_left_locks(sweep_dir) if alone else []
        locks = f"; removed the lock(s) it left: {', '.join(removed)}" if removed else ""
        if len(whole) < len(data):
            return _set_aside(path, data, whole) + locks
    return f"warning: a driver of {sweep_dir} was killed while it held a lock{locks}" if removed else None


def _remove_left_locks(sweep_dir: str) -> list[str]:
    """Remove the links by which drivers lock the journal and the asking (Optuna's link locks) that a driver killed
    while holding them left; their names."""
    left = [
        name
        for name in (f"{STUDY_FILE}{LOCK_SUFFIX}", f"{ASK_LOCK}{LOCK_SUFFIX}")
        if os.path.islink(os.path.join(sweep_dir, name))
    ]
    for name in left:
        os.unlink(os.path.join(sweep_dir, name))
    return left


def _trial_numbers(path: str, whole: bytes) -> set[int]:
    """The numbers of the search's trials in the journal's whole lines, replayed as Optuna replays them."""
    from optuna.storages import JournalStorage

    records = []
    for number, line in enumerate(whole.splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            raise UsageError(_damaged(path, number, "is not a record Optuna writes (not JSON)")) from None
        if not isinstance(records[-1], dict):
            raise UsageError(_damaged(path, number, "is not a record Optuna writes"))
    backend = _Records(records)
    try:
        store = JournalStorage(backend)
        named = [study for study in store.get_all_studies() if study.study_name == STUDY_NAME]
        study_id = store.get_study_id_from_name(STUDY_NAME) if named else None
        trials = [] if study_id is None else store.get_all_trials(study_id, deepcopy=False)
    except Exception as error:  # Optuna's replay of a record it did not write: KeyError, AssertionError, ...
        why = f"is a record Optuna cannot replay ({type(error).__name__}: {str(error)[:80]})"
        raise UsageError(_damaged(path, backend.read, why)) from None
    return {trial.number for trial in trials}


def _damaged(path: str, line: int, why: str) -> str:
    return (
        f"{path}: line {line} {why}: the journal is damaged beyond its last record, and the search cannot tell "
        f"what it lost; nothing was changed. Put back a good copy of it, or start the search in another "
        f"--sweep-dir"
    )


def _refuse_unknown_runs(sweep_dir: str, path: str, known: set[int]) -> None:
    """UsageError if DIR holds runs (a trial-<n> folder, a result) of trials the journal does not know."""
    on_disk = {int(match.group(1)) for name in os.listdir(sweep_dir) if (match := _TRIAL_RUN.fullmatch(name))}
    recorded = {int(match.group(1)) for name in read_results(sweep_dir) if (match := _TRIAL_RUN.match(name))}
    unknown = sorted((on_disk | recorded) - known)
    if not unknown:
        return
    held = "no journal" if not os.path.exists(path) else f"a journal of {len(known)} trial(s)"
    listed = ", ".join(f"trial-{number}" for number in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
    raise UsageError(
        f"--sweep-dir {sweep_dir} holds runs of trials its {STUDY_FILE} does not know ({listed}; {held}): a "
        f"search over it would draw them afresh and run them again over their folders. Put the search's journal "
        f"back (a copy set aside is named {STUDY_FILE}{BACKUP_INFIX}<time>), or start the search in another "
        f"--sweep-dir; nothing was changed"
    )


def _set_aside(path: str, data: bytes, whole: bytes) -> str:
    """Copy the journal as it is to a backup, then cut its partial last line off; the line that says so."""
    backup = f"{path}{BACKUP_INFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    safe_files.write_atomically(backup, data, 0o644)
    os.truncate(path, len(whole))
    records = whole.count(b"\n")
    return (
        f"warning: {path}: its last record was cut short ({len(data) - len(whole)} bytes without a line end, "
        f"as a driver killed while writing leaves it) and is set aside: the journal as it was is in {backup}, "
        f"the search continues from its {records} whole records"
    )


class _Records(BaseJournalBackend):
    """Optuna's journal backend over records read already (JournalStorage replays them): `read` counts those
    handed out, so that the record Optuna fails on is known by its line."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records
        self.read = 0

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        for record in self.records[log_number_from:]:
            self.read += 1
            yield record

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise AssertionError("the journal's check writes nothing")


@contextlib.contextmanager
def _journal_lock(path: str) -> Iterator[None]:
    """Optuna's lock of the journal's appends (multigpu/sweep/study.py storage), held meanwhile."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(path)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()
