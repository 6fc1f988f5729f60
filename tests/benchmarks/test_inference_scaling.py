"""benchmarks/inference_scaling.py on tiny sizes: every CPU device set measured, outputs checked, table and plot
written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, RUN_TIMEOUT, assert_ok, cli_env

BATCHES = (1, 3, 16)


@pytest.mark.slow
def test_the_benchmark_measures_every_cpu_device_set_and_writes_its_table_and_plot(tmp_path: Path):
    from PIL import Image

    output = tmp_path / "out" / "scaling.md"
    result = subprocess.run(
        [
            PYTHON,
            str(REPO / "benchmarks" / "inference_scaling.py"),
            "--model",
            "mlp",
            "--image-shape",
            "1,8,8",
            "--batch-sizes",
            ",".join(map(str, BATCHES)),
            "--repeats",
            "3",
            "--output",
            str(output),
        ],
        cwd=tmp_path,
        env=cli_env({"CUDA_VISIBLE_DEVICES": ""}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert_ok(result)
    table = output.read_text()
    assert table in result.stdout
    rows = [
        line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "| batch |" not in line
    ]
    all_threads = f"CPU, {len(os.sched_getaffinity(0))} threads"
    splits = ["CPU BatchParallel, 2 replicas (threads)", "CPU DDP, 2 processes (gloo, 1 thread each)"]
    expected = {(name, batch) for name in ["CPU, 1 thread", all_threads] for batch in BATCHES}
    expected |= {
        (name, batch) for name in splits for batch in BATCHES if batch >= 2
    }  # one sample cannot be split
    assert {(cells[0][2:], int(cells[1])) for cells in rows} == expected
    checked = [cells for cells in rows if cells[0][2:] != all_threads]  # the reference of the others
    assert checked and all(cells[-1] == "✓ |" for cells in checked), table
    assert [line.split(" against ")[0] for line in table.splitlines() if line.startswith("- crossover")] == [
        f"- crossover, {name}" for name in splits
    ]
    with Image.open(output.with_suffix(".png")) as plot:
        assert plot.size == (1000, 640)
