"""The rules every cluster job shares, whichever engine starts it (SLURM, a Kubernetes TrainJob, Ray): the devices
it asks for, and what a job that resumes by itself needs (torch-free). The engines' own files are slurm.py,
kubernetes.py and ray_train.py; the numbers shown beside them (effective batch, LR) are command.py's, as for a
run here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.launch.answers import (
    CPU_PROCESSES,
    PROCESS_PER_DEVICE,
    RAY,
    Devices,
    Engine,
    Nodes,
    Settings,
    check_save_dir,
    given_trainer_options,
    mesh_phrase,
    mode_of,
    nodes_of,
    plural,
    settle_mesh,
    settle_training,
    training_config,
    whole,
)


def job_devices(s: Settings, engine: Engine) -> Devices:
    """Per node (per worker for Ray, which places them): --gpus asks the engine for that many GPUs; 0 (or none
    here, by default) runs --nproc CPU processes (gloo)."""
    gpus = whole("gpus", s.gpus, 0)
    if gpus is None:
        gpus = len(s.found)
    nproc = whole("nproc", s.nproc, 1)
    if gpus and nproc is not None and nproc != gpus:
        raise UsageError(f"--nproc {nproc} with --gpus {gpus}: on GPU nodes there is one process per GPU")
    if s.gpu_ids is not None:
        raise UsageError(f"--gpu-ids is {engine.name}'s to decide; give --gpus (per node) with {engine.flag}")
    if s.multi_gpu not in (None, *PROCESS_PER_DEVICE):
        raise UsageError(f"{engine.flag} runs --multi-gpu ddp or fsdp (one process per GPU on every node)")
    if engine is RAY and gpus:
        return Devices(mode_of(s) or "ddp", gpus, None, True)  # the workers, one GPU each
    return Devices(mode_of(s) or "ddp", gpus or nproc or CPU_PROCESSES, None, gpus > 0)


def check_job(s: Settings, nodes: Nodes, config: TrainConfig, engine: Engine) -> None:
    """What a job beyond a run here needs: its own resuming (--resume auto, never --overwrite, where the engine
    restarts it with the same command), and a --save-dir every node sees."""
    given = given_trainer_options(s.trainer_args)
    if engine.resumes is not None and "resume" in given:
        raise UsageError(
            f"--resume after -- with {engine.flag}: {engine.resumes} with --resume auto by itself"
        )
    if engine.resumes is not None and "overwrite" in given:
        raise UsageError(
            f"--overwrite after -- with {engine.flag}: the job continues its --save-dir with --resume auto "
            f"({engine.restart} must not start over); give a new --save-dir instead"
        )
    if nodes.count > 1 and s.save_dir is None:
        raise UsageError(
            f"--nnodes {nodes.count} needs --save-dir on storage every node shares (e.g. /shared/run1): "
            f"global rank 0, which writes the checkpoints, may be on any node"
        )
    assert config.save_dir is not None  # settled by launch_rules.check before (its set:save-dir)
    check_save_dir(config.save_dir)


@dataclass
class Job:
    """A SLURM job's or a TrainJob's settled shape: per node `devices`, the nodes, fsdp's mesh, the training."""

    devices: Devices
    nodes: Nodes
    mesh: tuple[int, int] | None
    config: TrainConfig
    save_dir: str  # the config's, settled
    cpus: int  # per node: --cpus-per-task, else 5 per GPU (the process and its 4 loader workers), 1 per CPU process

    @property
    def gpus(self) -> int:
        return self.devices.count if self.devices.on_gpu else 0

    @property
    def procs(self) -> int:
        return self.devices.count

    @property
    def what(self) -> str:
        """'8 GPUs' or '2 CPU processes (gloo)', per node."""
        return plural(self.gpus, "GPU") if self.gpus else f"{plural(self.procs, 'CPU process')} (gloo)"

    @property
    def layout(self) -> str:
        """'DDP', or 'FSDP, hybrid: mesh replicate 2 x shard 8 (...)'."""
        return f"{self.devices.mode.upper()}{mesh_phrase(self.mesh, self.nodes, self.devices)}"


def settle_job(s: Settings, devices: Devices, check: Callable[[Settings, Nodes, TrainConfig], None]) -> Job:
    """The job's nodes, mesh and training, checked by the engine's `check`; every training value named."""
    nodes = nodes_of(s, "ddp")
    mesh = settle_mesh(s, devices, nodes)
    config = training_config(s, devices)
    check(s, nodes, config)
    assert config.save_dir is not None  # settled by launch_rules.check before (its set:save-dir)
    gpus = devices.count if devices.on_gpu else 0
    cpus = whole("cpus_per_task", s.cpus_per_task, 1) or devices.count * (5 if gpus else 1)
    settle_training(s, config)
    return Job(devices, nodes, mesh, config, config.save_dir, cpus)
