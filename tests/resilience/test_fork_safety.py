"""Before each fork, on Python before 3.12, the forking thread waits for the thread-state lock (fork_safety)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import PYTHON, REPO, cli_env

# A fresh interpreter: what a rank does (import multigpu, then torch's and its own fork handlers), then a fork.
# The wait is watched through the name the registered handler calls at each fork.
FORK_AFTER_IMPORT = """
import os
import multigpu
from multigpu.resilience import fork_safety
order = []
fork_safety._thread_states_free = lambda: order.append("wait")
os.register_at_fork(before=lambda: order.append("handler registered later"))
pid = os.fork()
if pid == 0:
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(order, os.waitstatus_to_exitcode(status), fork_safety.wait_for_thread_states_before_fork())
"""

# The same with the real wait: the fork goes through and the child runs.
FORK_WITH_THE_WAIT = """
import os
import multigpu
pid = os.fork()
if pid == 0:
    print("child")
    os._exit(3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_each_fork_waits_for_the_thread_state_lock_last_on_python_before_3_12():
    result = subprocess.run(
        [PYTHON, "-c", FORK_AFTER_IMPORT], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    if sys.version_info < (3, 12):
        # Registered once on import (a second call adds nothing), and run after the handlers registered since.
        assert result.stdout.split() == ["['handler", "registered", "later',", "'wait']", "0", "True"]
    else:
        assert result.stdout.split() == ["['handler", "registered", "later']", "0", "False"]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 re-creates the lock in the child first")
def test_the_wait_itself_returns_and_the_child_runs():
    from multigpu.resilience import fork_safety

    assert fork_safety.wait_for_thread_states_before_fork()  # registered by the import of multigpu already
    result = subprocess.run(
        [PYTHON, "-c", FORK_WITH_THE_WAIT],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.split() == ["child", "3"], result.stderr
