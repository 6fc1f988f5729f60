"""What the benchmarks share: their common flags, the machine they ran on, and writing their tables (Markdown and
CSV)."""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable


def benchmark_parser(
    description: str | None,
    *,
    rounds: int,
    steps: int,
    batch: int,
    log_every: int,
    steps_help: str = "optimizer steps per run",
    batch_help: str | None = None,
    output_help: str,
) -> argparse.ArgumentParser:
    """The flags every benchmark here has (--rounds, --steps, --batch, --log-every, --output), with its defaults."""
    # allow_abbrev=False: a prefix or typo of a flag is refused, never read as the flag it starts.
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--log-every", type=int, default=log_every)
    parser.add_argument("--output", help=output_help)
    return parser


def free_port() -> int:
    """A TCP port nobody listens on now, for the rendezvous of processes a benchmark starts itself."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


RESULT = "RESULT "  # the line a benchmark's worker prints its figures on, as JSON, from rank 0


def run_worker(
    script: Sequence[str], nproc: int, label: str, env: dict[str, str] | None = None, timeout: float = 600
) -> dict[str, Any]:
    """Run `python SCRIPT...` in a fresh process (torchrun with `nproc` processes for 2 or more, on a free port)
    and return the figures of its RESULT line; exit with the worker's error output where it failed."""
    import json
    import subprocess
    import sys
    import tempfile

    command = (
        [sys.executable, *script]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *script,
        ]
    )
    with tempfile.TemporaryDirectory(prefix="bench-") as folder:  # whatever the worker writes where it runs
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=folder,
            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
            timeout=timeout,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        sys.exit(f"{label} at {nproc} process(es) failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[0][len(RESULT) :])


class StepEnds:
    """perf_counter at the end of every optimizer step: the project's callback (on_step_end(trainer)), and, with
    the signature Hugging Face's TrainerCallback has, a Trainer's too (kept cheap: one append)."""

    def __init__(self) -> None:
        self.at: list[float] = []

    def on_step_end(self, *unused: Any, **also_unused: Any) -> None:
        self.at.append(time.perf_counter())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """Where and when a figure was measured: CPU (or GPUs), cores, torch, Python, date."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else f"no GPU, {cpu_name()}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{devices}, {os.cpu_count()} CPU cores; torch {torch.__version__}, Python {platform.python_version()}; "
        f"{date}"
    )


def alternating_rounds(
    rounds: int,
    workloads: Sequence[str],
    variants: Sequence[str],
    run: Callable[[str, str], Any],
    describe: Callable[[Any], str],
) -> tuple[dict[tuple[str, str], list[Any]], tuple[float, float]]:
    """Every workload under every variant, `rounds` times, the variants' order reversed every other round so
    neither always runs first on a warmer machine; each figure printed as it comes. The figures by (workload,
    variant), and the load average before and after (the machine is shared: the table says how busy it was)."""
    results: dict[tuple[str, str], list[Any]] = {}
    load_before = os.getloadavg()[0]
    for round_index in range(rounds):
        for workload in workloads:
            for variant in variants if round_index % 2 == 0 else list(reversed(variants)):
                figures = run(workload, variant)
                results.setdefault((workload, variant), []).append(figures)
                print(f"round {round_index + 1}: {workload}, {variant}: {describe(figures)}", flush=True)
    return results, (load_before, os.getloadavg()[0])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(
    path: Path, title: str, header: Sequence[str], rows: Sequence[Sequence[str]], notes: Sequence[str]
) -> None:
    """Print the table with its notes, and write it to `path` (Markdown) and beside it as CSV."""
    text = f"{title}\n\n{markdown_table(header, rows)}\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    print(text, end="", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with path.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    print(f"written: {path} and {path.with_suffix('.csv')}", flush=True)


def make_images(
    size: int,
    shape: tuple[int, int, int] = (1, 28, 28),
    classes: int = 10,
    split: str = "train",
    distinct: int | None = None,
):
    """The same in-memory synthetic images for every loop compared, so data loading is not what differs
    (split "val": held-out samples of the same task). `distinct`: generate only that many, and index them over
    and over up to `size` (no copies: 224 px images are 0.6 MB each)."""
    import torch
    from torch.utils.data import Subset, TensorDataset

    from multigpu.data import SyntheticImages

    made = size if distinct is None else min(size, distinct)
    source = SyntheticImages(made, shape, classes, seed=0, split=split)
    pool = TensorDataset(
        torch.stack([source[i][0] for i in range(made)]), torch.tensor([source[i][1] for i in range(made)])
    )
    return pool if made == size else Subset(pool, [index % made for index in range(size)])


def reset_cuda_peak(device) -> None:
    """torch.cuda.reset_peak_memory_stats(device), also before anything has touched CUDA: the allocator has no
    device until CUDA is initialised, and the reset alone fails with "Invalid device argument"."""
    import torch

    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats(device)


def make_cnn(shape: tuple[int, int, int] = (1, 28, 28), classes: int = 10, name: str = "cnn"):
    """The project's default model (or another built-in `name`) with the same initial weights in every process."""
    import torch

    from multigpu.models import build_model

    torch.manual_seed(0)
    return build_model(name, shape, classes)


def logged_rates(log_dir: str) -> list[float]:
    """The train/samples_per_sec a run logged to TensorBoard, one per logging interval, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rates: list[tuple[int, float]] = []
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        rates += [(event.step, event.value) for event in accumulator.Scalars("train/samples_per_sec")]
    return [rate for _, rate in sorted(rates)]


def steady(rates: Sequence[float]) -> float:
    """Samples/s over every logging interval but the first (start-up, warm-up, compilation). The intervals hold
    equal numbers of samples, so the rate over them is the harmonic mean."""
    kept = rates[1:]
    return len(kept) / sum(1.0 / rate for rate in kept)


# The collectives FSDP2, DTensor and the trainer issue, on the modules they look them up on at each call:
# torch.distributed (FSDP2's all-gathers, reduce-scatters and HSDP's all-reduce) and its functional collectives
# (DTensor's redistributions, e.g. the gradient norm of clipping).
DIST_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_single",
    "all_gather_single",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all_single",
)
FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor")


class CollectiveTally:
    """Counts every collective this process issues while it is entered, by process group and operation: calls,
    the bytes reduced or gathered (the larger of input and output) and the bytes each rank sends by the ring
    algorithms NCCL and gloo use (all-reduce 2(n-1)/n of them, reduce-scatter and all-gather (n-1)/n, over the
    n ranks of the group). It wraps the functions in place and puts them back on exit; nothing else changes.

    `labels` names groups by their ranks (`mesh_labels` gives a device mesh's dimensions); the default group is
    "world", others "ranks 0,2". `tally.counts[(label, operation)] = (calls, bytes, bytes sent)`."""

    def __init__(self, labels: dict | None = None):
        self.labels = dict(labels or {})
        self.counts: dict = {}
        self._saved: list = []

    def __enter__(self) -> CollectiveTally:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for module, names, functional in (
            (dist, DIST_COLLECTIVES, False),
            (funcol, FUNCTIONAL_COLLECTIVES, True),
        ):
            for name in names:
                original = getattr(module, name)
                self._saved.append((module, name, original))
                setattr(module, name, self._wrapped(name, original, functional))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def reset(self) -> dict:
        """The counts so far, and a fresh start."""
        counts, self.counts = self.counts, {}
        return counts

    def _wrapped(self, name: str, original, functional: bool):
        import inspect

        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            self._add(name, signature.bind(*args, **kwargs).arguments, functional)
            return original(*args, **kwargs)

        return counted

    def _add(self, name: str, arguments: dict, functional: bool) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        values, group = list(arguments.values()), arguments.get("group")
        if functional:  # the group as a name, a (mesh, dimension), a ProcessGroup
            group = dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))
        group = group or dist.group.WORLD
        ranks, size = tuple(dist.get_process_group_ranks(group)), group.size()
        largest = max(
            (v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)), default=0
        )
        if functional and name == "all_gather_tensor":
            largest *= size  # its output is made inside
        share = 2 * (size - 1) / size if "all_reduce" in name else (size - 1) / size
        world = group is dist.group.WORLD or size == dist.get_world_size()
        key = (self.labels.get(ranks, "world" if world else "ranks " + ",".join(map(str, ranks))), name)
        calls, moved, sent = self.counts.get(key, (0, 0, 0.0))
        self.counts[key] = (calls + 1, moved + largest, sent + share * largest)


def mesh_labels(mesh) -> dict:
    """{ranks: dimension name} of this rank's process groups in a device mesh, for CollectiveTally."""
    import torch.distributed as dist

    return {tuple(dist.get_process_group_ranks(mesh.get_group(name))): name for name in mesh.mesh_dim_names}
