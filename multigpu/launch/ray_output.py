"""What a run on Ray prints (docs/launcher.md, "Ray"): the trainer's lines from rank 0, and Ray's own only where
they say something the run's lines do not.

Ray and Ray Train log each step of their machinery (resource requests, the worker group, the process group) at
INFO on every process, a worker's death as several tracebacks, and Ray Train's placement-group cleaner, where
Ray's state API does not answer (no dashboard), a warning every second of the run. Here:

- Ray's loggers in every process of the job at WARNING (`ray.init(logging_config=...)`), Ray Train's console at
  ERROR (RAY_TRAIN_LOG_LEVEL: its log files under the session's logs/train/ keep every level);
- in every Ray worker process (`quiet_ray_worker`, the job's worker_process_setup_hook), the cleaner's repeated
  "Failed to query Ray Train Controller actor state" and the traceback Ray Train logs for a worker that ended
  with a failed run's exit status (the runner's line said why already) left out;
- a run Ray gave up on is one line (`failure_line`): each failed worker, its exit as Ray saw it, and the command
  that continues the run from its newest checkpoint.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Sequence
from typing import Any

RAY_LOG_LEVEL = "WARNING"
RAY_TRAIN_LOG_LEVEL = "ERROR"
# What a worker raises for Ray to restart the group, when its run ended with a failure's exit status: its line
# was the run's own (multigpu/launch/ray_train.py's train_on_worker).
ENDED_WITH = "ended with exit status"


class _LeftOut(logging.Filter):
    """Drops the records whose message holds one of `marks`."""

    def __init__(self, *marks: str) -> None:
        super().__init__()
        self.marks = marks

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(mark in message for mark in self.marks)


def quiet_ray_worker() -> None:
    """Ray's worker_process_setup_hook for the run's job: in each of its worker processes (Ray Train's controller,
    its placement-group cleaner, the training workers), the records `failure_line` and the trainer say better."""
    cleaner = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    logging.getLogger(cleaner).addFilter(_LeftOut("Failed to query Ray Train Controller actor state"))
    logging.getLogger("ray.train.v2._internal.util").addFilter(_LeftOut(ENDED_WITH))


def failure_line(error: Exception, max_failures: int, resume: str) -> str:
    """The one line of a run Ray gave up on: each failed worker (those that died first), its exit as Ray saw it,
    and `resume`, the command that continues the run."""
    failures = getattr(error, "worker_failures", None) or {}
    described = {rank: describe(failure) for rank, failure in sorted(failures.items())}
    died = {rank: words for rank, words in described.items() if ENDED_WITH not in words}
    shown = died or described  # the workers that died take the blame; the others ended after them
    if shown:
        what = "; ".join(f"worker rank {rank} {words}" for rank, words in shown.items())
        after = sorted(set(described) - set(shown))
        if after:
            what += f" (rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} ended after it)"
    else:
        what = first_line(error)
    return (
        f"error: the run on Ray failed: {what}; Ray gave up on it (--ray-max-failures {max_failures}): "
        f"continue from the newest checkpoint with: {resume}"
    )


def describe(failure: BaseException) -> str:
    """One worker's end in words: its process gone (Ray's exit type and the pid), or its own error's last line."""
    text = str(failure)
    pid = re.search(r"\bpid: (\d+)", text)
    kind = re.search(r"Worker exit type: (\w+)", text)
    if "died unexpectedly" in text or kind:
        how = f"{kind.group(1)}, " if kind else ""
        return (
            f"(pid {pid.group(1) if pid else '?'}) died: its process ended without an exit status of its own "
            f"({how}killed by a signal or the OOM killer, or crashed)"
        )
    if ENDED_WITH in text:
        status = re.search(rf"{ENDED_WITH} (-?\d+)", text)
        return f"{ENDED_WITH} {status.group(1) if status else '?'}"
    return f"failed: {last_line(getattr(failure, 'traceback_str', None) or text)}"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no message"


def resume_command(script: str, argv: Sequence[str], save_dir: str, resume_given: bool) -> str:
    """The driver's command again, with --save-dir (where it was chosen for the run) and --resume auto."""
    words = ["python", script, *argv]
    if "--save-dir" not in argv and not any(arg.startswith("--save-dir=") for arg in argv):
        words += ["--save-dir", save_dir]
    if not resume_given:
        words += ["--resume", "auto"]
    return shlex.join(words)


def ray_logging(ray: Any) -> Any:
    """Ray's LoggingConfig for `ray.init`: its loggers at RAY_LOG_LEVEL in every process of the job."""
    return ray.LoggingConfig(log_level=RAY_LOG_LEVEL)
