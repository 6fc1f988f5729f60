"""Training on a Ray cluster: `main_multi_gpu.py --ray-workers N [training flags]` runs the same training as N
Ray Train workers through `ray.train.torch.TorchTrainer` (docs/launcher.md, "Ray").

    python main_multi_gpu.py --ray-workers 2 --epochs 3                       # a local Ray instance
    python main_multi_gpu.py --ray-workers 8 --ray-address head:6379 --ray-max-failures 2 --save-dir /shared/r1

Ray starts the workers and their process group (gloo on CPU workers, NCCL on GPU ones) and sets RANK,
LOCAL_RANK and WORLD_SIZE as torchrun does; each worker trains through multigpu/launch/runner.py inside that
group, the trainer's existing-group path: it neither creates nor destroys a group it did not make. Rank 0
prints, writes the checkpoints and TensorBoard's files into --save-dir, as under torchrun.

Restarts. `--ray-max-failures K` is Ray's FailureConfig(max_failures=K): after a worker fails Ray ends the
group and starts it again. To the trainer a Ray restart is a torchrun restart: each worker sets the three
variables torchrun sets (TORCHELASTIC_RUN_ID, the same for every attempt of this run; TORCHELASTIC_RESTART_COUNT,
the attempt; TORCHELASTIC_MAX_RESTARTS), so a restarted group continues from the newest checkpoint in --save-dir
exactly as after `torchrun --max-restarts` (docs/checkpoints.md). A worker that ends with bad input (exit 2) or
done (0) returns normally, never retried: a retry would take the refusal for a restart and go on.

Where the flags live: they say how the processes are started, not what is trained, so, like the sweep's
flags, they are main_multi_gpu.py's own (this module's parser), not TrainConfig fields: a checkpoint does not
record them, and a run started on Ray resumes under torchrun and back.

Ray is the extra `[ray]` (pip install '.[ray]'); without it `--ray-workers` is one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from multigpu import safe_files
from multigpu.checkpoints import run_folders
from multigpu.config import DEFAULT_SAVE_ROOT, OneLineParser, TrainConfig, parse_config
from multigpu.errors import TrainingStopped, UsageError
from multigpu.launch import ray_output
from multigpu.launch.answers import RAY, TRAINER, Devices, Nodes, Settings, trainer_flags, whole
from multigpu.launch.cluster_jobs import check_job, job_devices
from multigpu.launch.command import shown
from multigpu.launch.console import best_effort

EXTRA = "pip install '.[ray]' (ray[train])"

# Done, or bad input: the run ends there. Any other end of a worker (a failed run, a crash, a kill) is a failure
# that Ray retries while --ray-max-failures allows.
FINAL_STATUSES = (0, UsageError.exit_code)

# How long the driver waits for --ray-address to answer before it says so: ray.init itself retries for minutes.
CONNECT_SECONDS = 5.0

# Passed to every worker: the project's own variables (test-only fault injection and flags among them) and
# unbuffered output, so rank 0's lines reach the driver as they are printed. Ray's print patch would log each
# print a second time.
WORKER_ENV = {"PYTHONUNBUFFERED": "1", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
PASSED_PREFIX = "MULTIGPU_"


@dataclasses.dataclass
class RayOptions:
    """main_multi_gpu.py's Ray flags."""

    workers: int
    address: str | None = None  # None: a new local Ray instance (main: RAY_ADDRESS when set)
    gpus_per_worker: int | None = None  # None: 1 where the cluster has GPUs, else 0
    max_failures: int = 0


FLAGS: dict[str, dict[str, Any]] = {
    "--ray-workers": dict(
        metavar="N", help="train as N Ray Train workers, one process each, in the process group Ray makes"
    ),
    "--ray-address": dict(
        metavar="ADDR",
        help="the Ray cluster: HOST:PORT of its head, or auto (default: RAY_ADDRESS when set, else a new "
        "local Ray instance)",
    ),
    "--ray-gpus-per-worker": dict(
        metavar="G",
        help="GPUs per worker: 1, or 0 for CPU workers (gloo) (default: 1 where the cluster has GPUs)",
    ),
    "--ray-max-failures": dict(
        metavar="K",
        help="restart the workers after up to K failures; each restart continues from the newest checkpoint "
        "in --save-dir (default 0)",
    ),
}


