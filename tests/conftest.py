"""Shared test helpers: running the CLI under torchrun, real multi-rank process groups, TensorBoard reading.

Nothing here mocks torch.distributed: multi-rank tests start real processes
with the gloo backend. Every process group gets a short timeout and every
subprocess a wall-clock limit, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

from multigpu.config import TrainConfig
from slurm_cluster import SlurmCluster, why_not_available

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SHARED_DATA = REPO.parent / "shared" / "data"
DIST_TIMEOUT = 60  # seconds: a hung collective fails within this
RUN_TIMEOUT = 300  # seconds: no single CLI run in the suite should come near this

# Small runs: a few seconds each on 2 CPU cores.
TINY = ["--train-size", "512", "--val-size", "100", "--batch-size", "32", "--no-progress",
        "--dist-timeout", str(DIST_TIMEOUT)]


def cli_command(args: Sequence[str], nproc: Optional[int] = None, torchrun_args: Sequence[str] = ()) -> list[str]:
    """`python main_multi_gpu.py ARGS`, or the same under torchrun with `nproc` processes."""
    if nproc is None:
        return [PYTHON, str(REPO / "main_multi_gpu.py"), *args]
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
            str(REPO / "main_multi_gpu.py"), *args]


def cli_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra or {})
    return env


def run_cli(args: Sequence[str], nproc: Optional[int] = None, env: Optional[dict[str, str]] = None,
            timeout: float = RUN_TIMEOUT, torchrun_args: Sequence[str] = (),
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the real CLI to completion and return its result (stdout/stderr as text)."""
    return subprocess.run(cli_command(args, nproc, torchrun_args), cwd=cwd, env=cli_env(env), timeout=timeout,
                          capture_output=True, text=True)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def event_files(log_dir: Path) -> list[Path]:
    return sorted(Path(log_dir).rglob("events.out.tfevents.*"))


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under `log_dir`, as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in event_files(log_dir):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def _rank_entry(rank: int, fn: Callable, world_size: int, store_path: str, queue: Any, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        if world_size > 1:
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=DIST_TIMEOUT))
        # Plain pickle copies tensors into the message; torch's default would pass shared-memory
        # handles that die with this process.
        queue.put((rank, pickle.dumps(fn(rank, world_size, *args)), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` real processes joined in a gloo group.

    Returns the ranks' results in rank order. `fn` must be a module-level function
    (processes are spawned); its result must be picklable. A file store avoids
    port races between tests.
    """
    import queue as queue_module

    context = mp.get_context("spawn")
    queue = context.Queue()
    store = tmp_path / f"store-{os.getpid()}-{len(list(tmp_path.glob('store-*')))}"
    processes = [context.Process(target=_rank_entry, args=(rank, fn, world_size, str(store), queue, args))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):  # read before join: a rank blocks on exit until its result is read
            rank, value, error = queue.get(timeout=RUN_TIMEOUT)
            results[rank] = None if value is None else pickle.loads(value)
            if error:
                errors.append(f"rank {rank} failed:\n{error}")
    except queue_module.Empty:
        errors.append(f"ranks {sorted(set(range(world_size)) - set(results))} gave no result (hung or died)")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    assert not errors, "\n".join(errors)
    return [results[rank] for rank in range(world_size)]


@pytest.fixture
def mnist_root(tmp_path: Path) -> Path:
    """A temporary --data-dir holding a copy of ../shared/data/MNIST/raw (skips when absent)."""
    raw = SHARED_DATA / "MNIST" / "raw"
    if not (raw / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST not available at {raw}")
    shutil.copytree(raw, tmp_path / "MNIST" / "raw")
    return tmp_path


def tiny_model(input_dim: int = 16, classes: int = 4) -> torch.nn.Module:
    """A small model without BatchNorm or dropout, identical on every rank for a given seed."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(input_dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))


def blobs(size: int, seed: int, input_dim: int = 16, classes: int = 4) -> TensorDataset:
    """A user's own map-style data set: Gaussian blobs around fixed class centres."""
    centres = torch.randn(classes, input_dim, generator=torch.Generator().manual_seed(1234)) * 3
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(classes, (size,), generator=generator)
    inputs = centres[targets] + torch.randn(size, input_dim, generator=generator)
    return TensorDataset(inputs, targets)


def config_for(tmp_path: Path, world_size: int, **overrides: Any) -> TrainConfig:
    """A small, quiet TrainConfig for in-process trainer tests: ddp when world_size > 1, short dist timeout."""
    values = dict(multi_gpu="ddp" if world_size > 1 else "none", save_dir=str(tmp_path / "ckpt"),
                  batch_size=8, epochs=2, lr=0.01, progress=False, dist_timeout=float(DIST_TIMEOUT), log_every=5)
    values.update(overrides)
    return TrainConfig(**values)


def use_fp16_on_cpu(trainer: Any, init_scale: float = 2.0 ** 10) -> None:
    """Switch a built trainer to fp16 autocast with a GradScaler, on the CPU.

    --amp fp16 is CUDA-only (the CPU falls back to bf16), but CPU autocast runs
    float16 and torch.amp.GradScaler("cpu") is the class the trainer builds on
    CUDA, so the trainer's own scale/unscale/clip/step/update path runs here.
    The default scale is low enough that the tiny test models never overflow.
    """
    trainer.amp_dtype = torch.float16
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)


@pytest.fixture(scope="session")
def _slurm_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = why_not_available()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def slurm_cluster(_slurm_daemons: SlurmCluster) -> Iterator[SlurmCluster]:
    """A real single-node SLURM cluster (tests/slurm_cluster.py), one per session; skips where SLURM cannot run.

    Jobs a test submitted through it (or `track`ed) and left queued are cancelled after the test.
    """
    yield _slurm_daemons
    _slurm_daemons.cancel_left_over()
