"""multigpu/launch/console.py: a console nobody reads any more (a pipe whose reader died) never stops a run.

The launcher's piped Ctrl-C (tests/test_launch_multi_gpu.py) is the end-to-end case; here, real pipes.
"""

from __future__ import annotations

import errno
import io
import os
import sys

import pytest

from multigpu.launch.console import BestEffortStream, best_effort


def dead_pipe() -> io.TextIOWrapper:
    """The write end of a pipe whose reader has exited, as a line-buffered text stream."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return open(write_end, "w", buffering=1)


def is_dev_null(fd: int) -> bool:
    return os.fstat(fd).st_rdev == os.stat(os.devnull).st_rdev


def test_a_write_to_a_dead_pipe_goes_to_dev_null_and_so_does_everything_after_it() -> None:
    pipe = dead_pipe()
    with pytest.raises(BrokenPipeError):  # what a plain print does, wherever the trainer prints
        pipe.write("step 7: loss 0.1\n")
    stream = BestEffortStream(pipe)
    assert stream.write("checkpoint last.pt written\n") == len("checkpoint last.pt written\n")
    stream.flush()
    assert is_dev_null(
        pipe.fileno()
    )  # C code and child processes writing to the descriptor lose nothing either
    print("more", file=stream, flush=True)
    pipe.close()


def test_other_write_errors_still_raise() -> None:
    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        BestEffortStream(FullDisk()).write("x")


def test_best_effort_wraps_the_console_for_the_block_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipe = dead_pipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    with best_effort():
        assert isinstance(sys.stdout, BestEffortStream) and sys.stdout.stream is pipe
        print("the run's last line", flush=True)
    assert sys.stdout is pipe and is_dev_null(pipe.fileno())
    monkeypatch.undo()
    pipe.close()
