"""A torchrun worker whose agent is gone stops, as if the agent had forwarded a SIGTERM.

torchrun starts each worker in a session of its own (so that it can signal the worker's whole process group), so
killing the launcher's process group with SIGKILL, or the agent alone, leaves the workers training to the end with
nobody to stop or restart them. Linux tells a process of its parent's death when asked (prctl's
PR_SET_PDEATHSIG): a worker asks for a SIGTERM, which stops it cleanly at its next step with its checkpoint, as
torchrun's own SIGTERM does (docs/launcher.md, "How a run ends"). Only under torchrun: a run started by hand under
nohup outlives its shell on purpose.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_when_the_agent_dies() -> bool:
    """Under torchrun on Linux: SIGTERM this process when its parent, the agent, dies (at once if it already has).
    True where that was arranged."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # a C library without prctl
        return False
    if os.getppid() == 1:  # the agent died before the request: the process was given to init already
        os.kill(os.getpid(), signal.SIGTERM)
    return True
