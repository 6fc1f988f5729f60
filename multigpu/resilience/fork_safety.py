"""Forks that wait for Python's thread-state lock, so that loader workers do not hang on Python before 3.12.

A DataLoader worker is a fork of its rank (Linux's default start method). In
Python 3.11 before 3.11.10 (and older versions; CPython issue gh-112275) the
forked child takes the lock of the interpreter's thread-state list before it
re-creates that lock: forked while another thread held it, the worker hangs
before it runs a line, and its rank waits for the first batch forever.

torch's gloo threads take that lock without holding the interpreter lock:
when one frees the last reference to a tensor that a Python object owns (the
outputs of an all_gather that Python has already let go of), it makes itself
a Python thread state (`pybind11::gil_scoped_acquire`, seen in gdb on a
`pt_gloo_runloop` thread). Descheduled inside, on a busy machine, it holds the
lock for a time slice. `tests/data/test_sampler.py`'s ranks, which fork loader
workers right after the trainer's collectives, hung that way in CI and in one
of 27 reruns on the 2-core machine: the worker stopped in
`PyOS_AfterFork_Child` -> `_PyThreadState_DeleteExcept`.

So before every fork of a process that imports `multigpu`, the forking thread
takes that lock and gives it back (`sys._current_frames()` holds it while it
reads the list): a thread inside finishes first (it needs no interpreter lock
to do so). Left open are the microseconds between that and the fork itself.
Python 3.12 and later re-create the lock in the child first, and skip this.
"""

from __future__ import annotations

import os
import sys

AFFECTED = sys.version_info < (3, 12)  # 3.11.10 and later have the fix too; the wait costs microseconds there
_installed = False


def wait_for_thread_states_before_fork() -> bool:
    """Register the wait before every `os.fork()` of this process (once; Python before 3.12 only).

    Returns whether it is registered. Python calls the `before` handlers in the reverse order of their
    registration: `multigpu` registers this on import, first, so that it runs after the others' waits.
    """
    global _installed
    if AFFECTED and not _installed:
        os.register_at_fork(before=lambda: _thread_states_free())  # looked up per fork: a test can watch it
        _installed = True
    return _installed


def _thread_states_free() -> None:
    sys._current_frames()  # takes the thread-state list's lock, after any thread holding it, and gives it back
