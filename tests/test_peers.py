"""benchmarks/peers.py at its tiny size: every contender trains the workload under torchrun and is measured
(Accelerate and Lightning when installed, else one line each), the trainer with --autotune makes its choice,
and the table holds one ratio per contender (no timing is asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from conftest import run_benchmark

CONTENDERS = ["trainer", "autotune", "loop", "accelerate", "lightning"]


def test_every_contender_trains_and_is_in_the_table_or_skipped_in_one_line(tmp_path: Path):
    output = tmp_path / "peers.md"
    result, measured = run_benchmark("peers.py", tmp_path, "--tiny", "--contenders",
                                     ",".join(CONTENDERS), "--output", str(output))
    installed = [name for name in CONTENDERS if name not in ("accelerate", "lightning")
                 or importlib.util.find_spec(name) is not None]
    [rounds] = measured.values()  # one length at one process count
    [only] = rounds  # --tiny: one round
    assert sorted(only) == sorted(installed)
    for name in installed:  # all trained: the same steps, and each learned something on held-out samples
        assert only[name]["samples_per_sec"] > 0 and 0.0 <= only[name]["accuracy"] <= 1.0
    assert "chosen" in only["autotune"]  # 24 steps at 2 ranks: it tried both memory formats
    for name in set(CONTENDERS) - set(installed):
        assert f"{name.capitalize()}: not installed (pip install '.[peers]'): skipped" in result.stdout
    table = [line for line in output.read_text().splitlines() if line.startswith("| 24 steps")]
    assert len(table) == 1
    assert len(table[0].split(" | ")) == 2 + (len(installed) - 1) + 2  # length, config, ratios, loop, accuracies
    assert "--autotune chose: " in output.read_text()
