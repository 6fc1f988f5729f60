"""The test-only fault injector: MULTIGPU_FAULT_INJECT='rank:step[:save|:stop]' makes a rank die by SIGKILL
(or, with :stop, freeze by SIGSTOP: alive but silent, as a hung rank is).

It proves crash-safe resume for real (docs/checkpoints.md, "Testing it yourself"): a rank killed after a step, or
inside a save between writing and renaming, as a preempted or OOM-killed worker dies. Off unless the variable is
set.
"""

from __future__ import annotations

import os
import signal

from multigpu.errors import UsageError
from multigpu.resilience.preemption import restart_count

FAULT_ENV = "MULTIGPU_FAULT_INJECT"


def _fault_spec(rank: int) -> tuple[int, str] | None:
    """(step, where) for this rank from MULTIGPU_FAULT_INJECT='rank:step[:save]', first attempt only."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or restart_count() > 0:
        return None
    parts = spec.split(":")
    try:
        fault_rank, step = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        parts = []
    where = parts[2] if len(parts) == 3 else "step"
    if len(parts) not in (2, 3) or where not in ("step", "save", "stop"):
        raise UsageError(f"{FAULT_ENV} must be RANK:STEP, RANK:STEP:save or RANK:STEP:stop, got {spec!r}")
    return (step, where) if fault_rank == rank else None


def fault_step(rank: int) -> int | None:
    """Test-only: the step after which this rank SIGKILLs itself, from MULTIGPU_FAULT_INJECT='rank:step'
    (or SIGSTOPs itself, from 'rank:step:stop': see `misbehave`).

    Only on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restarted
    group runs through and the test can check that it resumed correctly.
    """
    fault = _fault_spec(rank)
    return fault[0] if fault and fault[1] in ("step", "stop") else None


def save_fault_step(rank: int) -> int | None:
    """Test-only: the step whose checkpoint save this rank is SIGKILLed in, after the temporary
    file is written and before it is renamed (MULTIGPU_FAULT_INJECT='0:step:save'; only rank 0 writes)."""
    fault = _fault_spec(rank)
    return fault[0] if fault and fault[1] == "save" else None


def kill_self() -> None:
    """Die by SIGKILL, as a preempted or OOM-killed process does: no handler, no clean-up."""
    os.kill(os.getpid(), signal.SIGKILL)


def misbehave(rank: int) -> None:
    """At the fault step: SIGKILL this rank, or SIGSTOP it for 'rank:step:stop' (a hang the watchdog must name)."""
    fault = _fault_spec(rank)
    os.kill(os.getpid(), signal.SIGSTOP if fault and fault[1] == "stop" else signal.SIGKILL)
