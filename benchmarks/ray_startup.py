"""Where a run on Ray spends its wall time (issue 59): Ray's start, Ray Train's workers and process group, the
project's own set-up, training, and the ends, beside the same training under torchrun and Ray's floor (a local
instance whose workers do nothing).

The Ray side is the project's real driver (`main_multi_gpu.py --ray-workers N`, multigpu/launch/ray_train.py)
in a fresh process, its steps time-stamped from outside the code they time: the driver's functions are wrapped
here (import_ray, connect, fit), and each worker runs the project's own `train_on_worker` inside a wrapper that
stamps its entry, the first and last optimizer step (a trainer callback) and its end. Wall-clock stamps
(time.time) compare across the processes of one machine.

    python benchmarks/ray_startup.py                       # 2 workers, 3 rounds
    python benchmarks/ray_startup.py --workers 2 --rounds 1 --output benchmarks/results/ray_startup_cpu.md
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
from pathlib import Path
from typing import Any

STARTED = time.time()  # the driver's first line of Python, before any import of the project or Ray

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# The training of every side: the built-in synthetic images, one short epoch, no progress bar.
TRAINING = [
    "--epochs",
    "1",
    "--train-size",
    "2048",
    "--val-size",
    "256",
    "--batch-size",
    "32",
    "--no-progress",
]
STAMPS = "stamps.json"

# (phase, from stamp, to stamp): the driver's stamps, and the workers' (rank 0's) in "w:" names.
PHASES = [
    ("Python's start", "launched", "driver started"),
    ("the driver's imports: the project, ray, ray.train.torch", "driver started", "import_ray returned"),
    ("ray.init: Ray's start", "import_ray returned", "connect returned"),
    ("the driver: the cluster's resources, the save-dir", "connect returned", "fit called"),
    ("Ray Train: workers, placement group, process group", "fit called", "w:entered"),
    ("project in the worker: imports, data, model, wrap, first step", "w:entered", "w:first step"),
    ("training: the other optimizer steps", "w:first step", "w:last step"),
    ("project after training: validation, checkpoint", "w:last step", "w:done"),
    ("Ray Train's end: workers stopped", "w:done", "fit returned"),
    ("ray.shutdown and the driver's exit", "fit returned", "exited"),
]


def timed_worker(job: dict[str, Any]) -> None:
    """The project's Ray worker with time stamps: entry, first and last optimizer step, end (rank 0 writes them)."""
    import torch.distributed as dist
    from bench_common import StepEnds

    from multigpu.launch import ray_train, runner

    stamps = {"entered": time.time()}
    # StepEnds reads perf_counter; this process's offset to the wall clock the driver's stamps read.
    wall_clock_offset = time.time() - time.perf_counter()
    steps = StepEnds()
    untimed = runner.train_from_argv
    runner.train_from_argv = lambda argv: untimed(argv, callbacks=[steps])
    ray_train.train_on_worker(job)
    stamps["done"] = time.time()
    stamps["first step"] = steps.at[0] + wall_clock_offset
    stamps["last step"] = steps.at[-1] + wall_clock_offset
    if dist.get_rank() == 0:
        Path(job["run_dir"], "worker-" + STAMPS).write_text(json.dumps(stamps))


