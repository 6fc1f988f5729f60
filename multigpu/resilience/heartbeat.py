"""Where each rank is: step, phase and the last collective it entered, for the hang watchdog.

The training loop writes plain Python attributes of one `Heartbeat` object
(`BEAT.phase = "forward"`): no store round trip, no host sync, nothing per step
but an attribute write. The watchdog's background thread reads them (and the
main thread's current line) every second or so and publishes them to the
rendezvous store (multigpu/resilience/watchdog.py), where every rank can read them.

The project's own collectives (multigpu/parallel/distributed.py) go through `recorded`,
which notes the operation, a sequence number and the tensor's shape and dtype;
DDP's gradient all-reduce runs inside the phase "backward".
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any, Callable

import torch

# The phases a rank reports, in the words of the hang report.
DATA, FORWARD, BACKWARD, OPTIMIZER = "data loading", "forward", "backward", "optimizer step"
EVALUATION, CHECKPOINT, USER_CODE, LOGGING = (
    "evaluation",
    "checkpoint",
    "user code (callbacks)",
    "logging sync point",
)
STARTING = "start-up"
# Phases in which the model and optimizer hold exactly the state after the last completed optimizer step.
CONSISTENT_PHASES = (DATA, FORWARD, BACKWARD, EVALUATION, CHECKPOINT, USER_CODE, LOGGING)


class Heartbeat:
    """This rank's position; written by the main thread, read by the watchdog's thread."""

    def __init__(self) -> None:
        self.check: Callable[[str, tuple[int, ...], str], None] | None = None  # --debug-collectives
        self.restart()

    def restart(self) -> None:
        """A fresh position (a process may train several times)."""
        self.step = 0
        self.phase = STARTING
        self.op = (
            ""  # the last of the project's collectives entered: operation, sequence number, shape, dtype
        )
        self.seq = 0
        self.shape: tuple[int, ...] = ()
        self.dtype = ""
        self.in_collective = False  # True from entering that collective until it returns
        self.hang_declared = False  # set by the watchdog's thread, which then ends the process

    def wait_if_hang_declared(self) -> None:
        """Called by the main thread when a collective failed: if the hang watchdog is ending the run (a peer it
        stopped closed the connection), wait for it to exit with its status instead of saying a second story."""
        if self.hang_declared:
            threading.Event().wait(timeout=30)  # the watchdog's os._exit comes within seconds

    @contextlib.contextmanager
    def recorded(self, op: str, tensor: torch.Tensor | None = None) -> Iterator[None]:
        """Note one of the project's collectives while it runs (shape and dtype of `tensor`, if any)."""
        self.seq += 1
        self.op = op
        self.shape = tuple(tensor.shape) if tensor is not None else ()
        self.dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "object"
        if (
            self.check is not None
        ):  # all ranks agree on (op, shape, dtype) first: multigpu/parallel/collective_check.py
            self.check(op, self.shape, self.dtype)
        self.in_collective = True
        try:
            yield
        finally:
            self.in_collective = False

    def snapshot(self, group_seq: int | None) -> dict[str, Any]:
        """What the watchdog publishes: the attributes, the main thread's innermost line, the process group's
        collective count (`group_seq`: every collective of the group, DDP's and the user's included)."""
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        return {
            "step": self.step,
            "phase": self.phase,
            "op": self.op,
            "seq": self.seq,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "in_collective": self.in_collective,
            "group_seq": group_seq,
            "where": _line(frame),
            "code": _line(_own_code(frame)),
            "frame": id(frame),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }


# Frames in these folders are torch's or Python's: the report names the innermost line outside them.
LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__))


def _own_code(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of the user's or the project's code (not torch's, not the standard library's)."""
    mine = frame
    while mine is not None and mine.f_code.co_filename.startswith(LIBRARIES):
        mine = mine.f_back
    return mine or frame


def _line(frame: FrameType | None) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"


BEAT = Heartbeat()  # this process's; the trainer and the collective helpers write it


def main_thread_stack() -> str:
    """The Python stack of this process's main thread, innermost call last (as a traceback prints it)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)\n"
