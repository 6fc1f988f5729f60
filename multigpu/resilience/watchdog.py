"""The hang watchdog (--hang-timeout): a thread on every rank that publishes this rank's heartbeat to the
rendezvous store, and on the deciding rank notices that no rank advanced for the timeout.

Each second or so every rank's thread writes its heartbeat (multigpu/resilience/heartbeat.py)
to the store. The decider (rank 0, or the lowest rank whose thread still beats when
rank 0's does not) tracks when each rank last moved: its step, phase, collective or
main thread's line changed. Slow is not stuck: any rank advancing resets the clock.
When none moved for the timeout, the decider asks every rank for its main thread's
stack (through the store: each rank's own thread answers, however stuck its main
thread is), saves a checkpoint of the last completed step when it is rank 0 and its
replica is whole (multigpu/resilience/hang_report.py), writes <save-dir>/hang_report.txt,
prints its summary and posts the verdict; every rank that can still read the store
then exits with HANG_EXIT_STATUS, and ranks that do not answer on the decider's
host are killed, so the run ends within the timeout plus a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from multigpu.errors import HANG_EXIT_STATUS, TrainingStopped
from multigpu.resilience import hang_report
from multigpu.resilience.heartbeat import BEAT, main_thread_stack

LOOK_EVERY_AT_MOST = 5.0  # seconds between two looks of the watchdog at most (a few per --hang-timeout below)
PREFIX = "multigpu/hang/"  # in the attempt's own store (multigpu/resilience/preemption.py restart_safe_store)

# A DataLoader worker is a fork of its rank (Linux's default): forked while this thread is inside torch or the
# store, the child would inherit the locks that call holds, and could wait on one forever. A fork waits for
# the current look to end, and the next look waits for the fork.
_LOOKING = threading.Lock()
os.register_at_fork(
    before=_LOOKING.acquire, after_in_parent=_LOOKING.release, after_in_child=_LOOKING.release
)


def published(store: Any, world_size: int) -> dict[int, dict[str, Any]]:
    """Each rank's heartbeat as its watchdog thread last published it to `store` (ranks without one left out).
    Its "beat" counts the thread's looks: one that moves is a live process, whatever its main thread does."""
    keys = [f"{PREFIX}hb/{r}" for r in range(world_size)]
    present = [key for key in keys if store.check([key])]
    return {
        int(key.rsplit("/", 1)[1]): json.loads(raw)
        for key, raw in zip(present, store.multi_get(present) if present else [])
    }


