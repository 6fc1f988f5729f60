"""TensorBoard's event file, written by the training loop itself at its sync points.

torch's SummaryWriter hands each event to a background thread. That thread
competes with the training loop for Python's interpreter lock: on
benchmarks/step_overhead.py's tiny model (about 300 us a step) the events cost
the loop 19 us per step that way and 5 us written here, in one in-process
comparison (MULTI_GPU_GUIDE.md, "Speed"). Events are only written at sync points (every
--log-every steps), where the host has waited for the device anyway, so this
file writes each one at once (about 30 us) and flushes it: TensorBoard shows an
interval as soon as it ends rather than up to two minutes later, and a failed
write (a full disk) is raised here, in the loop, where it becomes one line.
The file is the same as SummaryWriter's: name, version record, records.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from typing import Optional

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

_FILE_NUMBERS = itertools.count()  # two files of one process in one second still get different names
SUFFIX = ".multigpu"


class EventFile:
    """One TensorBoard event file in `log_dir`; `purge_step` makes TensorBoard drop earlier files' events
    from that step on (what a resumed run logs again)."""

    def __init__(self, log_dir: str, purge_step: Optional[int] = None):
        os.makedirs(log_dir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_FILE_NUMBERS)}{SUFFIX}")
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, "wb")
        self._records = RecordWriter(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # the two records SummaryWriter(purge_step=...) writes
            self._write(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
            self._write(Event(wall_time=time.time(), step=purge_step,
                              session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def add_summary(self, summary: Summary, step: int = 0) -> None:
        """A summary as one event at `step`, on disk when this returns."""
        self._write(Event(wall_time=time.time(), step=int(step), summary=summary))
        self.flush()

    def scalars(self, values: dict[str, float], step: int = 0) -> None:
        """Several scalars as one event (one record rather than one per scalar)."""
        self.add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))
                                        for tag, value in values.items()]), step)

    def _write(self, event: Event) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
