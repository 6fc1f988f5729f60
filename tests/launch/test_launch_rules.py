"""The launcher's rule set (multigpu/launch/launch_rules.py) imports no torch: launch_multi_gpu.sh asks it at
every answer, so a call must take milliseconds, not a torch import's seconds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import PYTHON, cli_env

PROBE = """
import sys
from multigpu.launch import launch_rules
steps = [["check"], ["plan"], ["slurm", "--save-dir", "shared"], ["k8s", "--save-dir", "shared"]]
steps.append(["ray", "--gpus", "0"])
codes = [launch_rules.main(step) for step in steps]
print(codes, "torch" in sys.modules, file=sys.stderr)
"""


def test_each_step_of_the_launchers_rules_runs_without_importing_torch(tmp_path: Path):
    probe = subprocess.run(
        [PYTHON, "-c", PROBE], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.strip().splitlines()[-1] == "[0, 0, 0, 0, 0] False", probe.stderr
