"""benchmarks/vs_trl_sft.py at its tiny size: this project and TRL's SFTTrainer count the same completion tokens
per epoch and, trained on the same packed windows in the same order (240 rows: one of TRL's map batches), end
with the same validation loss (within 1e-4); no timing is asserted (the exit status 1 of a missed speed target is
allowed, a missed count is not). One process: two are the same code under torchrun, measured in
benchmarks/results/vs_trl_sft_cpu.md."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, cli_env

SCRIPT = REPO / "benchmarks" / "vs_trl_sft.py"

pytest.importorskip("trl", reason="benchmarks/vs_trl_sft.py's contender: pip install -e '.[trl]'")


@pytest.mark.slow  # two tiny trainings in fresh processes: the full run's, not the quick tier's
def test_both_count_the_same_tokens_and_train_to_the_same_validation_loss(tmp_path: Path):
    done = subprocess.run(
        [
            PYTHON,
            str(SCRIPT),
            "--tiny",
            "--output",
            str(tmp_path / "vs_trl.md"),
            "--json",
            str(tmp_path / "raw.json"),
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith("target met") or ("counted" not in verdict and "val loss" not in verdict), (
        verdict
    )
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["counted"]["ours"] == raw["counted"]["trl"] > 0
    ours, trl = raw["rounds"]["1 ours"][0], raw["rounds"]["1 trl"][0]
    assert ours["steps"] == trl["steps"] and abs(ours["val_loss"] - trl["val_loss"]) <= 1e-4


@pytest.mark.parametrize("bad", [["--warmup", "0"], ["--nproc", "0"], ["--heads", "3"], ["--rows", "x"]])
def test_bad_arguments_exit_2_before_anything_runs(bad: list[str]):
    done = subprocess.run(
        [PYTHON, str(SCRIPT), *bad], env=cli_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "error:" in done.stderr
