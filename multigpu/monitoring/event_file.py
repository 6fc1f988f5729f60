"""TensorBoard's event file, written by the training loop itself at its sync points.

torch's SummaryWriter hands each event to a background thread that competes
with the training loop for Python's interpreter lock: on
benchmarks/step_overhead.py's tiny model (about 300 us a step) the events cost
the loop 19 us per step that way, in one in-process comparison
(docs/speed.md, "Speed"). Here the loop writes them itself, at sync points
(every --log-every steps), where the host has waited for the device anyway.
Events are held for at most `max_delay` seconds (1 s) and then written and
flushed together: a run whose logging intervals take longer than that writes
each one as it ends, and one with intervals of milliseconds does not spend
them on the file (each record's checksum is computed in Python). TensorBoard
sees an interval within a second (SummaryWriter: up to two minutes), and a
failed write (a full disk) is raised here, in the loop, where it becomes one
line. The file is the same as SummaryWriter's: name, version record, records.

The records are framed here (`frame`) rather than by TensorBoard's RecordWriter:
importing that one class loads TensorBoard's summary package, 34 ms of a 52 ms
import that rank 0 pays at the start of every run, and its checksum loops over
each byte in Python. TensorBoard's own reader checks every record's checksum
(tests/monitoring/test_event_file.py).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary

from multigpu import safe_files

# Two files of one process in one second still get different names; zero-padded, because TensorBoard reads
# a folder's files in name order and a resumed run's purge must come after the file it purges (".10" < ".9").
_FILE_NUMBERS = itertools.count()
SUFFIX = ".multigpu"


def _crc32c_tables() -> tuple[list[int], ...]:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) lookup tables for four bytes at a time: table k
    gives a byte's effect k bytes before the end of a 4-byte word."""
    first = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        first.append(crc)
    tables = [first]
    for _ in range(3):
        tables.append([(crc >> 8) ^ first[crc & 0xFF] for crc in tables[-1]])
    return tuple(tables)


_CRC_TABLES = _crc32c_tables()


def crc32c(data: bytes) -> int:
    """The CRC-32C of `data`, four bytes per step (TFRecord's checksum)."""
    t0, t1, t2, t3 = _CRC_TABLES
    crc = 0xFFFFFFFF
    whole = len(data) - len(data) % 4
    for (word,) in struct.iter_unpack("<I", memoryview(data)[:whole]):
        crc ^= word
        crc = t3[crc & 0xFF] ^ t2[(crc >> 8) & 0xFF] ^ t1[(crc >> 16) & 0xFF] ^ t0[crc >> 24]
    for byte in data[whole:]:
        crc = t0[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked checksum: the CRC rotated right by 15 bits plus a constant, modulo 2**32."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord: the length (8 bytes, little-endian), its masked CRC, the data, the data's masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFile:
    """One TensorBoard event file in `log_dir`; `purge_step` makes TensorBoard drop earlier files' events
    from that step on (what a resumed run logs again). `inside`: the folder the user named that holds
    `log_dir` (the save-dir of <save-dir>/tb): a symbolic link planted below it is refused (safe_files)."""

    def __init__(
        self, log_dir: str, purge_step: int | None = None, max_delay: float = 1.0, inside: str | None = None
    ):
        safe_files.make_folder(log_dir, inside)
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_FILE_NUMBERS):06d}{SUFFIX}"
        )
        self.path = os.path.join(log_dir, name)
        self.max_delay = max_delay
        self._file = safe_files.open_no_follow(
            self.path, "xb"
        )  # a new name: nothing there may be written through
        self._pending: list[Event] = []
        self._written_at = time.monotonic()
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # the two records SummaryWriter(purge_step=...) writes
            self._write(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
            self._write(
                Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START))
            )
        self.flush()

    def scalars(self, values: dict[str, float], step: int = 0) -> None:
        """Several scalars as one event (one record rather than one per scalar), on disk within `max_delay` s."""
        self._pending.append(
            Event(
                wall_time=time.time(),
                step=int(step),
                summary=Summary(
                    value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()]
                ),
            )
        )
        if time.monotonic() - self._written_at >= self.max_delay:
            self.flush()

    def add_summary(self, summary: Summary, step: int = 0) -> None:
        """A summary as one event at `step`, on disk (with everything before it) when this returns."""
        self._pending.append(Event(wall_time=time.time(), step=int(step), summary=summary))
        self.flush()

    def _write(self, event: Event) -> None:
        self._file.write(frame(event.SerializeToString()))

    def flush(self) -> None:
        """Write the events held so far, and hand them to the operating system."""
        pending, self._pending = self._pending, []
        for event in pending:
            self._write(event)
        self._file.flush()
        self._written_at = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
