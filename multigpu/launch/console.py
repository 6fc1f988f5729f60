"""The console is best-effort: a closed or broken stdout/stderr never stops a run.

`bash launch_multi_gpu.sh | tee run.log`, then Ctrl-C: the terminal's SIGINT reaches tee too, which dies
first, and rank 0's next line (the very one saying the checkpoint is written) would raise BrokenPipeError
wherever it prints: no checkpoint, the run lost. Inside `best_effort()` a console stream that fails that way
is pointed at /dev/null, its file descriptor too (so C code and child processes stop writing into the
dead pipe as well), and the run goes on: checkpoints, TensorBoard and log files are written as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

# What a write to a console nobody reads any more fails with: the reader of a pipe is gone (EPIPE), the
# terminal is gone (EIO), the descriptor was closed (EBADF).
GONE = (errno.EPIPE, errno.EIO, errno.EBADF)


class BestEffortStream:
    """A text stream whose writes and flushes never fail because nobody reads it; all else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as error:
            self._lost(error)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            self._lost(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def _lost(self, error: OSError) -> None:
        if error.errno not in GONE:
            raise error
        silence(self.stream)


def silence(stream: TextIO) -> None:
    """Point `stream`'s file descriptor at /dev/null, and drop what it still holds for the lost reader."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    finally:
        os.close(null)
    with contextlib.suppress(OSError):
        stream.flush()  # what the failed write left in the buffer now goes to /dev/null


@contextlib.contextmanager
def best_effort() -> Iterator[None]:
    """sys.stdout and sys.stderr as BestEffortStreams for the block; they are put back at its end unless the
    block replaced them itself (torchrun.py sends its stderr to a log file for good)."""
    saved = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    wrapped = {
        name: BestEffortStream(stream)
        for name, stream in saved.items()
        if stream is not None and not isinstance(stream, BestEffortStream)
    }
    for name, stream in wrapped.items():
        setattr(sys, name, stream)
    try:
        yield
    finally:
        for name, stream in wrapped.items():
            stream.flush()  # a lost console is found here, not by Python at exit (which would exit with 120)
            if getattr(sys, name) is stream:
                setattr(sys, name, saved[name])
