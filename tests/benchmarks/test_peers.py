"""benchmarks/peers.py at its tiny size: every contender trains the workload under torchrun and is measured
(Accelerate and Lightning when installed, else one line each), the trainer with --autotune makes its choice,
and the table holds one ratio per contender (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_benchmark

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_common import make_images  # noqa: E402  (after the path set-up)

CONTENDERS = ["trainer", "autotune", "loop", "accelerate", "lightning"]


@pytest.mark.slow
def test_every_contender_trains_and_is_in_the_table_or_skipped_in_one_line(tmp_path: Path):
    output = tmp_path / "peers.md"
    result, measured = run_benchmark(
        "peers.py", tmp_path, "--tiny", "--contenders", ",".join(CONTENDERS), "--output", str(output)
    )
    installed = [
        name
        for name in CONTENDERS
        if name not in ("accelerate", "lightning") or importlib.util.find_spec(name) is not None
    ]
    [rounds] = measured.values()  # one length at one process count
    [only] = rounds  # --tiny: one round
    assert sorted(only) == sorted(installed)
    for name in installed:  # all trained: the same steps, and each learned something on held-out samples
        assert only[name]["samples_per_sec"] > 0 and 0.0 <= only[name]["accuracy"] <= 1.0
    assert "chosen" in only["autotune"]  # 24 steps at 2 ranks: it tried both memory formats
    for name in set(CONTENDERS) - set(installed):
        assert f"{name.capitalize()}: not installed (pip install -e '.[peers]'): skipped" in result.stdout
    table = [line for line in output.read_text().splitlines() if line.startswith("| 24 steps")]
    assert len(table) == 1
    assert (
        len(table[0].split(" | ")) == 2 + (len(installed) - 1) + 2
    )  # length, config, ratios, loop, accuracies
    assert "--autotune chose: " in output.read_text()
    ratio = only["autotune"]["samples_per_sec"] / only["trainer"]["samples_per_sec"]  # the one round's
    assert (
        f"24 steps, 2 process(es): --autotune x{ratio:.3f} ({ratio:.3f}-{ratio:.3f}) the same trainer without it"
        in output.read_text()
    )


def test_a_224_px_workload_repeats_a_pool_of_distinct_images_to_the_run_length():
    import torch

    pooled, whole = make_images(10, (1, 8, 8), distinct=4), make_images(4, (1, 8, 8))
    assert len(pooled) == 10
    images = torch.stack([pooled[index][0] for index in range(10)])
    labels = [pooled[index][1].item() for index in range(10)]
    assert torch.equal(images[:4], whole.tensors[0]) and torch.equal(
        images[4:8], images[:4]
    )  # the pool, again
    assert (
        torch.equal(images[8:], images[:2]) and labels == labels[:4] * 2 + labels[:2]
    )  # cut at the run length
