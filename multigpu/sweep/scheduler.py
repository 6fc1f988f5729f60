"""Running the experiments: one worker process per device slot, a queue, dead workers replaced, retries.

The main process owns everything that is shared: it hands each idle worker the next experiment (so a
slow run never holds back the others), reads each outcome from that worker's own pipe, appends final
outcomes to the results file, rewrites progress.json, and draws the one progress bar. A pipe per worker,
not one queue for all: a worker killed while it held a shared queue's lock would block the others
forever. A worker that dies is noticed through its process sentinel at once; its experiment is retried
(up to --retries) or recorded as failed, and a new worker takes the slot.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from multigpu.errors import UsageError
from multigpu.sweep import records
from multigpu.sweep.options import DEFAULT_CPU_WORKERS, SweepOptions
from multigpu.sweep.plan import Experiment
from multigpu.sweep.summary import did_not_learn, monitored
from multigpu.sweep.worker import Task, outcome, worker_main

# Test-only: "EXPERIMENT@RANK:STEP[@sweep]" arms the trainer's fault injector (MULTIGPU_FAULT_INJECT) in the
# first attempt of EXPERIMENT; with @sweep the whole sweep is SIGKILLed when that worker dies, as on a lost node.
SWEEP_FAULT_ENV = "MULTIGPU_SWEEP_FAULT_INJECT"
STOP_WAIT = 60.0  # seconds the workers get to exit after the last experiment


@dataclass(frozen=True)
class Slot:
    """A place where one run trains at a time: K GPUs, or CPU threads."""

    index: int
    devices: str  # CUDA_VISIBLE_DEVICES of its worker ("" on the CPU)
    label: str


def find_slots(options: SweepOptions, visible_gpus: list[str]) -> tuple[list[Slot], str]:
    """The device slots of this machine and a line that describes them.

    `visible_gpus` are the ids CUDA_VISIBLE_DEVICES would name (indexes, or UUIDs if it holds those).
    """
    per_run = options.gpus_per_run
    if not visible_gpus:
        workers = options.workers or DEFAULT_CPU_WORKERS
        ignored = f"; no GPU found, so --max-gpus {options.max_gpus} is not used" if options.max_gpus else ""
        slots = [Slot(i, "", f"cpu{i}") for i in range(workers)]
        cores = os.cpu_count() or 1
        processes = workers * per_run * options.threads_per_run
        crowded = f" (more than the {cores} cores: runs will be slower)" if processes > cores else ""
        return slots, (
            f"{workers} CPU slot(s) x {per_run} process(es) x {options.threads_per_run} thread(s)"
            f"{crowded}{ignored}"
        )
    gpus = options.max_gpus or len(visible_gpus)
    if gpus > len(visible_gpus):
        raise UsageError(
            f"--max-gpus {gpus}: only {len(visible_gpus)} GPU(s) visible "
            f"({','.join(visible_gpus)}); check CUDA_VISIBLE_DEVICES"
        )
    if gpus < per_run:
        raise UsageError(f"--gpus-per-run {per_run} needs at least that many GPUs; --max-gpus is {gpus}")
    slots = []
    for index in range(gpus // per_run):
        devices = visible_gpus[index * per_run : (index + 1) * per_run]
        slots.append(Slot(index, ",".join(devices), f"gpu{','.join(devices)}"))
    idle = gpus % per_run
    spare = (
        f"; {idle} GPU(s) left idle ({gpus} is not a multiple of --gpus-per-run {per_run})" if idle else ""
    )
    return slots, f"{len(slots)} GPU slot(s) x {per_run} GPU(s){spare}"


@dataclass
class _Worker:
    slot: Slot
    process: Any
    conn: Connection
    task: Task | None = None
    started: float = 0.0


class Scheduler:
    """Runs `experiments` on `slots`, then those `more()` gives while it gives any (a search's next trial, asked
    when a slot is free); `recorded(record)` hears each final outcome and may answer a line to print."""

    def __init__(
        self,
        slots: list[Slot],
        experiments: list[Experiment],
        options: SweepOptions,
        results_path: str,
        progress: Callable[[dict[str, Any]], None],
        show_bar: bool,
        more: Callable[[], list[Experiment]] = list,
        recorded: Callable[[dict[str, Any]], str | None] = lambda record: None,
        total: int | None = None,
    ):
        self.slots, self.options = slots, options
        self.results_path, self.write_progress = results_path, progress
        self.more, self.recorded = more, recorded
        fault = os.environ.get(SWEEP_FAULT_ENV, "")
        self.fault_target, _, rest = fault.partition("@")
        self.fault_spec, _, kill_sweep = rest.partition("@")
        self.fault_kills_sweep = kill_sweep == "sweep"
        self.queue = collections.deque(self._task(e, 1) for e in experiments)
        self.total = len(self.queue) if total is None else total
        self.workers: dict[int, _Worker] = {}
        self.context = multiprocessing.get_context("spawn")  # CUDA and fork do not mix
        self.finished: list[dict[str, Any]] = []
        self.signals: list[str] = []
        self.started = time.monotonic()
        self.progress_due = self.started
        self.bar = self._bar(show_bar)
        self._wake_read, self._wake_write = os.pipe()

    # ------------------------------------------------------------------ the loop
    def run(self) -> str | None:
        """Run until every experiment has a final outcome, or a signal stops the sweep (its name is returned)."""
        with self._signals_caught():
            try:
                while self._busy() or (self._refilled() and not self.signals):
                    if not self.signals:
                        self._hand_out()
                    self._wait()
                    self._write_progress(force=False)
            finally:
                self._shut_down()
                if self.bar is not None:
                    self.bar.close()
        self._write_progress(force=True)
        return self.signals[0] if self.signals else None

    def _task(self, experiment: Experiment, attempt: int) -> Task:
        fault = self.fault_spec if experiment.name == self.fault_target and attempt == 1 else None
        return Task(experiment, attempt, self.options.gpus_per_run, fault or None)

    def _refilled(self) -> bool:
        """Whether experiments are waiting: the queue's, else the next ones `more` gives (while no signal came)."""
        if not self.queue and not self.signals and len(self._busy()) < len(self.slots):
            self.queue.extend(self._task(e, 1) for e in self.more())
        return bool(self.queue)

    def _busy(self) -> list[_Worker]:
        return [worker for worker in self.workers.values() if worker.task is not None]

    def _hand_out(self) -> None:
        """Give every idle slot the next experiment, starting a worker where the slot has none."""
        handed = False
        for slot in self.slots:
            worker = self.workers.get(slot.index)
            if not self._refilled() or (worker is not None and worker.task is not None):
                continue
            if worker is None or not worker.process.is_alive():
                worker = self.workers[slot.index] = self._start(slot)
            worker.task, worker.started = self.queue.popleft(), time.monotonic()
            with contextlib.suppress(OSError):  # it died just now: its sentinel reports it, with this task
                worker.conn.send(worker.task)
            handed = True
        if handed:
            self._write_progress(force=True)

    def _start(self, slot: Slot) -> _Worker:
        ours, theirs = self.context.Pipe()
        threads = str(self.options.threads_per_run)
        # Set before the process starts: CUDA reads CUDA_VISIBLE_DEVICES once, OpenMP its thread count once.
        with _environment(
            CUDA_VISIBLE_DEVICES=slot.devices, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads
        ):
            process = self.context.Process(
                target=worker_main,
                name=f"sweep-{slot.label}",
                args=(theirs, self.options.threads_per_run, os.getpid(), self.options.gpus_per_run == 1),
            )
            process.start()
        theirs.close()
        return _Worker(slot, process, ours)

    def _wait(self) -> None:
        timeout = max(0.0, self.progress_due - time.monotonic())
        handles: list[Any] = [self._wake_read]
        for worker in self.workers.values():
            handles += [worker.conn, worker.process.sentinel]
        ready = set(wait(handles, timeout))
        if self._wake_read in ready:
            os.read(self._wake_read, 64)
            self._on_signal()
        for slot_index, worker in list(self.workers.items()):
            if worker.conn in ready:
                self._receive(worker)
            if worker.process.sentinel in ready or (
                worker.task is not None and not worker.process.is_alive()
            ):
                self._on_exit(slot_index, worker)

    def _receive(self, worker: _Worker) -> None:
        try:
            result = worker.conn.recv()
        except (EOFError, OSError):
            return  # the worker died: its sentinel says so
        task, worker.task = worker.task, None
        if task is not None:
            self._settle(task, result, worker.slot)

    def _on_exit(self, slot_index: int, worker: _Worker) -> None:
        worker.process.join()
        if worker.task is not None and _readable(worker.conn):  # an outcome sent just before it ended
            self._receive(worker)
        task, worker.task = worker.task, None
        del self.workers[slot_index]
        worker.conn.close()
        if task is None:
            return
        code = worker.process.exitcode
        if self.fault_kills_sweep and task.fault:
            self._kill_everything()
        self._settle(
            task,
            outcome(
                task,
                "failed",
                code,
                f"worker died: {describe_exit(code)}",
                {},
                time.monotonic() - worker.started,
            ),
            worker.slot,
        )

    def _settle(self, task: Task, result: dict[str, Any], slot: Slot) -> None:
        """Record a final outcome, or put the experiment back in the queue for another attempt."""
        if result["status"] in ("ok", "pruned"):
            self._record(result, slot)
            return
        if self.signals:  # stopped by the sweep's signal: not finished, a rerun continues it
            return
        if result["exit_status"] != 2 and task.attempt <= self.options.retries:  # bad input would fail again
            self.queue.append(self._task(task.experiment, task.attempt + 1))
            self._line(
                f"retry   {task.experiment.name} (attempt {task.attempt + 1} of {self.options.retries + 1}) "
                f"after: {result['error']}"
            )
            return
        self._record({**result, "status": "failed"}, slot)

    def _record(self, result: dict[str, Any], slot: Slot) -> None:
        index, count = self.options.shard
        record = {**result, "finished": time.time(), "slot": slot.label, "shard": f"{index}/{count}"}
        records.append_result(self.results_path, record)
        self.finished.append(record)
        self._line(describe_result(record))
        said = self.recorded(record)
        if said:
            self._line(said)
        if self.bar is not None:
            self.bar.update(1)
        self._write_progress(force=True)

    # ------------------------------------------------------------------ progress
    def _write_progress(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now < self.progress_due:
            return
        self.progress_due = now + self.options.checkpoint_interval
        done = len(self.finished)
        elapsed = now - self.started
        left = self.total - done
        running = [
            {
                "experiment": task.experiment.name,
                "slot": w.slot.label,
                "pid": w.process.pid,
                "attempt": task.attempt,
                "seconds": round(now - w.started, 1),
            }
            for w in self._busy()
            if (task := w.task) is not None  # every busy worker has one
        ]
        self.write_progress(
            {
                "finished_now": done,
                "failed_now": sum(r["status"] == "failed" for r in self.finished),
                "to_run": left,
                "running": running,
                "elapsed_seconds": round(elapsed, 1),
                "eta_seconds": round(elapsed / done * left, 1) if done else None,
                "stopping": self.signals[0] if self.signals else None,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        )

    def _bar(self, show: bool) -> Any:
        if not show or not self.total:
            return None
        from tqdm import tqdm

        return tqdm(
            total=self.total, desc="sweep", unit="run", dynamic_ncols=True, file=sys.stdout, disable=None
        )

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    # ------------------------------------------------------------------ signals and the end
    @contextlib.contextmanager
    def _signals_caught(self) -> Iterator[None]:
        """SIGINT/SIGTERM: 1st stops handing out runs (runs that got it too save a checkpoint and stop),
        2nd passes SIGTERM on to the workers, 3rd kills them. The handler only writes to a pipe that the
        loop waits on, so nothing is interrupted half-way."""
        previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signals.append(signal.Signals(signum).name)
        os.write(self._wake_write, b"!")

    def _on_signal(self) -> None:
        count, name = len(self.signals), self.signals[-1]
        running = len(self._busy())
        if count == 1:
            self._line(
                f"{name}: stopping; {running} run(s) in progress save a checkpoint at their next sync point "
                f"(signal again to make them stop now); rerun the same command to continue"
            )
        elif count == 2:
            self._line(f"second signal: passing SIGTERM on to {running} run(s)")
            for worker in self.workers.values():
                _signal(worker.process, signal.SIGTERM)
        else:
            self._line("third signal: killing the workers; their runs continue from their last checkpoint")
            for worker in self.workers.values():
                _signal(worker.process, signal.SIGKILL)

    def _shut_down(self) -> None:
        """Tell idle workers to exit and wait for them; kill any that do not (or all, after an error)."""
        deadline = time.monotonic() + STOP_WAIT
        for worker in self.workers.values():
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(None)
        for worker in self.workers.values():
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self.workers.clear()

    def _kill_everything(self) -> None:
        """Test-only (SWEEP_FAULT_ENV ...@sweep): die with every worker at once, as on a lost node."""
        for worker in self.workers.values():
            _signal(worker.process, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def describe_result(record: dict[str, Any]) -> str:
    """The one line printed when an experiment has finished."""
    name, seconds = record["experiment"], record["wall_time"]
    if record["status"] == "pruned":
        return (
            f"pruned  {name}: {record['metrics']['pruned']}, {record['metrics'].get('epochs', '?')} epochs, "
            f"{seconds:.1f}s"
        )
    if record["status"] != "ok":
        return f"FAILED  {name}: {record['error']} (exit {record['exit_status']}; log {record['log']})"
    metrics = record["metrics"]
    metric, best = monitored(metrics)
    shown = [f"best {metric} {best:.4f}"] if best is not None else []
    shown += [
        f"{key} {value:.4f}"
        for key, value in sorted(metrics.items())
        if key.startswith("val_") and isinstance(value, (int, float))
    ]
    line = f"{name}: {', '.join(shown)}, {metrics.get('epochs', '?')} epochs, {seconds:.1f}s"
    why = did_not_learn(record)
    return f"ok, did not learn  {line} ({why})" if why else f"ok      {line}"


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = {"SIGKILL": " (out of memory, or killed from outside)", "SIGSEGV": " (a crash)"}.get(name, "")
        return f"killed by {name}{why}"
    return f"exited with status {code} without reporting"


def _readable(conn: Connection) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


def _signal(process: Any, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(process.pid, signum)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the processes started inside the block (the spawn start method
    hands this process's environment to the child)."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
