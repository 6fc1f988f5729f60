"""Stopping cleanly on SIGTERM/SIGINT, and the test-only fault injector.

A signal only sets a flag; the trainer checks it at its logging boundary, where
the ranks agree on it with one all-reduce, so every rank stops after the same
step and rank 0 can write a checkpoint that all of them reached.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Optional


class StopRequest:
    """Remembers that SIGTERM or SIGINT arrived; a second one exits at once."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signal_name is not None:
            print(f"second {signal.Signals(signum).name}: exiting now without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


FAULT_ENV = "MULTIGPU_FAULT_INJECT"


def fault_step(rank: int) -> Optional[int]:
    """Test-only: the step at which this rank must die, from MULTIGPU_FAULT_INJECT='rank:step'.

    Only on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restarted
    group runs through and the test can check that it resumed correctly.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    fault_rank, step = (int(part) for part in spec.split(":"))
    return step if fault_rank == rank else None
