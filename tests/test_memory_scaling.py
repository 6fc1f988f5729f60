"""benchmarks/memory_scaling.py at its small size: per-rank bytes under fsdp are 1/N of ddp's, at N = 1, 2, 3."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import PYTHON, REPO, RUN_TIMEOUT, assert_ok, cli_env


def test_fsdp_holds_about_one_nth_of_ddps_parameters_gradients_and_optimizer_state(tmp_path: Path):
    raw = tmp_path / "raw.json"
    result = subprocess.run([PYTHON, str(REPO / "benchmarks" / "memory_scaling.py"), "--small", "--json", str(raw)],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert_ok(result)
    measured = json.loads(raw.read_text())
    assert sorted(measured) == ["1", "2", "3"]
    for world_size, ranks in measured.items():
        n = int(world_size)
        assert len(ranks) == n
        for rank in ranks:
            ddp = sum(rank["ddp"][key] for key in ("params", "grads", "optimizer"))
            fsdp = sum(rank["fsdp"][key] for key in ("params", "grads", "optimizer"))
            assert ddp == 16 * rank["ddp"]["parameters"]  # fp32 weights, gradients and AdamW's two moments
            # The issue's bound: 1/N within 10 percent, plus the largest block (the shards' padding is smaller).
            assert fsdp <= ddp / n * 1.1 + rank["fsdp"]["largest_block"]
        # The shards together are the model once: nothing is kept twice.
        assert sum(rank["fsdp"]["params"] for rank in ranks) == 4 * ranks[0]["fsdp"]["parameters"]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| fsdp | ")]
    assert [row.split(" | ")[1] for row in rows] == ["1", "2", "3"]
