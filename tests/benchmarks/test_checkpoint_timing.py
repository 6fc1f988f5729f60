"""benchmarks/checkpoint_timing.py at its tiny size: every row is measured through the project's savers, and the
checkpoints it timed are real (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_benchmark

ROWS = ["raw torch.save", "one file", "sharded, sync", "sharded, async"]


@pytest.mark.slow
def test_every_row_saves_loads_and_is_printed(tmp_path: Path):
    result, measured = run_benchmark("checkpoint_timing.py", tmp_path, "--tiny")
    assert measured["parameters"] > 0
    for row in ROWS:
        [only] = measured[row]  # --tiny: one round
        assert 0 < only["blocked"] <= only["complete"] and only["load"] > 0
        assert only["bytes"] > 4 * 3 * measured["parameters"]  # weights and both AdamW moments, fp32
    # The sharded folder was also loaded by one process: resharded from 2.
    assert measured["sharded, sync"][0]["load at 1"] > 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in lines[1:]] == ROWS
    assert "at 2; " in lines[3] and lines[3].rstrip(" |").split(" | ")[1] == "2"
