"""Benchmark: when is splitting a batch over devices worth it? Prediction time per batch on each device set.

    python benchmarks/inference_scaling.py                         # writes inference_scaling.md and .png
    python benchmarks/inference_scaling.py --model resnet18 --image-shape 3,32,32 --output /tmp/scaling.md

For each batch size (powers of 2 from 1 to 2048 by default) it times one
forward pass of the same model on the same inputs, on every device set there
is: the CPU with 1 thread and with all its threads; BatchParallel over CPU
replicas (threads) and DDP over CPU processes (gloo, 1 thread each); and with
CUDA, 1 GPU, then BatchParallel and DDP over every GPU. DDP is each rank
running its contiguous share of the batch, then a fixed-size all_gather that
puts the outputs back in order on rank 0, timed on rank 0 from a barrier.
Each figure is the fastest of several timed runs after a warm-up.

Columns: milliseconds per batch, samples/s, speed-up against the CPU with all
threads and against one device of the same kind, and the correctness check:
max |difference| of the outputs against that one device (1e-6 for a split on
one kind of device, 1e-4 between the CPU and a GPU, fp32, TF32 off). The
crossover is where a split set starts to beat its one device: the smallest
measured batch at which it is faster there and at the next measured batch (the
rule of BatchParallel's min_per_device="auto"). Writes a Markdown table and a
PNG plot (samples/s against batch size, one line per device set), the machine,
torch version and date in their captions (docs/prediction.md, "Prediction").
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402  (after the path set-up)

from multigpu.loop.inference import BatchParallel, chunk_sizes, crossover  # noqa: E402
from multigpu.models import build_model  # noqa: E402

SPLIT_TOLERANCE, CROSS_DEVICE_TOLERANCE = 1e-6, 1e-4
CLASSES = 10
MIN_SECONDS = 0.3  # timed runs continue until this much time has passed (or --repeats runs, at least 3)
RESULT = "INFERENCE_SCALING_RESULT "


@dataclass
class Point:
    """One device set at one batch size: the seconds per batch and the correctness check."""

    batch: int
    seconds: float
    max_difference: float | None = None
    tolerance: float | None = None


@dataclass
class Series:
    """One device set: its name, what it is compared with, and its measured points."""

    name: str
    kind: str  # "cpu" or "gpu"
    single: bool  # one device (False: a split over several)
    points: dict[int, Point] = field(default_factory=dict)


# ---------------------------------------------------------------------------- measuring
def make_model(name: str, shape: tuple[int, ...], device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights in every process
    return build_model(name, shape, CLASSES).to(device).eval()


def make_inputs(batch: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(batch))


def synchronize() -> None:
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


@torch.no_grad()
def fastest_seconds(run: Callable[[], Any], repeats: int) -> float:
    """The shortest wall time of `run()` over at least 3 and at most `repeats` timed runs, after a warm-up:
    on a shared machine other jobs only ever add time, so the fastest run is the least disturbed one."""
    run()
    synchronize()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 3 or (len(times) < repeats and time.perf_counter() - started < MIN_SECONDS):
        before = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - before)
    return min(times)


def max_difference(outputs: torch.Tensor, reference: torch.Tensor) -> float:
    return (outputs.double().cpu() - reference.double().cpu()).abs().max().item()


def measure(
    series: Series,
    run: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    reference: dict[int, torch.Tensor] | None,
    tolerance: float | None,
    args: argparse.Namespace,
    keep: dict[int, torch.Tensor] | None = None,
) -> Series:
    """Time `run(inputs on device)` at every batch size (a split set: those it can split); compare its outputs
    with `reference`'s."""
    for batch in args.batch_sizes:
        if isinstance(run, BatchParallel) and batch < len(run.devices):
            continue
        inputs = make_inputs(batch, args.shape).to(device)
        with torch.no_grad():
            outputs = run(inputs)
        if isinstance(run, BatchParallel) and run.last_path != "split":
            raise RuntimeError(
                f"BatchParallel ran batch {batch} on one device: this row would not measure a split"
            )
        point = Point(batch, fastest_seconds(lambda: run(inputs), args.repeats))
        if reference is not None:
            point.max_difference, point.tolerance = max_difference(outputs, reference[batch]), tolerance
        if keep is not None:
            keep[batch] = outputs.cpu()
        series.points[batch] = point
        print(f"{series.name}, batch {batch}: {1000 * point.seconds:.3f} ms", file=sys.stderr, flush=True)
    return series