def requested(argv: Sequence[str]) -> bool:
    """Whether a main_multi_gpu.py command line holds a Ray flag."""
    return any(arg.split("=", 1)[0] in FLAGS for arg in argv)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="main_multi_gpu.py",
        usage="%(prog)s --ray-workers N [Ray flags] [training flags of main_multi_gpu.py --help]",
        description="Train on a Ray cluster as N Ray Train workers. See docs/launcher.md, 'Ray'.",
    )
    for flag, kwargs in FLAGS.items():
        parser.add_argument(flag, **kwargs)
    return parser


def parse(argv: Sequence[str]) -> tuple[RayOptions, list[str]]:
    """The Ray options and the training flags left over. UsageError for a Ray flag out of range."""
    args, rest = build_parser().parse_known_args(list(argv))
    workers = whole("ray_workers", args.ray_workers, 1)
    if workers is None:
        given = next(arg.split("=", 1)[0] for arg in argv if arg.split("=", 1)[0] in FLAGS)
        raise UsageError(f"{given} is for a run on Ray: add --ray-workers N (the number of workers)")
    if args.ray_address is not None and not args.ray_address.strip():
        raise UsageError("--ray-address needs HOST:PORT of the Ray head, or auto")
    options = RayOptions(
        workers=workers,
        address=args.ray_address,
        gpus_per_worker=whole("ray_gpus_per_worker", args.ray_gpus_per_worker, 0, 1),
        max_failures=whole("ray_max_failures", args.ray_max_failures, 0) or 0,
    )
    return options, rest


def check_training(config: TrainConfig) -> None:
    """What a run on Ray cannot do: one process with several devices (dp), or none at all; torchft's replica
    groups, whose lost workers Ray restarts itself."""
    if config.fault_tolerance:
        raise UsageError(
            "--fault-tolerance with --ray-workers: Ray restarts lost workers itself (--ray-max-failures), from the "
            "newest checkpoint; torchft's replica groups run under torchrun (bash launch_multi_gpu.sh "
            "--fault-tolerance): drop one of the two"
        )
    if config.multi_gpu in ("dp", "none"):
        raise UsageError(
            f"--multi-gpu {config.multi_gpu} trains in one process, and --ray-workers runs one process per "
            f"worker in one process group: use --multi-gpu ddp or fsdp (or leave it out)"
        )


def main(argv: Sequence[str]) -> int:
    """The driver: bad input one line and exit 2 (before Ray starts where it can), else the run's exit status."""
    with best_effort():
        try:
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                raise UsageError(
                    "--ray-workers starts its own processes on Ray: run it with python, not torchrun"
                )
            options, train_argv = parse(argv)
            config = parse_config(train_argv)  # the training flags checked here, before anything starts
            check_training(config)
            options = dataclasses.replace(options, address=options.address or os.environ.get("RAY_ADDRESS"))
            if options.address is not None:
                check_reachable(options.address)
            ray = import_ray()
            return _run(ray, options, config, train_argv, list(argv))
        except (UsageError, TrainingStopped) as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return error.exit_code
        except KeyboardInterrupt:
            print("interrupted: the Ray run was stopped", file=sys.stderr, flush=True)
            return 130


def import_ray() -> Any:
    """Ray and Ray Train, or UsageError naming the extra."""
    try:
        import ray
        import ray.train.torch  # noqa: F401  (pandas and pyarrow: ray[train], not plain ray)
    except ImportError as error:
        raise UsageError(
            f"--ray-workers needs Ray Train, which is not installed ({error}): {EXTRA}"
        ) from None
    return ray


def check_reachable(address: str) -> None:
    """UsageError unless HOST:PORT answers within CONNECT_SECONDS: ray.init retries an address nobody
    answers at for minutes before it fails."""
    if address == "auto":
        return  # ray.init reads this machine's running cluster, and says at once when there is none
    host, port = host_and_port(address)
    try:
        socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
    except OSError as error:
        raise UsageError(
            f"--ray-address {address}: no Ray cluster answers there ({error.strerror or error}); start one "
            f"with `ray start --head`, or leave --ray-address out for a local one"
        ) from None


