"""Benchmark: throughput as devices are added, for MultiGPUTrainer and a minimal hand-written loop.

    python benchmarks/scaling.py [--rounds 5] [--steps 40] [--output benchmarks/results/scaling_cpu.md]

Trains the project's default cnn on the same synthetic 1x28x28 data for a fixed
number of steps with the same per-device batch (weak scaling) on each device
set: without GPUs, 1 process with 1 thread, 1 process with 2 threads, and DDP
over 2 gloo processes with 1 thread each; with GPUs, 1 GPU, DDP over 2, 4, ...
and all GPUs, and DataParallel over all. Every set runs the trainer and a
minimal hand-written loop (DDP or DataParallel, AdamW, the same loader and
host syncs every --log-every steps), in fresh processes, the order alternating
each round; figures are medians over the rounds.

Columns: samples/s (steady: every logging interval but the first), speed-up
over one device, scaling efficiency = samples/s / (devices x samples/s of one
device), trainer/raw, and the time from launching the processes to the end of
the first optimizer step. Writes Markdown, CSV and a PNG plot, each with the
machine, torch version and date (docs/speed.md, "Speed").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]
from bench_common import (  # noqa: E402
    benchmark_parser,
    logged_rates,
    machine_line,
    make_cnn,
    make_images,
    steady,  # (after the path set-up)
    write_markdown,
)

RESULT = "SCALING_RESULT "
LOOPS = ("trainer", "raw")
# What the issue asks of the trainer (docs/speed.md, "Speed").
GOAL_RATIO, GOAL_STARTUP_S, GOAL_EFFICIENCY_SHARE = 0.97, 1.0, 0.95


@dataclass(frozen=True)
class Setup:
    """A device set: its name, how many devices share the work, and how it is launched."""

    name: str
    devices: int  # processes, GPUs or threads the work is spread over
    mode: str  # the trainer's --multi-gpu: none, ddp or dp
    nproc: int = 1  # processes (torchrun when more than 1)
    threads: int = 1  # OMP_NUM_THREADS per process


def setups(gpus: int, max_devices: int | None = None) -> list[Setup]:
    """The device sets to measure, the one-device set first (at most `max_devices` devices each)."""
    return [setup for setup in all_setups(gpus) if max_devices is None or setup.devices <= max_devices]


def all_setups(gpus: int) -> list[Setup]:
    if not gpus:
        return [
            Setup("1 process", 1, "none"),
            Setup("1 process, 2 threads", 2, "none", threads=2),
            Setup("DDP, 2 processes", 2, "ddp", nproc=2),
        ]
    counts = sorted({n for n in (2, 4, 8, 16, 32) if n < gpus} | {gpus} - {1})
    return (
        [Setup("1 GPU", 1, "none")]
        + [Setup(f"DDP, {n} GPUs", n, "ddp", nproc=n) for n in counts]
        + ([Setup(f"DataParallel, {gpus} GPUs", gpus, "dp")] if gpus > 1 else [])
    )


# ---------------------------------------------------------------------------- inside the launched processes
def first_step_clock(optimizer: Any) -> dict[str, float]:
    """Records the wall-clock time at which `optimizer` finished its first step (the GPU's work included)."""
    import torch

    seen: dict[str, float] = {}

    def hook(*_: Any) -> None:
        if "first_step" not in seen:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # once, at the first step
            seen["first_step"] = time.time()

    optimizer.register_step_post_hook(hook)
    return seen


def process_batch(args: argparse.Namespace) -> int:
    """The batch one process's loop is given: a device's batch, or every thread's when one process's threads
    are the devices (weak scaling: each device, thread or GPU, always gets --batch samples per step)."""
    return args.batch * args.devices if args.mode == "none" else args.batch


def run_trainer(args: argparse.Namespace, devices: int) -> dict[str, float]:
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    config = TrainConfig(
        multi_gpu=args.mode,
        epochs=1,
        batch_size=process_batch(args),
        lr=1e-3,
        lr_schedule="constant",
        log_every=args.log_every,
        num_workers=0,
        progress=False,
        save_dir=tempfile.mkdtemp(),
    )
    with MultiGPUTrainer(make_cnn(), make_images(args.steps * args.batch * devices), None, config) as trainer:
        seen = first_step_clock(trainer.optimizer)
        trainer.fit()
        if not trainer.runtime.is_main:
            return {}  # rank 0 logs and reports
    return {"samples_per_sec": steady(logged_rates(os.path.join(config.save_dir, "tb"))), **seen}


def run_raw(args: argparse.Namespace, devices: int) -> dict[str, float]:
    """What a careful user writes by hand: DDP (or DataParallel), AdamW, pinned memory on CUDA, a host sync
    every log_every steps."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    cuda = torch.cuda.is_available()
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    model = make_cnn().to(device)
    if args.mode == "ddp":
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    elif args.mode == "dp":
        model = torch.nn.DataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = first_step_clock(optimizer)
    data = make_images(args.steps * args.batch * devices)
    world = dist.get_world_size() if args.mode == "ddp" else 1
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(
        data,
        batch_size=process_batch(args) * (devices if args.mode == "dp" else 1),
        sampler=sampler,
        pin_memory=cuda,
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    boundaries = [time.perf_counter()]
    for step, (inputs, targets) in enumerate(loader, start=1):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0:
            loss.item()  # the host waits for the device here only, as at the trainer's sync points
            boundaries.append(time.perf_counter())
    if args.mode == "ddp":
        dist.destroy_process_group()
    samples = args.log_every * args.batch * devices  # per logging interval
    return {
        "samples_per_sec": steady(
            [samples / (end - start) for start, end in zip(boundaries, boundaries[1:])]
        ),
        **seen,
    }


def worker(args: argparse.Namespace) -> None:
    result = (run_trainer if args.worker == "trainer" else run_raw)(args, args.devices)
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- the parent
def launch(args: argparse.Namespace, setup: Setup, loop: str) -> dict[str, float]:
    """Run one loop on one device set in fresh processes; its samples/s and seconds to the first step."""
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        loop,
        "--mode",
        setup.mode,
        "--devices",
        str(setup.devices),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--log-every",
        str(args.log_every),
    ]
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={setup.nproc}"]
        if setup.nproc > 1
        else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads), "PYTHONUNBUFFERED": "1"}
    launched = time.time()
    result = subprocess.run(
        [sys.executable, *launcher, *script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
    if result.returncode != 0 or not lines:
        raise SystemExit(
            f"{loop} on {setup.name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
        )
    figures = json.loads(lines[-1][len(RESULT) :])
    return {"samples_per_sec": figures["samples_per_sec"], "startup_s": figures["first_step"] - launched}


def measure(args: argparse.Namespace, sets: Sequence[Setup]) -> dict[tuple[str, str], list[dict[str, float]]]:
    runs = [(setup, loop) for setup in sets for loop in LOOPS]
    results: dict[tuple[str, str], list[dict[str, float]]] = {(s.name, loop): [] for s, loop in runs}
    for round_index in range(args.rounds):
        for setup, loop in runs if round_index % 2 == 0 else runs[::-1]:
            figures = launch(args, setup, loop)
            results[(setup.name, loop)].append(figures)
            print(
                f"round {round_index + 1}: {setup.name}, {loop}: {figures['samples_per_sec']:.0f} samples/s, "
                f"first step after {figures['startup_s']:.2f} s",
                flush=True,
            )
    return results


def table(
    sets: Sequence[Setup], results: dict[tuple[str, str], list[dict[str, float]]]
) -> list[dict[str, Any]]:
    """Medians per device set and loop, with speed-up and efficiency against the first (one-device) set."""

    def median(name: str, loop: str, key: str) -> float:
        return statistics.median(figures[key] for figures in results[(name, loop)])

    one = {loop: median(sets[0].name, loop, "samples_per_sec") for loop in LOOPS}
    rows = []
    for setup in sets:
        row: dict[str, Any] = {"setup": setup.name, "devices": setup.devices}
        for loop in LOOPS:
            rate = median(setup.name, loop, "samples_per_sec")
            row[f"{loop}_samples_per_sec"] = rate
            row[f"{loop}_speedup"] = rate / one[loop]
            row[f"{loop}_efficiency"] = rate / (setup.devices * one[loop])
            row[f"{loop}_startup_s"] = median(setup.name, loop, "startup_s")
        row["ratio"] = row["trainer_samples_per_sec"] / row["raw_samples_per_sec"]
        rows.append(row)
    return rows


HEADER = [
    "device set",
    "devices",
    "trainer samples/s",
    "raw samples/s",
    "trainer/raw",
    "speed-up trainer (raw)",
    "efficiency trainer (raw)",
    "first step s trainer (raw)",
]


def cells(row: dict[str, Any]) -> list[str]:
    return [
        row["setup"],
        str(row["devices"]),
        f"{row['trainer_samples_per_sec']:.0f}",
        f"{row['raw_samples_per_sec']:.0f}",
        f"{row['ratio']:.3f}",
        f"{row['trainer_speedup']:.2f} ({row['raw_speedup']:.2f})",
        f"{row['trainer_efficiency']:.0%} ({row['raw_efficiency']:.0%})",
        f"{row['trainer_startup_s']:.2f} ({row['raw_startup_s']:.2f})",
    ]


def goals(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each goal of the issue, met or not, in words."""
    lines = []
    for row in rows:
        met = row["ratio"] >= GOAL_RATIO and row["trainer_startup_s"] <= row["raw_startup_s"] + GOAL_STARTUP_S
        lines.append(
            f"{row['setup']}: trainer/raw {row['ratio']:.3f} (goal >= {GOAL_RATIO}), first step "
            f"{row['trainer_startup_s'] - row['raw_startup_s']:+.2f} s vs raw (goal <= +{GOAL_STARTUP_S:g} s)"
            f"{'' if met else ' - NOT MET'}"
        )
    for row in rows[1:]:
        share = row["trainer_efficiency"] / row["raw_efficiency"]
        lines.append(
            f"{row['setup']}: trainer's scaling efficiency {share:.3f} x the raw loop's (goal >= "
            f"{GOAL_EFFICIENCY_SHARE}){'' if share >= GOAL_EFFICIENCY_SHARE else ' - NOT MET'}"
        )
    return lines


def plot(rows: Sequence[dict[str, Any]], caption: str, path: Path) -> None:
    """A grouped bar chart of samples/s per device set (trainer and raw loop), speed-ups above the bars, with
    Pillow (a torchvision dependency) so the benchmark needs nothing else."""
    from PIL import Image, ImageDraw, ImageFont

    width, height, left, bottom, top = 180 * len(rows) + 160, 560, 90, 470, 70
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=12)
    draw.text(
        (left, 12), "Training throughput as devices are added (higher is better)", fill="black", font=font
    )
    draw.text((left, 34), caption, fill="dimgray", font=small)
    peak = max(max(row["trainer_samples_per_sec"], row["raw_samples_per_sec"]) for row in rows) * 1.15
    draw.line([(left, top), (left, bottom), (width - 30, bottom)], fill="black")
    for tick in range(6):
        value, y = peak * tick / 5, bottom - (bottom - top) * tick / 5
        draw.line([(left - 5, y), (left, y)], fill="black")
        draw.text((left - 8, y), f"{value:.0f}", fill="black", font=small, anchor="rm")
    draw.text((12, top - 24), "samples/s", fill="black", font=small)
    colours = {"trainer": (31, 119, 180), "raw": (255, 127, 14)}
    for index, row in enumerate(rows):
        x0 = left + 40 + index * 180
        for offset, loop in enumerate(LOOPS):
            rate = row[f"{loop}_samples_per_sec"]
            x, y = x0 + offset * 60, bottom - (bottom - top) * rate / peak
            draw.rectangle([x, y, x + 55, bottom], fill=colours[loop])
            draw.text(
                (x + 27, y - 4), f"x{row[f'{loop}_speedup']:.2f}", fill="black", font=small, anchor="mb"
            )
        draw.text((x0 + 58, bottom + 8), row["setup"], fill="black", font=small, anchor="mt")
        draw.text(
            (x0 + 58, bottom + 24), f"trainer/raw {row['ratio']:.3f}", fill="dimgray", font=small, anchor="mt"
        )
    for offset, loop in enumerate(LOOPS):
        x = width - 250 + offset * 120
        draw.rectangle([x, 60, x + 14, 74], fill=colours[loop])
        draw.text(
            (x + 20, 67),
            "MultiGPUTrainer" if loop == "trainer" else "hand-written",
            fill="black",
            font=small,
            anchor="lm",
        )
    image.save(path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=5,
        steps=40,
        batch=64,
        log_every=8,
        batch_help="samples per device per step",
        output_help="the Markdown table (default: benchmarks/results/scaling_<cpu|gpu>.md); "
        "CSV, PNG and JSON beside it",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument(
        "--max-devices", type=int, help="measure only the device sets of at most this many devices"
    )
    parser.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sets = setups(gpus, args.max_devices)
    output = Path(args.output or HERE / "results" / f"scaling_{'gpu' if gpus else 'cpu'}.md")
    load_before = os.getloadavg()[0]
    rows = table(sets, measure(args, sets))
    load_after = os.getloadavg()[0]
    machine = machine_line()
    notes = [
        machine,
        f"cnn on 1x28x28 synthetic images, batch {args.batch} per device, {args.steps} steps per run, "
        f"medians of {args.rounds} alternating rounds; samples/s over every --log-every {args.log_every} "
        f"interval but the first; load average {load_before:.2f} before, {load_after:.2f} after",
        *goals(rows),
    ]
    write_markdown(
        output, "Scaling: trainer vs hand-written loop", HEADER, [cells(row) for row in rows], notes
    )
    plot(rows, machine, output.with_suffix(".png"))
    output.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")  # the figures, unrounded
    print(f"written: {output.with_suffix('.png')} and {output.with_suffix('.json')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