def cpu_series(args: argparse.Namespace) -> tuple[list[Series], dict[int, torch.Tensor]]:
    """The CPU rows, and the CPU's outputs with all threads (what the other rows are compared with)."""
    cpu, threads = torch.device("cpu"), len(os.sched_getaffinity(0))
    model = make_model(args.model, args.shape, cpu)
    all_threads: dict[int, torch.Tensor] = {}
    torch.set_num_threads(threads)
    rows = [
        measure(
            Series(f"CPU, {threads} threads", "cpu", True), model, cpu, None, None, args, keep=all_threads
        )
    ]
    torch.set_num_threads(1)
    rows.insert(
        0, measure(Series("CPU, 1 thread", "cpu", True), model, cpu, all_threads, SPLIT_TOLERANCE, args)
    )
    torch.set_num_threads(threads)
    if args.cpu_replicas >= 2:
        parallel = BatchParallel(model, ["cpu"] * args.cpu_replicas, min_per_device=1)
        rows.append(
            measure(
                Series(f"CPU BatchParallel, {args.cpu_replicas} replicas (threads)", "cpu", False),
                parallel,
                cpu,
                all_threads,
                SPLIT_TOLERANCE,
                args,
            )
        )
    if args.cpu_processes >= 2:
        rows.append(
            ddp_series(
                args,
                args.cpu_processes,
                "cpu",
                f"CPU DDP, {args.cpu_processes} processes (gloo, 1 thread each)",
            )
        )
    return rows, all_threads


def gpu_series(args: argparse.Namespace, cpu_reference: dict[int, torch.Tensor]) -> list[Series]:
    gpus = torch.cuda.device_count()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
        False  # fp32 as the CPU computes it
    )
    device = torch.device("cuda", 0)
    model = make_model(args.model, args.shape, device)
    one_gpu: dict[int, torch.Tensor] = {}
    rows = [
        measure(
            Series(f"1 GPU ({torch.cuda.get_device_name(0)})", "gpu", True),
            model,
            device,
            cpu_reference,
            CROSS_DEVICE_TOLERANCE,
            args,
            keep=one_gpu,
        )
    ]
    if gpus >= 2:
        parallel = BatchParallel(model, list(range(gpus)), min_per_device=1)
        rows.append(
            measure(
                Series(f"{gpus} GPUs BatchParallel", "gpu", False),
                parallel,
                device,
                one_gpu,
                SPLIT_TOLERANCE,
                args,
            )
        )
        rows.append(ddp_series(args, gpus, "gpu", f"{gpus} GPUs DDP (NCCL)"))
    return rows