def host_and_port(address: str) -> tuple[str, int]:
    """--ray-address HOST:PORT (or ray://HOST:PORT, Ray Client's), or UsageError."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not (host and sep and port.isdigit()):
        raise UsageError(f"--ray-address {address}: expected HOST:PORT of the Ray head, e.g. 10.0.0.1:6379")
    return host.strip("[]"), int(port)


def connect(ray: Any, options: RayOptions) -> str:
    """Join the cluster at --ray-address (or start a local instance); what to call it in the run's lines."""
    address = options.address
    env = {
        **WORKER_ENV,
        **{name: value for name, value in os.environ.items() if name.startswith(PASSED_PREFIX)},
    }
    # Ray's own lines kept to warnings, its noise where the run's lines say it better left out (ray_output.py).
    runtime_env = {"env_vars": env, "worker_process_setup_hook": ray_output.quiet_ray_worker}
    try:
        ray.init(
            address=address,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            logging_config=ray_output.ray_logging(ray),
        )
    except ConnectionError as error:
        raise UsageError(f"--ray-address {address}: {error}") from None
    except Exception as error:  # noqa: BLE001 -- Ray's own start failed (a node that timed out starting, ...)
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise TrainingStopped(
            f"{where} did not start ({ray_output.first_line(error)[:200]}); try again, or start Ray with "
            f"`ray start --head` and give its address with --ray-address"
        ) from None
    return f"the Ray cluster at {address}" if address else "a local Ray instance"


def gpus_per_worker(ray: Any, options: RayOptions) -> int:
    """--ray-gpus-per-worker, or 1 where the cluster has GPUs; UsageError when the cluster cannot hold the
    workers (Ray would wait for them forever)."""
    resources = ray.cluster_resources()
    gpus = options.gpus_per_worker
    if gpus is None:
        gpus = 1 if resources.get("GPU", 0) >= 1 else 0
    cpus, cluster_gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    if options.workers > cpus or options.workers * gpus > cluster_gpus:
        has = f"{cpus} CPUs and {cluster_gpus} GPUs"
        needs = f"{options.workers} CPUs" + (f" and {options.workers * gpus} GPUs" if gpus else "")
        raise UsageError(
            f"--ray-workers {options.workers}: the Ray cluster has {has}, and the workers need {needs} "
            f"(1 CPU{' and 1 GPU' if gpus else ''} each); give fewer workers or a larger cluster"
        )
    return gpus


def settle_save_dir(config: TrainConfig, train_argv: list[str]) -> tuple[str, list[str]]:
    """The save-dir, chosen here when not given (as the trainer would choose it: a new run folder, or with
    --resume auto the run to continue), so that every attempt of the workers uses the same one and Ray's own
    files go inside it. Returns it and the training flags that name it."""
    if config.save_dir is not None:
        return config.save_dir, train_argv
    path, line = run_folders.choose_run_dir(DEFAULT_SAVE_ROOT, config)
    print(line, flush=True)
    return path, [*train_argv, "--save-dir", path]


def _run(ray: Any, options: RayOptions, config: TrainConfig, train_argv: list[str], argv: list[str]) -> int:
    where = connect(ray, options)
    try:
        gpus = gpus_per_worker(ray, options)
        save_dir, train_argv = settle_save_dir(config, train_argv)
        resume = ray_output.resume_command(shown(TRAINER), argv, save_dir, config.resume == "auto")
        return fit(options, gpus, config, save_dir, train_argv, where, resume)
    finally:
        ray.shutdown()