def drive(argv: list[str], stamps_file: str) -> int:
    """The project's Ray driver on `argv`, its steps stamped into `stamps_file`."""
    stamps = {"driver started": STARTED}
    import main_multi_gpu
    from multigpu.launch import ray_train

    def stamped(function: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            stamps[f"{name} called"] = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                stamps[f"{name} returned"] = time.time()

        return call

    ray_train.import_ray = stamped(ray_train.import_ray, "import_ray")
    ray_train.connect = stamped(ray_train.connect, "connect")
    ray_train.fit = stamped(ray_train.fit, "fit")
    ray_train.train_on_worker = timed_worker
    status = main_multi_gpu.main(argv)
    Path(stamps_file).write_text(json.dumps(stamps))
    return status


def one_ray_run(workers: int, folder: Path) -> dict[str, float]:
    """One run on a new local Ray instance: every stamp, in seconds since the driver was launched."""
    save_dir = folder / "ray-run"
    stamps_file = folder / STAMPS
    command = [sys.executable, __file__, "--drive", str(stamps_file), "--", "--ray-workers", str(workers)]
    launched = time.time()
    # PYTHONPATH: Ray's workers import the project and bench_common as the driver does (they inherit the
    # raylet's environment).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
    subprocess.run(
        [*command, *TRAINING, "--save-dir", str(save_dir)],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    stamps = {"launched": launched, **json.loads(stamps_file.read_text()), "exited": time.time()}
    worker_file = next((save_dir / "ray").glob(f"*/worker-{STAMPS}"))
    stamps.update({f"w:{name}": at for name, at in json.loads(worker_file.read_text()).items()})
    return {name: at - launched for name, at in stamps.items()}


def empty_worker(config: dict[str, Any]) -> None:
    """A Ray Train worker that does nothing: what Ray alone costs."""


def drive_empty(workers: int, storage: str) -> int:
    """Ray's floor: a local instance, a TorchTrainer of `workers` workers that do nothing (gloo), shut down."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init()
    scaling = ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})
    TorchTrainer(empty_worker, scaling_config=scaling, run_config=RunConfig(storage_path=storage)).fit()
    ray.shutdown()
    return 0


def one_empty_run(workers: int, folder: Path) -> float:
    """Ray's floor in a fresh process: its wall time."""
    launched = time.time()
    command = [sys.executable, __file__, "--empty", str(folder / "empty-run"), "--workers", str(workers)]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.time() - launched


def one_torchrun_run(workers: int, folder: Path) -> float:
    """The same training under torchrun with as many processes: its wall time."""
    launched = time.time()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}"]
    subprocess.run(
        [*command, "main_multi_gpu.py", *TRAINING, "--save-dir", str(folder / "torchrun-run")],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.time() - launched


SIDES = {"on Ray": one_ray_run, "torchrun": one_torchrun_run, "Ray's floor": one_empty_run}


def measure(workers: int, rounds: int) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """The project on Ray, the same training under torchrun, and Ray's floor, in alternating rounds
    (bench_common.alternating_rounds), each run in a folder of its own."""
    from bench_common import alternating_rounds

    def run(workload: str, side: str) -> Any:
        with tempfile.TemporaryDirectory(prefix="ray-startup-") as folder:
            return SIDES[side](workers, Path(folder))

    def describe(figures: Any) -> str:
        total = figures["exited"] if isinstance(figures, dict) else figures
        return f"{total:.1f} s"

    results, _ = alternating_rounds(rounds, ["training"], list(SIDES), run, describe)
    return (
        results[("training", "on Ray")],
        results[("training", "torchrun")],
        results[("training", "Ray's floor")],
    )


def seconds(values: list[float]) -> str:
    """The median and range of `values`, in seconds."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(
    workers: int,
    ray_runs: list[dict[str, float]],
    torchrun_runs: list[float],
    empty_runs: list[float],
    output: str | None,
) -> None:
    from bench_common import machine_line, write_markdown

    rows = [[phase, seconds([run[end] - run[start] for run in ray_runs])] for phase, start, end in PHASES]
    rows.append(["**total, on Ray**", seconds([run["exited"] for run in ray_runs])])
    rows.append([f"the same training under torchrun, {workers} processes, total", seconds(torchrun_runs)])
    rows.append(
        [f"Ray's floor: a local instance and {workers} workers that do nothing, total", seconds(empty_runs)]
    )
    notes = [
        machine_line(),
        f"{workers} CPU workers (gloo) on a new local Ray instance; median (range) of {len(ray_runs)} round(s), "
        f"on Ray, under torchrun and Ray's floor alternating",
        f"training: main_multi_gpu.py {' '.join(TRAINING)}",
        "stamps: the driver's functions wrapped from outside (import_ray, connect, fit); rank 0's worker stamps "
        "its entry, its first and last optimizer step (a trainer callback) and its end",
    ]
    path = Path(output) if output else Path(tempfile.gettempdir()) / "ray_startup.md"
    write_markdown(
        path, f"Where a run on Ray spends its time ({workers} workers)", ["phase", "seconds"], rows, notes
    )


def main() -> int:
    # allow_abbrev=False: a prefix of a flag is refused, as bench_common.benchmark_parser refuses it.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="where the Markdown table goes (and a CSV beside it)")
    parser.add_argument("--drive", metavar="STAMPS", help=argparse.SUPPRESS)  # a driver process of one round
    parser.add_argument("--empty", metavar="STORAGE", help=argparse.SUPPRESS)  # Ray's floor, one round
    args, rest = parser.parse_known_args()
    if args.drive:
        return drive(rest[1:] if rest[:1] == ["--"] else rest, args.drive)
    if args.empty:
        return drive_empty(args.workers, args.empty)
    ray_runs, torchrun_runs, empty_runs = measure(args.workers, args.rounds)
    report(args.workers, ray_runs, torchrun_runs, empty_runs, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