# ---------------------------------------------------------------------------- DDP: a worker under torchrun
def ddp_series(args: argparse.Namespace, nproc: int, kind: str, name: str) -> Series:
    """Run this script's DDP worker under torchrun with `nproc` processes; its rank 0 reports the figures."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(Path(__file__).resolve()),
        "--ddp-worker",
        "--model",
        args.model,
        "--image-shape",
        ",".join(map(str, args.shape)),
        "--batch-sizes",
        ",".join(map(str, args.batch_sizes)),
        "--repeats",
        str(args.repeats),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kind == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(
            f"the DDP worker failed (exit {result.returncode}): {result.stderr.strip()[-500:]}"
        )
    series = Series(name, kind, False)
    for raw in json.loads(lines[-1][len(RESULT) :]):
        series.points[raw["batch"]] = Point(**raw)
        print(f"{name}, batch {raw['batch']}: {1000 * raw['seconds']:.3f} ms", file=sys.stderr, flush=True)
    return series


def ddp_worker(args: argparse.Namespace) -> None:
    """Each rank: its contiguous share of the batch, forward, then a fixed-size all_gather (padded to the
    largest share, trimmed on rank 0), so rank 0 holds the whole batch's outputs in order. Rank 0 compares
    them with the whole batch on its own device."""
    import torch.distributed as dist

    from multigpu.config import TrainConfig
    from multigpu.parallel.distributed import setup, teardown

    runtime = setup(TrainConfig(multi_gpu="ddp", dist_timeout=args.timeout))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = make_model(args.model, args.shape, runtime.device)
    points = []
    for batch in args.batch_sizes:
        if batch < runtime.world_size:
            continue  # not every rank would have a sample
        sizes = chunk_sizes(batch, runtime.world_size)
        inputs = make_inputs(batch, args.shape).split(sizes)[runtime.rank].to(runtime.device)

        def split_and_gather() -> torch.Tensor:
            mine = model(inputs)
            padded = torch.zeros(sizes[0], *mine.shape[1:], dtype=mine.dtype, device=mine.device)
            padded[: len(mine)] = mine
            parts = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(parts, padded)
            return torch.cat([part[:size] for part, size in zip(parts, sizes)])

        def timed() -> None:
            dist.barrier()
            split_and_gather()

        with torch.no_grad():
            outputs = split_and_gather()
            seconds = fastest_seconds(timed, args.repeats)
            if runtime.is_main:
                whole = model(make_inputs(batch, args.shape).to(runtime.device))
                points.append(
                    {
                        "batch": batch,
                        "seconds": seconds,
                        "max_difference": max_difference(outputs, whole),
                        "tolerance": SPLIT_TOLERANCE,
                    }
                )
    if runtime.is_main:
        print(RESULT + json.dumps(points), flush=True)
    teardown()


# ---------------------------------------------------------------------------- the table and the plot
def crossover_text(split: Series, single: Series) -> str:
    """multigpu.loop.inference.crossover (the rule BatchParallel's "auto" uses) of the measured times."""
    batches = sorted(set(split.points) & set(single.points))
    found = crossover(batches, [split.points[b].seconds < single.points[b].seconds for b in batches])
    return (
        f"batch {found}"
        if found is not None
        else f"never up to batch {batches[-1]}"
        if batches
        else "not measured"
    )


def one_device_of(series: Series, rows: Sequence[Series]) -> Series | None:
    """The one device a split set is compared with: the CPU with all threads, or 1 GPU."""
    singles = [row for row in rows if row.kind == series.kind and row.single]
    return singles[-1] if singles else None


def markdown(rows: Sequence[Series], caption: str) -> str:
    cpu = next(row for row in rows if row.kind == "cpu" and row.single and "1 thread" not in row.name)
    lines = [
        caption,
        "",
        "| device set | batch | ms / batch | samples/s | vs CPU | vs 1 device | max \\|diff\\| | ok |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for row in rows:
        single = one_device_of(row, rows)
        for batch, point in sorted(row.points.items()):
            vs_cpu = (
                cpu.points[batch].seconds / point.seconds if row is not cpu and batch in cpu.points else None
            )
            vs_one = (
                single.points[batch].seconds / point.seconds
                if not row.single and single is not None and batch in single.points
                else None
            )
            ok = (
                ""
                if point.max_difference is None
                else "✓"
                if point.max_difference <= point.tolerance
                else "✗"
            )
            difference = (
                "" if point.max_difference is None else f"{point.max_difference:.2g} (≤ {point.tolerance:g})"
            )
            lines.append(
                f"| {row.name} | {batch} | {1000 * point.seconds:.3f} | {batch / point.seconds:,.0f} | "
                f"{'' if vs_cpu is None else f'{vs_cpu:.2f}x'} | {'' if vs_one is None else f'{vs_one:.2f}x'} "
                f"| {difference} | {ok} |"
            )
    lines.append("")
    for row in rows:
        single = one_device_of(row, rows)
        if not row.single and single is not None:
            lines.append(f"- crossover, {row.name} against {single.name}: {crossover_text(row, single)}")
    return "\n".join(lines) + "\n"


COLOURS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
]


def plot(rows: Sequence[Series], caption: str, path: Path) -> None:
    """samples/s against batch size, both on log scales, one line per device set, with a legend (Pillow)."""
    from PIL import Image, ImageDraw, ImageFont

    width, height, left, right, top, bottom = 1000, 640, 90, 30, 40, 130
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    points = [(batch, batch / point.seconds) for row in rows for batch, point in row.points.items()]
    x_low, x_high = math.log2(min(b for b, _ in points)), math.log2(max(b for b, _ in points))
    y_low, y_high = (
        math.floor(math.log10(min(r for _, r in points))),
        math.ceil(math.log10(max(r for _, r in points))),
    )
    x_high, y_high = max(x_high, x_low + 1), max(y_high, y_low + 1)

    def at(batch: float, rate: float) -> tuple[float, float]:
        x = left + (math.log2(batch) - x_low) / (x_high - x_low) * (width - left - right)
        y = height - bottom - (math.log10(rate) - y_low) / (y_high - y_low) * (height - top - bottom)
        return x, y

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for batch in sorted({b for b, _ in points}):
        x, _ = at(batch, 10**y_low)
        draw.line([x, height - bottom, x, height - bottom + 5], fill="black")
        draw.text((x, height - bottom + 8), str(batch), fill="black", font=font, anchor="mt")
    for decade in range(y_low, y_high + 1):
        _, y = at(2**x_low, 10**decade)
        draw.line([left, y, width - right, y], fill=(225, 225, 225))
        draw.text((left - 8, y), f"{10**decade:,}", fill="black", font=font, anchor="rm")
    draw.text(
        ((left + width - right) / 2, height - bottom + 30),
        "batch size (samples)",
        fill="black",
        font=font,
        anchor="mt",
    )
    draw.text((10, top - 25), "samples/s (log scale)", fill="black", font=font)
    for index, row in enumerate(rows):
        colour = COLOURS[index % len(COLOURS)]
        line = [at(batch, batch / point.seconds) for batch, point in sorted(row.points.items())]
        if len(line) > 1:
            draw.line(line, fill=colour, width=3)
        for x, y in line:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        legend_y = top + 10 + 20 * index
        draw.line([left + 15, legend_y, left + 40, legend_y], fill=colour, width=3)
        draw.text((left + 48, legend_y), row.name, fill="black", font=font, anchor="lm")
    for number, text in enumerate(caption_lines(caption, 130)):
        draw.text((10, height - bottom + 55 + 18 * number), text, fill="black", font=font)
    image.save(path)


def caption_lines(text: str, width: int) -> list[str]:
    lines, current = [], ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}".strip()
    return lines + [current]


