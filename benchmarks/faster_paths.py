"""Benchmark: what --compile and --channels-last do to training speed, here.

    python benchmarks/faster_paths.py [--rounds 5] [--output benchmarks/results/faster_paths_cpu.md]

Trains two workloads (the default cnn on 1x28x28, resnet18 on 3x32x32; bf16
on GPUs) through main_multi_gpu.py on one device, plain and with each flag and
both, in fresh processes, the order alternating each round. Shows the steady
samples/s (every logging interval but the first, which holds the compilation),
the speed-up over plain, and the whole run's wall time, compilation included
(docs/speed.md, "Speed").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]
from bench_common import (  # noqa: E402
    alternating_rounds,
    benchmark_parser,
    logged_rates,
    machine_line,
    steady,
    write_markdown,
)

WORKLOADS = {
    "cnn 1x28x28": ["--model", "cnn", "--image-shape", "1,28,28"],
    "resnet18 3x32x32": ["--model", "resnet18", "--image-shape", "3,32,32"],
}
VARIANTS = {
    "plain": [],
    "--channels-last": ["--channels-last"],
    "--compile": ["--compile"],
    "--compile --channels-last": ["--compile", "--channels-last"],
}


def run(args: argparse.Namespace, workload: list[str], variant: list[str], gpu: bool) -> tuple[float, float]:
    """(steady samples/s, wall seconds) of one training run in a fresh process."""
    with tempfile.TemporaryDirectory() as save_dir:
        command = [
            sys.executable,
            str(REPO / "main_multi_gpu.py"),
            *workload,
            *variant,
            "--multi-gpu",
            "none",
            "--epochs",
            "1",
            "--batch-size",
            str(args.batch),
            "--train-size",
            str(args.batch * args.steps),
            "--val-size",
            "64",
            "--log-every",
            str(args.log_every),
            "--lr-schedule",
            "constant",
            "--no-progress",
            "--save-dir",
            save_dir,
            *(["--amp", "bf16"] if gpu else []),
        ]
        started = time.perf_counter()
        result = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            raise SystemExit(
                f"{' '.join(variant) or 'plain'} failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
            )
        return steady(logged_rates(os.path.join(save_dir, "tb"))), seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__,
        rounds=5,
        steps=24,
        batch=64,
        log_every=4,
        output_help="the Markdown table (default: benchmarks/results/faster_paths_<cpu|gpu>.md)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    results, (load_before, load_after) = alternating_rounds(
        args.rounds,
        list(WORKLOADS),
        list(VARIANTS),
        lambda workload, variant: run(args, WORKLOADS[workload], VARIANTS[variant], gpu),
        lambda figures: f"{figures[0]:.0f} samples/s, run {figures[1]:.1f} s",
    )
    rows = []
    for workload in WORKLOADS:
        plain = statistics.median(rate for rate, _ in results[(workload, "plain")])
        for variant in VARIANTS:
            rate = statistics.median(rate for rate, _ in results[(workload, variant)])
            wall = statistics.median(seconds for _, seconds in results[(workload, variant)])
            rows.append([workload, variant, f"{rate:.0f}", f"x{rate / plain:.2f}", f"{wall:.1f}"])
    output = Path(args.output or HERE / "results" / f"faster_paths_{'gpu' if gpu else 'cpu'}.md")
    precision = "bf16" if gpu else "fp32"
    notes = [
        machine_line(),
        f"one device, {precision}, batch {args.batch}, {args.steps} steps per run; samples/s over "
        f"every --log-every {args.log_every} interval but the first; medians of {args.rounds} alternating "
        f"rounds; load average {load_before:.2f} before, {load_after:.2f} after",
    ]
    write_markdown(
        output,
        "--compile and --channels-last",
        ["workload", "flags", "samples/s", "vs plain", "run s (compile included)"],
        rows,
        notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
