"""Stopping cleanly on SIGTERM/SIGINT, and naming a rank that was lost.

A signal only sets a flag; the trainer checks it at its sync points, where
the ranks agree on it with one all-reduce, so every rank stops after the same
step and rank 0 can write a checkpoint that all of them reached.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from types import FrameType
from typing import Any, Callable

import torch.distributed as dist

from multigpu.errors import TrainingStopped
from multigpu.resilience import hang_report
from multigpu.resilience.agent_death import stop_when_the_agent_dies
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.watchdog import published

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long a wait for other processes may go on after a stop request before the process ends (exits_while): a
# quorum or a commit of live groups takes milliseconds to a quorum tick; one the lost process never joins
# would take a timeout, while the Lighthouse keeps waiting for this group.
EXIT_GRACE_SECONDS = 1.0


class StopRequest:
    """Remembers that SIGTERM or SIGINT arrived; a second one exits at once.

    A SIGTERM within `repeat_window` seconds of the first is the same request
    delivered twice, not a second one: SLURM signals every process of a job step
    (torchrun and its workers), and torchrun forwards the signal to the workers
    as well (docs/launcher.md, "SLURM").

    Python runs a signal's handler only between two of its own instructions: while a step is inside one long
    call of C++ code (a large convolution, a collective), no handler runs, and two signals meanwhile become one
    call. So each signal is also written, as it arrives, into a pipe (Python's wakeup fd) that a thread of
    this object watches: the second one ends the process even then.
    """

    def __init__(self, repeat_window: float = 2.0) -> None:
        self.signal_name: str | None = None
        self.repeat_window = repeat_window
        self._first_at = 0.0
        self._lock = threading.RLock()  # the handler and the watcher; a handler may interrupt itself
        self._pipe: _WakeupPipe | None = None  # while installed
        self._previous_fd = -1
        self._waiting_for: str | None = None  # inside `exits_while`: what this process waits for
        self._exit_timer: threading.Timer | None = None  # ends the process if that wait outlasts its grace
        self._before_exit: list[Callable[[], str | None]] = []  # `before_exiting_at_once`'s
        self.quiet = False  # set by `exit_at_once` without a line: this process ends without a word

    def install(self) -> None:
        """Make SIGTERM and SIGINT set the flag, and start watching for a second one (main thread only, as
        Python requires)."""
        self._pipe = _WakeupPipe()
        self._previous_fd = signal.set_wakeup_fd(self._pipe.write, warn_on_full_buffer=False)
        _WATCHING.add(self)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        threading.Thread(
            target=self._watch, args=(self._pipe,), name="multigpu-stop-request", daemon=True
        ).start()

    def before_exiting_at_once(self, undo: Callable[[], str | None]) -> None:
        """`undo` runs, in the thread that ends the process, before a second signal (or a wait that outlasted
        its grace) ends it at once: what must not be left half-done (--overwrite's files moved aside, put back).
        It returns its line or None, and prints nothing itself: the main thread may be inside a print."""
        self._before_exit.append(undo)

    def exit_at_once(self, line: str | None, status: int, after: float = 0.0) -> None:
        """End the process with `status` from any thread, when what the run waits for is gone for good (torchft's
        Lighthouse): `line` said first; None ends it without a word, `after` seconds later (a rank other than 0,
        whose rank 0 says it: torchrun's SIGTERM meanwhile, when rank 0 has ended, ends it quietly too)."""
        if line is None:
            self.quiet = True
            time.sleep(after)  # in the calling thread (a watcher's), while rank 0 says it
        self._exit_at_once(line or "", status)

    def _exit_at_once(self, line: str, status: int) -> None:
        """Say `line`, run the `before_exiting_at_once` callbacks (each said in its line), end the process."""
        if not self.quiet:
            os.write(2, line.encode())
        for undo in self._before_exit:
            try:
                said = undo()
            except Exception as error:  # noqa: BLE001 -- the process ends either way: said, not raised
                said = f"could not undo before exiting ({error})"
            if said:
                os.write(2, f"{said}\n".encode())
        os._exit(status)

    def uninstall(self) -> None:
        """Stop watching (call it after the handlers are put back): the wakeup fd as it was, the watcher ended."""
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        _WATCHING.discard(self)
        with self._lock:
            os.close(self._pipe.write)  # the watcher reads the pipe's end and closes the reading end
            self._pipe = None

    @contextlib.contextmanager
    def exits_while(self, waiting_for: str) -> Iterator[None]:
        """Within this block, a wait on other processes (`waiting_for` says which), a stop request that is
        still waiting EXIT_GRACE_SECONDS later ends the process, saying so, instead of at the next step's end:
        under --fault-tolerance, torchrun's SIGTERM to a replica group whose process died finds the others
        waiting for a quorum or a commit that the dead one never joins (docs/fault-tolerance.md). A wait that
        ends in time (a stop request to every group alike) stops cleanly, as anywhere else."""
        self._waiting_for = waiting_for
        if self.signal_name is not None:  # arrived before the wait began: the wait has its grace too
            self._exit_if_still_waiting()
        try:
            yield
        finally:
            self._waiting_for = None
            if self._exit_timer is not None:
                self._exit_timer.cancel()
            self._exit_timer = None

    def _exit_if_still_waiting(self) -> None:
        """Start the timer that ends the process unless the current wait ends within its grace."""
        arrived = (self._waiting_for, self.signal_name)  # what the timer's line says, should it fire
        self._exit_timer = threading.Timer(EXIT_GRACE_SECONDS, self._exit_now, args=arrived)
        self._exit_timer.daemon = True
        self._exit_timer.start()

    def _exit_now(self, waiting_for: str, signal_name: str) -> None:
        if self._waiting_for != waiting_for:  # the wait ended meanwhile
            return
        line = (
            f"{signal_name} while {waiting_for} (still after {EXIT_GRACE_SECONDS:g} s): exiting now "
            f"without a checkpoint\n"
        )
        self._exit_at_once(line, 128 + signal.Signals[signal_name])

    def _disown(self) -> None:
        """In a forked child: the pipe is the parent's, and no watcher runs here."""
        self._lock = threading.RLock()  # the parent's watcher may have held it at the fork
        if self._pipe is None:
            return
        current = signal.set_wakeup_fd(-1)  # allowed: a fork's one thread is its main thread
        if current != self._pipe.write:
            signal.set_wakeup_fd(current)
        os.close(self._pipe.read)
        os.close(self._pipe.write)
        self._pipe = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Python's handler, in the main thread: the signal's byte is in the pipe, taken here or by the watcher.
        pipe = self._pipe
        if pipe is not None:
            self._take_signals(pipe)

    def _watch(self, pipe: _WakeupPipe) -> None:
        while self._take_signals(pipe):
            select.select([pipe.read], [], [])
        os.close(pipe.read)  # here only, once the pipe's end was seen: nobody reads it any more

    def _take_signals(self, pipe: _WakeupPipe) -> bool:
        """Act on every signal waiting in `pipe`, once each; False once its writing end is closed."""
        with self._lock:
            while not pipe.ended:
                try:
                    arrived = os.read(pipe.read, 64)
                except BlockingIOError:
                    return True
                pipe.ended = not arrived
                for signum in arrived:
                    if (
                        signum in STOP_SIGNALS
                    ):  # every signal with a Python handler comes here (a loader's SIGCHLD)
                        self._arrived(signum)
            return False

    def _arrived(self, signum: int) -> None:
        now = time.monotonic()
        if self.signal_name is not None:
            if (
                signum == signal.SIGTERM
                and self.signal_name == "SIGTERM"
                and now - self._first_at < self.repeat_window
            ):
                return
            line = f"second {signal.Signals(signum).name}: exiting now without a checkpoint\n"
            self._exit_at_once(line, 128 + signum)  # os.write, not print: the main thread may be in a print
        self.signal_name = signal.Signals(signum).name
        self._first_at = now
        if self._waiting_for is not None and self._exit_timer is None:
            self._exit_if_still_waiting()

    @property
    def requested(self) -> bool:
        """True once SIGTERM or SIGINT reached this process."""
        return self.signal_name is not None


class _WakeupPipe:
    """One install's pipe: Python writes the number of each signal into it as the signal arrives (its wakeup fd)."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)
        os.set_blocking(self.write, False)
        self.ended = False  # its writing end was closed, and the end seen: its reading end is closed next


_WATCHING: weakref.WeakSet[StopRequest] = weakref.WeakSet()  # the StopRequests installed in this process


def _not_in_a_child() -> None:
    """A forked child (a loader worker) inherits the installed StopRequests' pipes and handlers: it must neither
    write its own signals into its parent's pipe (a Ctrl-C, which the terminal sends to the loader workers too,
    would count twice there and end the run without a checkpoint) nor read the parent's signals from it."""
    for stop in list(_WATCHING):
        stop._disown()


os.register_at_fork(after_in_child=_not_in_a_child)


def restart_count() -> int:
    """How often torchrun restarted the worker group (0 on the first attempt and without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restarts_left() -> int:
    """How many more times torchrun would restart the worker group if this attempt failed (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_count()


def agent_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's own store, joined as a client: torchrun lends it to the workers (TORCHELASTIC_USE_AGENT_STORE)
    and it lives as long as torchrun does, so it outlives every worker and every attempt. None without it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )


def restart_safe_store(timeout: timedelta) -> dict[str, Any]:
    """init_process_group arguments that keep a torchrun restart away from the previous attempt's keys.

    torchrun lends its own store to the workers (`agent_store`) and
    keeps it across restarts, while every attempt's process group writes the same
    keys: a restarted rank can read a dead peer's address and hang in
    init_process_group (with gloo here, about one restart in two; for NCCL see
    pytorch/pytorch#135712). A prefix per attempt keeps the attempts apart. Empty
    (torch's own env:// set-up) when torchrun does not lend its store.
    """
    store = agent_store(timeout)
    if store is None:
        return {}
    return {
        "store": dist.PrefixStore(f"multigpu/attempt-{restart_count()}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


# ---------------------------------------------------------------- a lost rank
class PeerLost(TrainingStopped):
    """Another rank died or hung: a collective failed. Exit 1; the line was printed by every survivor.
    `lost`: the ranks that did not answer the roll call (empty when that could not be told)."""

    def __init__(self, line: str, lost: list[int] | None = None) -> None:
        super().__init__(line)
        self.lost = lost or []


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank is gone or stuck."""
    if not isinstance(error, RuntimeError):  # DistError is one too
        return False
    marks = ("gloo", "NCCL", "Connection closed")  # gloo's errors are plain RuntimeErrors naming it
    return isinstance(error, dist.DistError) or any(mark in str(error) for mark in marks)


def lost_ranks(rank: int, world_size: int, wait_seconds: float) -> list[int] | None:
    """The ranks that are gone after a failed collective: [] when every rank reported in (the collective failed
    for another reason), None if that cannot be told.

    A failed collective names no rank (gloo says "Connection closed by peer
    [address]"), so every survivor writes its rank into the rendezvous store and
    looks for the others. A rank missing from that roll call may be alive all the
    same, still waiting in a collective with survivors that have left it (under
    hybrid sharding, a rank that shared no group with the dead one): where its hang
    watchdog's thread still beats in the store, it is alive and not named. It waits
    until one rank is left that is neither in nor beating, or `wait_seconds`. The
    store is torchrun's agent's, so it outlives the workers; without torchrun it
    lives in rank 0, and losing it means rank 0 is gone. Without the watchdog
    (--hang-timeout 0) a rank that is slow to report in cannot be told from a dead one.
    """
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = "multigpu/lost/"  # the store is this attempt's own (restart_safe_store)
        store.set(prefix + str(rank), "1")
        first_beats = _beats(store, world_size)
        deadline = time.monotonic() + wait_seconds
        while True:
            missing = [r for r in range(world_size) if not store.check([prefix + str(r)])]
            beats = _beats(store, world_size)
            gone = [r for r in missing if r not in beats or beats[r] == first_beats.get(r)]
            if not missing or len(gone) == 1 or time.monotonic() >= deadline:
                return (
                    gone if gone or not missing else None
                )  # none gone: the silent ones are alive, cause unknown
            time.sleep(0.1)  # polling the store: a few cheap requests per second while waiting
    except Exception:  # the store is gone too: it lived in rank 0
        return [0] if rank != 0 else None


def _beats(store: Any, world_size: int) -> dict[int, int]:
    """Each rank's hang-watchdog beat count in the store, where it has a watchdog (multigpu/resilience/watchdog.py)."""
    return {r: beat["beat"] for r, beat in published(store, world_size).items()}


def lost_contact_line(rank: int, missing: list[int] | None, error: BaseException) -> str:
    """One line for a survivor: which rank was lost, torch's own words for how, and the collective this rank
    was in when it noticed (a collective that is not the trainer's points at a desync)."""
    who = (
        f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing else "another rank"
    )
    return (
        f"rank {rank}: lost contact with {who}, which died or hung ({error_detail(error)}) while this rank was "
        f"in {hang_report.failed_collective(error, 'the other ranks' if not missing else who)}; stopping"
    )


def error_detail(error: BaseException) -> str:
    """The telling part of a collective's error: gloo prefixes its source file and appends advice."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return detail.split("] ", 1)[-1].split(". ")[0][:200]


@contextlib.contextmanager
def stops_handled(
    stop: StopRequest,
    rank: int,
    world_size: int,
    wait_seconds: float,
    on_peer_lost: Callable[[], None] = lambda: None,
    before_roll_call: Callable[[], None] = lambda: None,
) -> Iterator[None]:
    """SIGTERM/SIGINT set `stop` (checked at the trainer's sync points), and a collective that fails
    because another rank died or hung becomes one line on every survivor (PeerLost, exit 1).

    `on_peer_lost` runs after that line and before the handlers are put back: torchrun SIGTERMs the
    survivors as soon as it sees a worker die, and what runs here (rank 0's save of the last completed
    step) must not be cut off by it. `before_roll_call` runs first, before the roll call's seconds: what
    others must not wait for (a replica group leaving the quorum, docs/fault-tolerance.md)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        stop.install()
        stop_when_the_agent_dies()  # torchrun's agent killed: its workers stop as on its SIGTERM
    try:
        yield
    except RuntimeError as error:
        if world_size == 1 or not is_peer_failure(error):
            raise
        BEAT.wait_if_hang_declared()  # the hang watchdog is ending the run: its report says it
        before_roll_call()
        missing = lost_ranks(rank, world_size, wait_seconds)
        if missing == []:  # every rank answered the roll call: the collective failed for another reason
            raise
        line = lost_contact_line(rank, missing, error)
        # Said here, while a signal only sets a flag: torchrun's SIGTERM to survivors cannot cut it off.
        print(line, file=sys.stderr, flush=True)
        on_peer_lost()
        raise PeerLost(line, missing) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop.uninstall()