def group_sequence_number() -> int | None:
    """How many collectives the default process group has issued (DDP's and the user's included), or None."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]  # private, not in stubs
    except Exception:  # no group, or a backend that does not count
        return None


class Watchdog:
    """Publishes this rank's heartbeat and, on the deciding rank, turns a hang into a report and an exit.

    `save_last_step` (rank 0) writes a checkpoint of the last completed step without a collective and returns
    its path, or says why it cannot; `save_dir` receives hang_report.txt.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        save_dir: str,
        backend: str | None,
        save_last_step: Callable[[dict[str, Any]], str],
        store: Any | None = None,
        mesh: tuple[int, int] | None = None,
    ):
        self.rank, self.world_size, self.timeout, self.save_dir = rank, world_size, timeout, save_dir
        self.mesh = mesh  # fsdp's hybrid mesh (replicate, shard): the report names each rank's place in it
        self.backend, self.save_last_step = backend, save_last_step
        self.store = (
            store
            if store is not None
            else (dist.distributed_c10d._get_default_store() if dist.is_initialized() else dist.HashStore())
        )
        # A few looks per timeout, not more often than every LOOK_EVERY_AT_MOST seconds: each look takes the GIL
        # from the training thread (on a busy machine, a wait for a time slice each time it takes it back).
        self.interval = min(LOOK_EVERY_AT_MOST, max(0.2, timeout / 5))
        self.beats = (
            0  # this thread's own counter: whether the thread is alive, whatever the main thread does
        )
        self.seen: dict[
            int, tuple[Any, float, Any, float]
        ] = {}  # rank: (position, moved at, beat, beat seen at)
        self.latest: dict[int, dict[str, Any]] = {}
        self.answered = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="multigpu-hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (the run finished or failed on its own)."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:  # a first heartbeat at once: a rank may hang within its first second
            try:
                with _LOOKING:
                    self._tick()
            except (
                Exception
            ) as error:  # the store is gone (the run is ending) or a report failed: say it once
                if not self._stopped.is_set():
                    print(
                        f"rank {self.rank}: hang watchdog stopped: {type(error).__name__}: {error}",
                        file=sys.stderr,
                        flush=True,
                    )
                return
            if self._stopped.wait(self.interval):
                return

    def _tick(self) -> None:
        self.beats += 1
        beat = {**BEAT.snapshot(group_sequence_number()), "beat": self.beats}
        if self.world_size > 1:  # alone, no other rank reads it or asks anything: no store round trips
            self._exchange(beat)
        now = time.monotonic()
        self._read_heartbeats(now, {self.rank: beat} if self.world_size == 1 else None)
        if self._decides(now) and self._no_rank_moved(now):
            self._decide(now)

    def _exchange(self, beat: dict[str, Any]) -> None:
        """Publish this rank's heartbeat to the other ranks, and answer what they ask: its stack for a hang
        report, a verdict to leave on, a mismatch --debug-collectives found."""
        self.store.set(f"{PREFIX}hb/{self.rank}", json.dumps(beat))
        if not self.answered and self.store.check([PREFIX + "stacks-wanted"]):
            self.store.set(f"{PREFIX}stack/{self.rank}", main_thread_stack())
            self.answered = True
        if self.store.check([PREFIX + "verdict"]):
            self._leave()
        if self.store.check([PREFIX + "mismatch"]) and not self.store.get(PREFIX + "mismatch").startswith(
            f"{self.rank}:".encode()
        ):  # --debug-collectives found one: the rank that found it says it
            BEAT.hang_declared = True
            self.store.set(f"{PREFIX}mismatch-seen/{self.rank}", "1")
            os._exit(TrainingStopped.exit_code)

    def _read_heartbeats(self, now: float, beats: dict[int, dict[str, Any]] | None = None) -> None:
        """Every rank's latest heartbeat (`beats`, else as published to the store), and since when it has not
        moved."""
        for rank in range(self.world_size):  # not published yet: its clock runs from the first look
            self.seen.setdefault(rank, (None, now, None, now))
        for rank, beat in (beats if beats is not None else published(self.store, self.world_size)).items():
            position = (
                beat["step"],
                beat["phase"],
                beat["seq"],
                beat["in_collective"],
                beat["group_seq"],
                beat["where"],
                beat["frame"],
            )
            old = self.seen.get(rank)
            moved_at = now if old is None or old[0] != position else old[1]
            beat_at = now if old is None or old[2] != beat["beat"] else old[3]
            self.seen[rank], self.latest[rank] = (position, moved_at, beat["beat"], beat_at), beat

    def responding(self, rank: int, now: float) -> bool:
        """Whether `rank`'s watchdog thread published lately (its main thread may still be stuck)."""
        seen = self.seen.get(rank)
        return seen is not None and now - seen[3] <= max(2.5, 3 * self.interval)  # a few missed beats

    def _decides(self, now: float) -> bool:
        """Rank 0 decides; when its thread no longer beats, the lowest rank whose thread does."""
        return next((r for r in range(self.world_size) if self.responding(r, now)), None) == self.rank

    def _no_rank_moved(self, now: float) -> bool:
        return now - max(seen[1] for seen in self.seen.values()) >= self.timeout

    # ------------------------------------------------------------------ the verdict
    def _decide(self, now: float) -> None:
        BEAT.hang_declared = True
        silent = [r for r in range(self.world_size) if not self.responding(r, now)]
        stacks = self._collect_stacks(silent)
        verdict = hang_report.diagnose(self.latest, silent, self.timeout, self.world_size, self.mesh)
        saved = self.save_last_step(verdict) if self.rank == 0 else hang_report.NO_SAVE_OFF_RANK_0
        path = os.path.join(self.save_dir, hang_report.FILE_NAME)
        lines = hang_report.summary(verdict, saved, path, HANG_EXIT_STATUS)
        hang_report.write(path, lines, self.latest, stacks, self.backend, self.save_dir, self.world_size)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        self.store.set(PREFIX + "verdict", lines[0])
        self._wait_for_others_to_leave(silent)
        self._kill_local(silent)
        self._exit()

    def _collect_stacks(self, silent: list[int]) -> dict[int, str]:
        """Every responding rank's main-thread stack, each written by that rank's own watchdog thread."""
        self.store.set(PREFIX + "stacks-wanted", "1")
        self.store.set(f"{PREFIX}stack/{self.rank}", main_thread_stack())
        self.answered = True
        wanted = [r for r in range(self.world_size) if r not in silent]
        deadline = time.monotonic() + 3 * self.interval + 2
        while time.monotonic() < deadline and not all(
            self.store.check([f"{PREFIX}stack/{r}"]) for r in wanted
        ):
            time.sleep(0.1)  # polling the store: a few cheap requests while the ranks answer
        return {
            r: self.store.get(f"{PREFIX}stack/{r}").decode()
            for r in wanted
            if self.store.check([f"{PREFIX}stack/{r}"])
        }

    def _wait_for_others_to_leave(self, silent: list[int]) -> None:
        """Give every responding rank a moment to read the verdict and exit: the store may live in this process."""
        others = [r for r in range(self.world_size) if r != self.rank and r not in silent]
        deadline = time.monotonic() + 3 * self.interval + 2
        while time.monotonic() < deadline and not all(
            self.store.check([f"{PREFIX}left/{r}"]) for r in others
        ):
            time.sleep(0.1)

    def _kill_local(self, silent: list[int]) -> None:
        """SIGKILL the ranks that do not answer (stopped or frozen) and are this process's siblings (started by
        the same torchrun on this host): torchrun would wait 30 s for a stopped process to take its SIGTERM."""
        host = socket.gethostname()
        for rank in silent:
            beat = self.latest.get(rank)
            if beat and beat["host"] == host and _parent_of(beat["pid"]) == os.getppid():
                try:
                    os.kill(beat["pid"], signal.SIGKILL)
                except OSError:  # already gone
                    pass

    def _leave(self) -> None:
        """Another rank's watchdog decided: answer the stack request if not yet, and exit."""
        BEAT.hang_declared = True
        if not self.answered:
            self.store.set(f"{PREFIX}stack/{self.rank}", main_thread_stack())
        print(
            f"rank {self.rank}: stopped by the hang watchdog "
            f"(see {os.path.join(self.save_dir, hang_report.FILE_NAME)})",
            file=sys.stderr,
            flush=True,
        )
        self.store.set(f"{PREFIX}left/{self.rank}", "1")
        self._exit()

    def _exit(self) -> None:
        hang_report.dump_nccl_trace(self.backend, self.save_dir, self.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_STATUS)  # the main thread is stuck in C++ or a lock: no exception can reach it


def _parent_of(pid: int) -> int | None:
    """The parent process id of `pid` (Linux's /proc), or None when it cannot be read: then it is not killed."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])  # after "pid (name)": state, then ppid
    except (OSError, ValueError, IndexError):
        return None
