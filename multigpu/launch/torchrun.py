"""torchrun that ends with the workers' verdict: their one line and their exit status, no traceback.

    python multigpu/launch/torchrun.py --log-file FILE [torchrun's own flags] main_multi_gpu.py [trainer flags]

Plain torchrun turns every worker exit other than 0 into its own status 1 and
a `ChildFailedError` report, and a clean stop on SIGTERM/Ctrl-C (the workers
checkpoint and exit 0) into status 1 and a `SignalException` traceback (see
docs/launcher.md, "How a run ends"). This runs torchrun's own
code in this process, unchanged (same flags, rendezvous, restarts, signal
forwarding and grace period), with two differences:

- torchrun's own messages (its log lines and those reports) go to FILE, appended,
  while the workers keep the terminal: they inherit this process's file
  descriptors, and only Python's `sys.stderr` and torch's log handlers point at FILE.
- the exit status is the workers': 0 when all of them exited 0 (a finished run,
  or a clean stop on a signal with its "continue with --resume auto" line), else
  the first failed worker's status (2 bad input, 1 a failed run; 128+N for a
  worker killed by signal N), but 3 whenever a worker's hang watchdog stopped the
  run (the ranks it ended die after it). A worker's own line says what went wrong;
  for anything but bad input one more line names the rank and FILE, and for a
  hang the report: "hang: see SAVE_DIR/hang_report.txt".

The launcher (launch_multi_gpu.sh) and its SLURM script run DDP through this.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

if __package__ in (None, ""):  # run as a file: make the repository importable, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from multigpu import safe_files  # noqa: E402  (after the path fix)
from multigpu.errors import HANG_EXIT_STATUS, UsageError  # noqa: E402
from multigpu.launch.console import best_effort  # noqa: E402
from multigpu.tuning.gc_pauses import skip_the_collection_at_exit  # noqa: E402

PROG = "torchrun"


def worker_status(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: a kill by signal N (-N from Popen) is 128+N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def verdict(failures: dict[int, Any], ranks: str = "rank") -> tuple[int, str]:
    """(exit status, "rank R") of the first failure torchrun observed, or (0, "") when none failed.

    `failures` maps ranks to torch's ProcessFailure (exit code, time in whole seconds),
    in the order torchrun observed them. The first one is the cause: torchrun then
    stops the others, whose statuses only echo it.
    """
    if not failures:
        return 0, ""
    hang = [item for item in failures.items() if item[1].exitcode == HANG_EXIT_STATUS]  # it ended the others
    rank, failure = min(
        hang or failures.items(), key=lambda item: item[1].timestamp
    )  # ties: the first observed
    return worker_status(failure.exitcode), f"{ranks} {rank}"


class _WorkerGroups:
    """Remembers the worker processes torchrun starts, to read their exit codes after a signal.

    torchrun keeps them inside its agent; on a SIGTERM/SIGINT it forwards the signal,
    waits for the workers (30 s by default) and raises SignalException without
    saying how they ended. Their process context (torch's public PContext) still
    knows: `wait(0)` polls it.
    """

    def __init__(self) -> None:
        self.latest: Any = None

    def install(self) -> None:
        from torch.distributed.elastic.agent.server import local_elastic_agent

        start = local_elastic_agent.start_processes

        def start_and_remember(*args: Any, **kwargs: Any) -> Any:
            self.latest = start(*args, **kwargs)
            return self.latest

        local_elastic_agent.start_processes = start_and_remember

    def failures_after_signal(self, sigval: signal.Signals) -> dict[int, Any] | None:
        """The workers' failures by local rank once all have ended; None if none were started."""
        if self.latest is None:
            return None
        result = self.latest.wait(0)
        if result is None:
            # A second signal cut torchrun's wait short: pass it on, as the trainer expects
            # (a second signal exits at once, without a checkpoint), and wait for them.
            self.latest.close(sigval)
            result = self.latest.wait(0)
        return {} if result is None else dict(result.failures)


def _send_logs_to(log: TextIO) -> None:
    """Point Python's stderr and every log handler writing to the terminal at `log`, whatever handlers other
    libraries installed."""
    import logging

    loggers = [logging.getLogger()] + [
        item for item in logging.Logger.manager.loggerDict.values() if isinstance(item, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if (
                isinstance(handler, logging.StreamHandler)
                and handler.stream in (sys.stderr, sys.stdout)
                and _stream_settable(handler)
            ):
                handler.setStream(log)
    sys.stderr = log


def _stream_settable(handler: Any) -> bool:
    """False for a handler whose stream is a read-only property: logging's _StderrHandler (which dill, imported
    by torch when installed, adds to its logger) reads sys.stderr on every record, so it follows sys.stderr to
    the log by itself."""
    declared = getattr(type(handler), "stream", None)
    return not (isinstance(declared, property) and declared.fset is None)


def _say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def run(argv: Sequence[str]) -> int:
    """Run torchrun with `argv` (after --log-file FILE) and return the workers' verdict."""
    if len(argv) < 2 or argv[0] != "--log-file":
        raise UsageError("usage: torchrun.py --log-file FILE [torchrun flags] SCRIPT [script flags]")
    log_path, torchrun_argv = argv[1], list(argv[2:])
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    args = parse_args(torchrun_argv)  # a bad torchrun flag is reported on the terminal
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    # Left open until the process ends: torch may still log while Python shuts down.
    log = safe_files.open_no_follow(log_path, "a", buffering=1)
    assert isinstance(log, io.TextIOWrapper)  # opened in text mode
    _say(
        log, f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: torchrun {' '.join(torchrun_argv)}"
    )
    terminal = sys.stderr
    groups = _WorkerGroups()
    groups.install()
    _send_logs_to(log)
    try:
        torchrun(args)
        return 0
    except ChildFailedError as error:
        traceback.print_exc(file=log)
        status, who = verdict(error.failures)
    except SignalException as error:
        traceback.print_exc(file=log)
        failures = groups.failures_after_signal(error.sigval)
        if failures is None:
            _say(terminal, f"{PROG}: stopped by {error.sigval.name} before the workers started")
            return worker_status(-error.sigval)
        status, who = verdict(failures, ranks="local rank")
    except Exception as error:  # rendezvous, store or configuration trouble: torchrun's own failure
        traceback.print_exc(file=log)
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        _say(terminal, f"{PROG} failed: {detail[:300]} (its report: {log_path})")
        return 1
    if status == HANG_EXIT_STATUS:
        report = os.path.join(_save_dir(torchrun_argv), "hang_report.txt")
        _say(
            terminal,
            f"{PROG}: hang: see {report} ({who} stopped the run with status {status}; torchrun's "
            f"report: {log_path})",
        )
    elif status not in (0, UsageError.exit_code):  # bad input: the worker's one line says it all
        _say(terminal, f"{PROG}: {who} exited with status {status} (torchrun's report: {log_path})")
    return status


def _save_dir(torchrun_argv: Sequence[str]) -> str:
    """The trainer's --save-dir in the command line (the launcher always gives one), else a description."""
    for index, word in enumerate(torchrun_argv[:-1]):
        if word == "--save-dir":
            return torchrun_argv[index + 1]
        if word.startswith("--save-dir="):
            return word.split("=", 1)[1]
    return "the save-dir"


def main() -> None:
    skip_the_collection_at_exit()  # torchrun will import torch: the final collection would cost a second at exit
    with best_effort():  # `launcher | tee log`, Ctrl-C: tee dies first; the workers' verdict still counts
        try:
            status = run(sys.argv[1:])
        except UsageError as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            status = error.exit_code
    sys.exit(status)


if __name__ == "__main__":
    main()
