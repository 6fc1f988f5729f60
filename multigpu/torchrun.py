"""The path of multigpu/launch/torchrun.py before 0.3, kept so that a `launch_command.sh` saved then still runs."""

import os
import runpy
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder
runpy.run_module("multigpu.launch.torchrun", run_name="__main__", alter_sys=True)
