"""One run owns a save-dir at a time: the lock, its owner record and heartbeat.

Ownership (`SaveDirLock`), held by rank 0 for the run's lifetime
----------------------------------------------------------------
The lock is the file `<save-dir>/.run.lock`, which holds a JSON owner record
(pid, host, start time, torchrun job id and restart count). Two mechanisms
decide whether an owner is still alive, because neither works everywhere:

- A POSIX record lock (`fcntl.lockf`) on that file. The kernel drops it when the
  owner dies in any way (SIGKILL, OOM killer), and on NFS the server drops it
  when the owner's client goes away. It belongs to the process, so DataLoader
  workers forked by rank 0 do not inherit it and cannot keep it alive.
- A heartbeat: the owner touches the file every `HEARTBEAT_SECONDS`. Some shared
  file systems keep locks local to each node (NFS mounted with local_lock, Lustre
  without -o flock) or do not support them at all; there a lost node's record
  counts as stale once its heartbeat is older than `STALE_SECONDS`. This
  compares the file's modification time with the local clock, so it assumes
  the nodes' clocks agree to well within that (NTP). Without any locks, two
  runs that start in the same instant could both take the save-dir.

A starting run takes the lock when nobody holds it, then reads the record:
empty or released -> ours; written by an earlier attempt of this torchrun job
(same TORCHELASTIC_RUN_ID, lower TORCHELASTIC_RESTART_COUNT) -> ours again
(the restarted rank 0 may even be on another node); written on this host ->
its owner died without releasing (the kernel dropped its lock): stale, taken
over with one line; written on another host -> stale only when its heartbeat
is old. Otherwise the run is refused with a `UsageError` naming the save-dir
and the owner, having changed nothing there. A lock held by an earlier attempt
of the same job (its process is still being stopped) is waited for, up to
`STALE_SECONDS`.

The lock file stays after a clean exit with its record marked released, so a
torchrun restart can still find its job's run folder (`choose_run_dir`).

Numbered run folders and --overwrite's set-aside copy: multigpu/checkpoints/run_folders.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from multigpu import safe_files
from multigpu.errors import UsageError

LOCK_NAME = ".run.lock"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # no locks on this file system


@dataclass
class Owner:
    """Who holds (or last held) a save-dir."""

    pid: int
    host: str
    started: str  # local time, for people
    job: str | None = None  # TORCHELASTIC_RUN_ID: the same for every attempt of one torchrun job
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT of the attempt that wrote the record
    released: bool = False

    @classmethod
    def this_process(cls) -> Owner:
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
            job=os.environ.get("TORCHELASTIC_RUN_ID"),
            restart=restart_count(),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"

    def is_earlier_attempt_of_this_job(self) -> bool:
        me = Owner.this_process()
        return me.job is not None and self.job == me.job and self.restart < me.restart


class SaveDirLock:
    """Exclusive ownership of a save-dir by one run (rank 0), from `acquire` to `release` or death.

        with SaveDirLock(config.save_dir).acquire(report.line):
            ...  # clean up unfinished saves, resume, train

    `release` is idempotent and runs when the `with` block ends, by an
    exception too; a lock never acquired (as on ranks other than 0) releases
    nothing. A second `acquire` of a held save-dir in the same process is refused too.
    """

    _held_here: dict[str, SaveDirLock] = {}  # POSIX locks do not exclude the process that holds them

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_NAME)
        self._fd: int | None = None
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, report: Callable[[str], None] = print) -> SaveDirLock:
        """Own the save-dir, or raise UsageError (one line naming it and its owner) having changed nothing.

        `report` gets one line when a stale lock (dead owner) or an earlier
        attempt's lock of this torchrun job is taken over.
        """
        key = os.path.realpath(self.path)
        if key in self._held_here:
            raise UsageError(
                f"--save-dir {self.save_dir} is already used by this process "
                f"({self._held_here[key].save_dir}); give each trainer its own --save-dir"
            )
        try:
            os.makedirs(self.save_dir, exist_ok=True)
            fd = safe_files.open_fd(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # a planted link is refused
        except OSError as error:
            raise UsageError(
                f"--save-dir {self.save_dir} is not writable ({error.strerror}); choose another directory"
            ) from None
        try:
            line = self._take(fd)
        except BaseException:
            os.close(fd)  # only our descriptor: the owner's lock and record are untouched
            raise
        self._fd = fd
        self._held_here[key] = self
        self._write_record(Owner.this_process())
        self._start_heartbeat()
        if line:
            report(line)
        return self

    def _take(self, fd: int) -> str | None:
        """Lock `fd` and judge the previous record; the take-over line, or None. Raises UsageError if owned."""
        locked = _try_lock(fd)
        if locked is False:
            previous = _read_record(fd)
            if previous is None or previous.released:  # the holder has not written its record yet
                raise self._refusal(None, "")
            if not previous.is_earlier_attempt_of_this_job():
                raise self._refusal(previous, "it is running")
            locked = _wait_for_lock(fd, STALE_SECONDS)  # the earlier attempt's process is being stopped
            if locked is False:
                raise self._refusal(previous, f"it still holds the lock after {STALE_SECONDS:.0f} s")
        previous = _read_record(fd)
        if previous is None or previous.released:
            return None
        if previous.is_earlier_attempt_of_this_job():
            return (
                f"torchrun restart {Owner.this_process().restart}: continuing in --save-dir {self.save_dir} "
                f"(taken over from this job's attempt {previous.restart}, {previous.describe()})"
            )
        same_host = previous.host == socket.gethostname()
        age = time.time() - os.fstat(fd).st_mtime
        if not (locked and same_host) and age < STALE_SECONDS:
            # Another node's run (locks may be node-local), or no locks at all: the heartbeat decides.
            raise self._refusal(
                previous,
                f"its heartbeat is {age:.0f} s old; a run counts as gone "
                f"{STALE_SECONDS:.0f} s after its last one",
            )
        return (
            f"--save-dir {self.save_dir}: taking over from a run that ended without releasing it "
            f"({previous.describe()})"
        )

    def _refusal(self, owner: Owner | None, why: str) -> UsageError:
        """The one line of a refused run: the save-dir, and the owner (None: it is just starting)."""
        who = f" ({owner.describe()}; {why})" if owner else " that is just starting"
        return UsageError(
            f"--save-dir {self.save_dir} is in use by another run{who}: wait for it to finish, "
            f"or choose another --save-dir"
        )

    def _write_record(self, owner: Owner) -> None:
        assert self._fd is not None
        data = json.dumps(asdict(owner)).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _start_heartbeat(self) -> None:
        self._stop_heartbeat.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="save-dir heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        fd = self._fd
        assert fd is not None  # the heartbeat starts once the lock file is open
        while not self._stop_heartbeat.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(fd)  # through the descriptor: opening and closing the file would drop our lock
            except OSError:
                pass  # a short outage of the file system; the next beat tries again

    def release(self) -> None:
        """Give the save-dir up (record marked released, lock dropped). Safe to call more than once."""
        if self._fd is None:
            return
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            self._write_record(
                Owner(**{**asdict(_read_record(self._fd) or Owner.this_process()), "released": True})
            )
        except OSError:
            pass  # the lock itself goes with the descriptor; a record left unreleased is judged stale later
        finally:
            os.close(self._fd)  # drops the POSIX lock
            self._fd = None
            self._held_here.pop(os.path.realpath(self.path), None)

    def __enter__(self) -> SaveDirLock:
        return (
            self  # acquire() is explicit (only rank 0 calls it); the block's end releases what was acquired
        )

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _try_lock(fd: int) -> bool | None:
    """True when locked, False when another process holds the lock, None when the file system has no locks."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if error.errno in _UNSUPPORTED:
            return None
        raise


def _wait_for_lock(fd: int, seconds: float) -> bool | None:
    deadline = time.monotonic() + seconds
    while True:
        locked = _try_lock(fd)
        if locked is not False or time.monotonic() >= deadline:
            return locked
        time.sleep(0.2)  # polling a lock held by a process that is exiting


def _read_record(fd: int) -> Owner | None:
    """The owner record in the lock file, or None when empty or unreadable (a run that is just starting)."""
    try:
        data = os.pread(fd, 4096, 0)
        return Owner(**json.loads(data)) if data else None
    except (OSError, ValueError, TypeError):
        return None


def read_owner(save_dir: str) -> Owner | None:
    """The owner record of `save_dir` (None if it never had one). Not for the holder itself:
    opening and closing the lock file in the holding process would drop its POSIX lock."""
    try:
        fd = os.open(os.path.join(save_dir, LOCK_NAME), os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read_record(fd)
    finally:
        os.close(fd)
