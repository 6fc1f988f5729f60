"""Benchmark: the trainer's per-step cost over a plain loop, where Python dominates.

    python benchmarks/step_overhead.py [--rounds 15] [--steps 2000] [--output benchmarks/results/step_overhead.md]
    python benchmarks/step_overhead.py --instructions   # instructions per step under valgrind: load-proof
    python benchmarks/step_overhead.py --instructions --hang-timeout 0   # the same without the hang watchdog

A tiny MLP with batch 16 in one process on one thread: each step computes
little, so whatever the trainer does per step in Python shows. The plain loop
has the same model, data, loader, optimizer (AdamW) and LR schedule (the
built-in warm-up/cosine LambdaLR); both run in this process, alternating which
goes first each round. A loop's cost per step is the time of a long run less
that of a short one, over the steps between them, so start-up and the end (the
trainer's checkpoint) cancel out and every per-step cost counts, the trainer's
logging at --log-every steps included. Wall time and CPU time (which other
processes on a shared machine do not inflate) are both shown, as medians over
the rounds. Goal: the trainer's main thread at most 3% more instructions per
step than the plain loop's, under --instructions (docs/speed.md, "Speed").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import benchmark_parser, machine_line, write_markdown  # noqa: E402  (after the path set-up)

from multigpu.config import TrainConfig  # noqa: E402
from multigpu.data import build_loader  # noqa: E402
from multigpu.data.sampler import ResumableDistributedSampler  # noqa: E402
from multigpu.loop.optim import build_scheduler  # noqa: E402

INPUTS, HIDDEN, CLASSES = 32, 64, 10


def make_data(samples: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(samples, INPUTS, generator=generator),
        torch.randint(CLASSES, (samples,), generator=generator),
    )


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
    )


def config(args: argparse.Namespace, save_dir: str) -> TrainConfig:
    return TrainConfig(
        multi_gpu="none",
        epochs=1,
        batch_size=args.batch,
        lr=1e-3,
        log_every=args.log_every,
        num_workers=0,
        progress=False,
        save_dir=save_dir,
        hang_timeout=args.hang_timeout,
        data_on_device=args.data_on_device,
    )


def run_trainer(args: argparse.Namespace, data: torch.utils.data.Dataset) -> None:
    """fit() on `data` (quiet): the whole run, start-up, loop and final checkpoint."""
    from train_multi_gpu import MultiGPUTrainer

    with tempfile.TemporaryDirectory() as save_dir, contextlib.redirect_stdout(io.StringIO()):
        trainer = MultiGPUTrainer(make_model(), data, None, config(args, save_dir))
        with trainer:
            trainer.fit()


def run_plain(args: argparse.Namespace, data: torch.utils.data.Dataset) -> None:
    """What a careful user writes: the same loader, AdamW, the same LR schedule, a host sync every log_every."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = build_scheduler(optimizer, config(args, ""), len(data) // args.batch)
    loader = build_loader(
        data, torch.device("cpu"), 0, sampler=ResumableDistributedSampler(len(data)), batch_size=args.batch
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    for step, (inputs, targets) in enumerate(loader, start=1):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % args.log_every == 0:
            loss.item()


def step_cost(
    run: Callable, args: argparse.Namespace, short: torch.utils.data.Dataset, long: torch.utils.data.Dataset
) -> tuple[float, float]:
    """(wall, CPU) seconds per step: the long run's time less the short run's, over the steps between them,
    so start-up and the end (the trainer's checkpoint, the loader's set-up) cancel out."""
    times = []
    for data in (short, long):
        wall, cpu = time.perf_counter(), time.process_time()
        run(args, data)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    steps = (len(long) - len(short)) // args.batch
    return (times[1][0] - times[0][0]) / steps, (times[1][1] - times[0][1]) / steps


def timed(args: argparse.Namespace) -> tuple[list[list[str]], list[str]]:
    """Alternating rounds in this process: per-step wall and CPU time of each loop."""
    torch.set_num_threads(1)
    short, long = make_data(args.steps // 10 * args.batch), make_data(args.steps * args.batch)
    for run in RUNS.values():  # warm-up: imports, allocator, first-call costs
        run(args, short)
    costs: dict[str, list[tuple[float, float]]] = {name: [] for name in RUNS}
    load_before = os.getloadavg()[0]
    for round_index in range(args.rounds):
        for name in list(RUNS) if round_index % 2 == 0 else list(reversed(RUNS)):
            costs[name].append(step_cost(RUNS[name], args, short, long))
        print(
            f"round {round_index + 1}: "
            + ", ".join(
                f"{name} {1e6 * costs[name][-1][0]:.1f} us/step wall, {1e6 * costs[name][-1][1]:.1f} CPU"
                for name in RUNS
            ),
            flush=True,
        )
    load_after = os.getloadavg()[0]
    medians = {name: [statistics.median(cost[i] for cost in costs[name]) for i in (0, 1)] for name in RUNS}
    fastest = {name: [min(cost[i] for cost in costs[name]) for i in (0, 1)] for name in RUNS}
    rows = [
        [
            name,
            f"{1e6 * wall:.1f}",
            f"{1e6 * cpu:.1f}",
            f"{1e6 * fastest[name][0]:.1f}",
            f"{1e6 * fastest[name][1]:.1f}",
        ]
        for name, (wall, cpu) in medians.items()
    ]
    # Each round's trainer run is paired with its plain run: load that changes between rounds hits both.
    paired = [
        statistics.median(1e6 * (t[i] - p[i]) for t, p in zip(costs["trainer"], costs["plain loop"]))
        for i in (0, 1)
    ]
    rows.append(
        [
            "trainer - plain loop",
            f"{paired[0]:+.1f}",
            f"{paired[1]:+.1f}",
            f"{1e6 * (fastest['trainer'][0] - fastest['plain loop'][0]):+.1f}",
            f"{1e6 * (fastest['trainer'][1] - fastest['plain loop'][1]):+.1f}",
        ]
    )
    ratio = medians["plain loop"][0] / medians["trainer"][0]
    header = ["loop", "us/step wall (median)", "CPU (median)", "wall (fastest)", "CPU (fastest)"]
    notes = [
        f"medians of {args.rounds} alternating rounds; the difference row: the median of each round's trainer - "
        f"plain (the two ran back to back), and the difference of the fastest runs (the least disturbed by "
        f"other work); trainer/plain samples/s {ratio:.3f} (medians)",
        f"load average {load_before:.2f} before, {load_after:.2f} after (the machine is shared: CPU time is "
        f"what waiting for other processes does not inflate)",
    ]
    return [header, *rows], notes


def counted(args: argparse.Namespace) -> tuple[list[list[str]], list[str]]:
    """Instructions per step under valgrind's callgrind: exact, whatever else the machine runs.

    The main thread's count is the per-step cost. The trainer's other threads (the hang watchdog, the
    save-dir heartbeat) wake on wall-clock time, which valgrind stretches some fifty-fold, and how far it
    stretches changes with the machine's load: counted in with the steps they made the total move by about
    35,000 instructions per step from run to run. They are shown on a row of their own.
    """
    per_step: dict[str, tuple[float, float]] = {}  # (main thread, other threads)
    for name in RUNS:
        totals = []
        for steps in (args.steps // 10, args.steps):
            with tempfile.TemporaryDirectory() as folder:
                out = os.path.join(folder, "callgrind.out")
                subprocess.run(
                    [
                        "valgrind",
                        "--tool=callgrind",
                        "--separate-threads=yes",
                        f"--callgrind-out-file={out}",
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--one-run",
                        name,
                        "--steps",
                        str(steps),
                        "--batch",
                        str(args.batch),
                        "--log-every",
                        str(args.log_every),
                        "--data-on-device",
                        args.data_on_device,
                        *(
                            ["--hang-timeout", str(args.hang_timeout)]
                            if args.hang_timeout is not None
                            else []
                        ),
                    ],
                    check=True,
                    capture_output=True,
                    env={**os.environ, "PYTHONHASHSEED": "0"},
                )
                totals.append(thread_instructions(folder))
        span = args.steps - args.steps // 10
        per_step[name] = ((totals[1][0] - totals[0][0]) / span, (totals[1][1] - totals[0][1]) / span)
        print(
            f"{name}: {per_step[name][0]:,.0f} instructions per step in the main thread, "
            f"{per_step[name][1]:,.0f} in other threads",
            flush=True,
        )
    trainer, plain = per_step["trainer"][0], per_step["plain loop"][0]
    rows = [
        ["loop", "instructions per step (main thread)"],
        ["trainer", f"{trainer:,.0f}"],
        ["plain loop", f"{plain:,.0f}"],
        ["trainer - plain loop", f"{trainer - plain:+,.0f} ({(trainer - plain) / plain:+.1%})"],
        ["trainer's other threads (per step under valgrind, time-driven)", f"{per_step['trainer'][1]:,.0f}"],
    ]
    return rows, [
        "instructions counted by valgrind --tool=callgrind --separate-threads=yes (the runs' difference, "
        "so start-up cancels); the main thread's are the steps' cost. The other threads wake on wall-clock "
        "time, which valgrind stretches, so their row follows the slow-down, not the steps"
    ]


def thread_instructions(folder: str) -> tuple[int, int]:
    """(main thread, all other threads) instructions from callgrind's per-thread files in `folder`."""
    counts = {}
    for path in Path(folder).glob("callgrind.out-*"):
        text = path.read_text()
        counts[int(re.search(r"^thread: (\d+)", text, re.M).group(1))] = int(
            re.search(r"^summary: (\d+)", text, re.M).group(1)
        )
    return counts.pop(1), sum(counts.values())


RUNS = {"trainer": run_trainer, "plain loop": run_plain}


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__,
        rounds=15,
        steps=2000,
        batch=16,
        log_every=50,
        steps_help="optimizer steps of the long run (the short: 1/10)",
        output_help="default: benchmarks/results/step_overhead[_instructions].md",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per step with valgrind instead of timing (minutes; load-proof)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="the trainer's --hang-timeout (default: its own, the watchdog on; 0: off)",
    )
    parser.add_argument(
        "--data-on-device",
        choices=("auto", "on", "off"),
        default="auto",
        help="the trainer's --data-on-device (default: its own, auto; off: through a DataLoader as "
        "the plain loop)",
    )
    parser.add_argument("--one-run", choices=RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_run:
        torch.set_num_threads(1)
        RUNS[args.one_run](args, make_data(args.steps * args.batch))
        return 0
    table, notes = counted(args) if args.instructions else timed(args)
    watchdog = "hang watchdog off" if args.hang_timeout == 0 else "hang watchdog on"
    setting = (
        f"tiny MLP {INPUTS}-{HIDDEN}-{CLASSES}, batch {args.batch}, 1 thread, --log-every {args.log_every}, "
        f"{watchdog}, trainer's --data-on-device {args.data_on_device}; "
        f"per-step cost = (run of {args.steps} steps - run of {args.steps // 10}) / "
        f"{args.steps - args.steps // 10}"
    )
    output = Path(
        args.output
        or REPO / "benchmarks" / "results" / f"step_overhead{'_instructions' if args.instructions else ''}.md"
    )
    write_markdown(
        output,
        "Per-step overhead: trainer vs plain loop",
        table[0],
        table[1:],
        [machine_line(), setting, *notes],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
