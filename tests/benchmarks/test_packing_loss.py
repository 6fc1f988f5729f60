"""benchmarks/packing_loss.py: bad arguments exit 2 before anything trains. Its figures (docs/measured.md,
"Packing with document boundaries") come from the command line's own --packing and --eval-only, which
tests/data/test_packing.py and tests/engine/test_eval_only.py prove."""

from __future__ import annotations

import subprocess

import pytest

from conftest import PYTHON, REPO, cli_env


@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--steps", "0"], ["--steps", "x"]])
def test_bad_arguments_exit_2_before_anything_runs(bad: list[str]):
    done = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "packing_loss.py"), *bad],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "error:" in done.stderr
