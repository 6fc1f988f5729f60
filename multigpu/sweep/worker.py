"""A worker: one process per device slot, running the experiments it is sent one after another.

The scheduler starts it with the slot's CUDA_VISIBLE_DEVICES and thread count already in its
environment, sends it one task at a time over its own pipe and reads each outcome back from that pipe.
A one-device run trains in this process through `multigpu.launch.runner.run`; a run of K devices is a
K-process DDP job under torchrun. A run's console output goes to its own `train.log`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from multigpu import safe_files
from multigpu.errors import UsageError
from multigpu.sweep.child import REPORT_TO
from multigpu.sweep.plan import Experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMMARY_FILE = "run-summary.json"  # where a torchrun experiment's rank 0 leaves its final metrics


@dataclass(frozen=True)
class Task:
    """One attempt at one experiment."""

    experiment: Experiment
    attempt: int
    gpus_per_run: int = 1
    fault: str | None = None  # test-only: MULTIGPU_FAULT_INJECT for this attempt


def outcome(
    task: Task, status: str, exit_status: int, error: str | None, metrics: dict[str, Any], wall_time: float
) -> dict[str, Any]:
    """What a worker reports for an attempt; status is ok, pruned (a search's trial stopped it early), failed or
    stopped (by a signal: not finished)."""
    return {
        "experiment": task.experiment.name,
        "status": status,
        "exit_status": exit_status,
        "error": error,
        "metrics": metrics,
        "wall_time": wall_time,
        "attempt": task.attempt,
        "log": task.experiment.log_path,
    }


def worker_main(conn: Connection, threads: int, parent_pid: int, in_process: bool) -> None:
    """The worker process: run tasks from `conn` until told to stop (None), the pipe closes, or a signal.

    `in_process`: its runs train in this process (one device each), so it imports the trainer up front.
    """
    _die_with_parent(parent_pid)
    # SIGTERM outside training (training turns it into a checkpoint) stops the worker like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import torch

    torch.set_num_threads(threads)
    if in_process:
        _import_run_dependencies()
    try:
        while True:
            try:
                task = conn.recv()
            except EOFError:  # the sweep is gone
                return
            if task is None:
                return
            result = run_task(task)
            conn.send(result)
            if result["status"] == "stopped":
                return
    except KeyboardInterrupt:
        return


def _import_run_dependencies() -> None:
    """Import the trainer, TensorBoard and torch._dynamo (which a torch optimizer imports when first built,
    about 3 s) before the first run, so a run's wall time is the run's own."""
    import torch._dynamo  # noqa: F401
    from torch.utils.tensorboard.summary import hparams  # noqa: F401  (its end-of-run hparams)

    import multigpu.launch.runner  # noqa: F401
    import multigpu.monitoring.event_file  # noqa: F401  (the run's TensorBoard file)


def run_task(task: Task) -> dict[str, Any]:
    """Run one attempt of an experiment to its end and say how it went; never raises."""
    started = time.monotonic()
    try:
        safe_files.make_folder(task.experiment.save_dir, inside=task.experiment.sweep_dir)
        if task.gpus_per_run > 1:
            status, exit_status, error, metrics = _run_torchrun(task)
        else:
            status, exit_status, error, metrics = _run_in_process(task)
    except (
        UsageError
    ) as refusal:  # a link planted in the sweep dir (safe_files): this run is refused, not the sweep
        status, exit_status, error, metrics = "failed", refusal.exit_code, str(refusal), {}
    return outcome(task, status, exit_status, error, metrics, time.monotonic() - started)


def _run_in_process(task: Task) -> tuple[str, int, str | None, dict[str, Any]]:
    from multigpu.config import parse_config
    from multigpu.errors import TrainingStopped, UsageError
    from multigpu.launch.runner import run

    reporter = _reporter(task.experiment)
    with _output_to(task.experiment.log_path), _fault_injected(task.fault):
        print(f"--- sweep: {task.experiment.name}, attempt {task.attempt}", flush=True)
        try:
            summary = run(parse_config(list(task.experiment.argv)), [reporter] if reporter else [])
        except KeyboardInterrupt:
            return "stopped", 130, "interrupted before or after training", {}
        except (UsageError, TrainingStopped) as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return "failed", error.exit_code, str(error), {}
        except Exception as error:  # a bug or a crash in this run must not end the worker
            traceback.print_exc()
            return "failed", 1, _one_line(error), {}
        finally:
            _release_memory()
    return _finished(summary if reporter is None else {**summary, **reporter.outcome()})


def _reporter(experiment: Experiment) -> Any:
    """A search's run reports its epochs to its trial (multigpu/sweep/pruning.py); None for a grid's run."""
    if experiment.report_to is None:
        return None
    from multigpu.sweep.pruning import TrialReporter

    return TrialReporter(experiment.report_to)


def _finished(summary: dict[str, Any]) -> tuple[str, int, str | None, dict[str, Any]]:
    """How a run that returned its summary ended: stopped by a signal (not finished), pruned, or ok."""
    if summary.get("stopped"):
        return "stopped", 0, "stopped by a signal; its checkpoint continues it", {}
    return "pruned" if summary.get("pruned") else "ok", 0, None, summary


def _run_torchrun(task: Task) -> tuple[str, int, str | None, dict[str, Any]]:
    experiment = task.experiment
    summary_path = os.path.join(experiment.save_dir, SUMMARY_FILE)
    if os.path.exists(summary_path):
        os.unlink(summary_path)
    link = [REPORT_TO, experiment.report_to.to_json()] if experiment.report_to else []
    # After "--" torchrun's parser reads no flag of the run's: before it, it takes an abbreviation of its own flags
    # for one (--monitor as its --monitor-interval), and refuses the run.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={task.gpus_per_run}",
        "-m",
        "multigpu.sweep.child",
        "--",
        summary_path,
        *link,
        *experiment.argv,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    env.pop(_fault_env(), None)
    if task.fault:
        env[_fault_env()] = task.fault
    with safe_files.open_no_follow(experiment.log_path, "ab") as log:
        log.write(f"--- sweep: {experiment.name}, attempt {task.attempt}: {' '.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_set_death_signal
        )
        try:
            code = process.wait()
        except KeyboardInterrupt:  # torchrun got the signal too: it stops its ranks, which save a checkpoint
            process.wait()
            return "stopped", 130, "interrupted", {}
    summary = _read_json(summary_path) if code == 0 else None
    if summary is None:
        return "failed", code if code else 1, _error_from_log(experiment.log_path, code), {}
    os.unlink(summary_path)
    return _finished(summary)


def _fault_env() -> str:
    from multigpu.resilience.faults import FAULT_ENV

    return FAULT_ENV


@contextlib.contextmanager
def _fault_injected(spec: str | None) -> Iterator[None]:
    """Test-only: arm the trainer's fault injector (docs/checkpoints.md, "Testing it yourself") for this attempt."""
    name = _fault_env()
    previous = os.environ.pop(name, None)
    if spec:
        os.environ[name] = spec
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if previous is not None:
            os.environ[name] = previous


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C code's output too) to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = safe_files.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for handle in (log, *saved):
            os.close(handle)


def _release_memory() -> None:
    """Free the finished run's tensors and give its cached CUDA memory back before the next run."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def _error_from_log(path: str, code: int) -> str:
    """The run's own one-line error from its log (main_multi_gpu.py prints 'error: ...'), else its exit status."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            lines = file.read().splitlines()[-200:]
    except OSError:
        lines = []
    said = [line.strip() for line in lines if line.startswith("error: ") or "lost contact with" in line]
    detail = said[-1].removeprefix("error: ") if said else "see its log"
    return f"{detail} (torchrun exit status {code})"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _load_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _load_prctl()  # looked up now: between fork and exec (preexec_fn) only the call itself is safe


def _set_death_signal() -> None:
    """Linux: receive SIGTERM when the parent dies, so no orphan keeps writing into the sweep dir."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _die_with_parent(parent_pid: int) -> None:
    _set_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