def fit(
    options: RayOptions,
    gpus: int,
    config: TrainConfig,
    save_dir: str,
    train_argv: list[str],
    where: str,
    resume: str,
) -> int:
    """Run the workers through TorchTrainer; the workers' exit status (1 when Ray gave up after failures, said in
    one line ending with `resume`, the command that continues the run)."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    run_id = f"multigpu-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    storage = os.path.abspath(os.path.join(save_dir, "ray"))
    run_dir = os.path.join(storage, run_id)
    os.makedirs(run_dir, exist_ok=True)
    device = f"{gpus} GPU each" if gpus else "1 CPU each, gloo"
    print(
        f"Ray: {options.workers} workers ({device}) on {where}; --save-dir {save_dir}; Ray's files in "
        f"{run_dir}; up to {options.max_failures} restart(s)",
        flush=True,
    )
    job = {
        "argv": train_argv,
        "cwd": os.getcwd(),
        "run_id": run_id,
        "run_dir": run_dir,
        "max_failures": options.max_failures,
    }
    resources = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
    trainer = TorchTrainer(
        train_on_worker,
        train_loop_config=job,
        torch_config=TorchConfig(timeout_s=int(config.dist_timeout)),
        scaling_config=ScalingConfig(
            num_workers=options.workers, use_gpu=gpus > 0, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=run_id,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=options.max_failures),
            logging_config=LoggingConfig(log_level=ray_output.RAY_TRAIN_LOG_LEVEL),
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as error:
        print(ray_output.failure_line(error, options.max_failures, resume), file=sys.stderr, flush=True)
        return 1
    return workers_status(run_dir, options.workers)


def workers_status(run_dir: str, workers: int) -> int:
    """The run's exit status from what each worker recorded: bad input (2) where any said it, else 0; 1 when a
    worker recorded nothing."""
    statuses = []
    for rank in range(workers):
        try:
            with open(_status_file(run_dir, rank)) as file:
                statuses.append(int(json.load(file)["status"]))
        except (OSError, ValueError, KeyError):
            statuses.append(1)
    return max(statuses)


# --------------------------------------------------------------------------- the launcher's --ray


def ray_devices(s: Settings) -> Devices:
    """The workers of launch_multi_gpu.sh --ray: --gpus G is G workers with a GPU each; --gpus 0 (or none here)
    --nproc CPU workers (gloo)."""
    return job_devices(s, RAY)


def check_ray_job(s: Settings, nodes: Nodes, config: TrainConfig) -> None:
    """The launcher's checks of a run on Ray: those of every cluster job, and its own flags' values."""
    check_job(s, nodes, config, RAY)
    whole("ray_max_failures", s.ray_max_failures, 0)
    if s.ray_address is not None and s.ray_address != "auto":
        host_and_port(s.ray_address)


def ray_where(s: Settings) -> str:
    return f"the Ray cluster at {s.ray_address}" if s.ray_address else "a local Ray instance (or RAY_ADDRESS)"


def ray_command(s: Settings, devices: Devices) -> list[str]:
    """main_multi_gpu.py --ray-workers N with the launcher's training flags: what launch_multi_gpu.sh --ray runs."""
    words = [shown(s.python), shown(TRAINER), "--ray-workers", str(devices.count)]
    if s.ray_address:
        words += ["--ray-address", s.ray_address]
    words += ["--ray-gpus-per-worker", "1" if devices.on_gpu else "0"]
    if s.ray_max_failures:
        words += ["--ray-max-failures", s.ray_max_failures]
    return words + trainer_flags(s, devices) + s.trainer_args


# --------------------------------------------------------------------------- in each worker


def _status_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.status.json")


def train_on_worker(job: dict[str, Any]) -> None:
    """One Ray Train worker: the trainer inside Ray's process group, restarts told as torchrun tells them."""
    import torch.distributed as dist

    from multigpu.launch.runner import train_from_argv

    rank = dist.get_rank()
    missing: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(missing, not os.path.isdir(job["cwd"]))  # every rank stops, or none
    if any(missing):
        if missing[rank]:
            print(
                f"error: rank {rank}: the driver's folder {job['cwd']} is not on this node: run the driver from "
                f"a folder every node has",
                file=sys.stderr,
                flush=True,
            )
        _record(job["run_dir"], rank, UsageError.exit_code)
        return
    os.chdir(job["cwd"])  # relative paths (--save-dir, --data-dir) mean what they meant to the driver
    attempt = _attempt(job["run_dir"], rank)
    os.environ.update(
        TORCHELASTIC_RUN_ID=job["run_id"],
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        TORCHELASTIC_MAX_RESTARTS=str(job["max_failures"]),
        GROUP_WORLD_SIZE=str(_nodes()),
    )
    status = train_from_argv(job["argv"])
    if status not in FINAL_STATUSES:  # Ray restarts the group
        raise RuntimeError(f"rank {rank} {ray_output.ENDED_WITH} {status}")
    _record(job["run_dir"], rank, status)


def _attempt(run_dir: str, rank: int) -> int:
    """This attempt's number, 0 for the first: rank 0 counts the attempts in the run's folder (on storage every
    node shares, as --save-dir is) and tells the others."""
    import torch.distributed as dist

    said: list[int | None] = [None]
    if rank == 0:
        path = os.path.join(run_dir, "attempts")
        safe_files.refuse_link(path)
        said[0] = 0
        if os.path.exists(path):
            with open(path) as earlier:
                said[0] = len(earlier.read().splitlines())
        with safe_files.open_no_follow(path, "a") as file:
            file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n")
    dist.broadcast_object_list(said, src=0)
    return int(said[0] or 0)


def _nodes() -> int:
    """Ray's nodes for the node-aware defaults (fsdp's hybrid mesh, GROUP_WORLD_SIZE as torchrun sets it): the
    number of nodes when each holds the same number of workers, else 1 (no layout by node)."""
    import torch.distributed as dist

    local_sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(local_sizes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    per_node = local_sizes[0]
    if len(set(local_sizes)) != 1 or dist.get_world_size() % per_node:
        return 1
    return dist.get_world_size() // per_node


def _record(run_dir: str, rank: int, status: int) -> None:
    with open(_status_file(run_dir, rank), "w") as file:
        json.dump({"status": status}, file)