def machine() -> str:
    """The CPU's model name and core count, the GPUs, and the load when the run started (a shared machine)."""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    text = f"{cpu}, {len(os.sched_getaffinity(0))} cores"
    if torch.cuda.is_available():
        text += f"; {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return text + f"; load average {os.getloadavg()[0]:.1f} at the start"


# ---------------------------------------------------------------------------- command line
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default="cnn", choices=["mlp", "cnn", "resnet18", "resnet50"])
    parser.add_argument("--image-shape", default="1,28,28", help="C,H,W of the inputs (flattened for mlp)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=10, help="at most this many timed runs per figure")
    parser.add_argument(
        "--cpu-replicas", type=int, default=2, help="BatchParallel's CPU replicas (0: no row)"
    )
    parser.add_argument("--cpu-processes", type=int, default=2, help="DDP's CPU processes (0: no row)")
    parser.add_argument(
        "--output", default="inference_scaling.md", help="the Markdown table; the plot goes beside it as .png"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a DDP worker may take")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dims = tuple(int(part) for part in args.image_shape.split(","))
    args.shape = (math.prod(dims),) if args.model == "mlp" else dims
    args.batch_sizes = sorted(int(part) for part in args.batch_sizes.split(","))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ddp_worker:
        ddp_worker(args)
        return 0
    started = time.monotonic()
    description = machine()
    rows, cpu_outputs = cpu_series(args)
    if torch.cuda.is_available():
        rows += gpu_series(args, cpu_outputs)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    caption = (
        f"Prediction time per batch, {args.model} on {'x'.join(map(str, args.shape))} inputs, fp32: "
        f"{description}; torch {torch.__version__}; {date}; {time.monotonic() - started:.0f} s in all."
    )
    table = markdown(rows, caption)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(table)
    plot(rows, caption, output.with_suffix(".png"))
    print(table, end="")
    print(f"written: {output} and {output.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
