"""Which mode, device and backend a run uses, and the process-group set-up.

torchrun is the only launcher of processes: this module reads RANK, LOCAL_RANK
and WORLD_SIZE from the environment it sets and never starts a rendezvous of
its own.
"""

from __future__ import annotations

import atexit
import gc
import os
import shlex
import sys
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from multigpu.config import DEFAULT_SAVE_ROOT, TrainConfig
from multigpu.errors import UsageError
from multigpu.parallel import float8
from multigpu.resilience.hang_report import nccl_flight_recorder_env
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.preemption import restart_safe_store


@dataclass
class Runtime:
    """Where this process trains: the resolved mode, device and rank layout."""

    mode: str  # "ddp", "fsdp", "dp" or "none"
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None  # "nccl"/"gloo" under ddp and fsdp
    dp_device_ids: list[int] = field(default_factory=list)  # GPUs nn.DataParallel splits over
    mesh_shape: tuple[int, int] | None = (
        None  # fsdp: (replicate, shard), replicate > 1 hybrid; None: (1, all)
    )
    nodes: int = 1  # torchrun's nodes (agents), when each runs the same number of processes
    # --fault-tolerance (multigpu/parallel/fault_tolerance.py): the replica groups that train the same model, each
    # a process group of its own as above, and this process's group. `leads`: this group is the lowest live one,
    # whose rank 0 writes the run's files; set at each step from the groups alive (docs/fault-tolerance.md).
    replica_groups: int = 1
    replica_id: int = 0
    leads: bool = True
    replicas: Any = None  # fault_tolerance.ReplicaGroups: torchft's Manager over the groups
    # This process's share of every step's data, its rank numbered on through the replica groups, and the shares
    # every step's data is split into (the processes of all groups): plain attributes, read each step.
    data_rank: int = field(init=False)
    data_ranks: int = field(init=False)

    def __post_init__(self) -> None:
        self.mesh_shape = self.mesh_shape or (1, self.world_size)
        self.join_replica_groups(self.replica_groups, self.replica_id, self.replicas)

    def join_replica_groups(self, groups: int, replica_id: int, replicas: Any) -> None:
        """This process's group is `replica_id` of `groups` (--fault-tolerance), with torchft's `replicas`; it leads
        until the first quorum says which groups are alive."""
        self.replica_groups, self.replica_id, self.replicas = groups, replica_id, replicas
        self.leads = self.leads and replica_id == 0
        self.data_rank = replica_id * self.world_size + self.rank
        self.data_ranks = groups * self.world_size

    def leave_replica_groups(self) -> None:
        """--fault-tolerance: leave the quorum at once (this group lost a process), so that the live groups do
        not wait for this one; nothing without it."""
        if self.replicas is not None:
            self.replicas.close()

    @property
    def is_main(self) -> bool:
        """Rank 0 (of the leading replica group): the one process that prints, logs and writes files."""
        return self.rank == 0 and self.leads

    @property
    def devices_per_step(self) -> int:
        """Devices that each process one --batch-size per micro-batch."""
        return self.world_size * max(1, len(self.dp_device_ids))

    @property
    def forward_is_collective(self) -> bool:
        """fsdp: every forward all-gathers parameters, so every rank must run each one (a rank without a
        batch of its own runs a stand-in)."""
        return self.mode == "fsdp"

    @property
    def mesh_position(self) -> tuple[int, int]:
        """This rank's (replicate, shard) coordinates in fsdp's mesh: its rows are consecutive ranks."""
        assert self.mesh_shape is not None  # __post_init__ fills it
        return divmod(self.rank, self.mesh_shape[1])

    def describe(self) -> str:
        assert self.mesh_shape is not None  # __post_init__ fills it
        if self.mode == "fsdp" and self.mesh_shape[0] > 1:
            replicate, shard = self.mesh_shape
            nodes = (
                f"; with {self.nodes} nodes: shard within each node, replicate across them"
                if self.mesh_shape == (self.nodes, self.world_size // self.nodes)
                else ""
            )
            return (
                f"mode fsdp, hybrid: {self.world_size} processes, backend {self.backend}, mesh replicate {replicate} "
                f"x shard {shard} (dp_replicate, dp_shard){nodes}: parameters, gradients and optimizer state "
                f"sharded 1/{shard} per rank within each shard group, one gradient all-reduce across the "
                f"{replicate} replicas per optimizer step; this rank on {self.device}"
            )
        if self.mode == "fsdp" and self.world_size == 1:
            return (
                f"mode fsdp: one process, one shard (the whole model on {self.device}; fsdp saves memory with "
                f"several processes under torchrun)"
            )
        if self.mode == "fsdp":
            return (
                f"mode fsdp: {self.world_size} processes, backend {self.backend}, parameters, gradients and "
                f"optimizer state sharded 1/{self.world_size} per rank, this rank on {self.device}"
            )
        if self.mode == "ddp":
            return (
                f"mode ddp: {self.world_size} processes, backend {self.backend}, this rank on {self.device}"
            )
        if self.mode == "dp":
            return f"mode dp: nn.DataParallel over cuda:{','.join(map(str, self.dp_device_ids))}"
        return f"mode none: one device, {self.device}"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def torchrun_hint(argv: list[str] | None = None) -> str:
    """The exact torchrun command that runs this script with the same arguments under DDP."""
    argv = sys.argv if argv is None else argv
    nproc = torch.cuda.device_count() or 2
    return shlex.join(["torchrun", f"--nproc_per_node={nproc}", *argv])


def resolve_mode(config: TrainConfig) -> str:
    """--multi-gpu auto -> ddp under torchrun, dp with several visible GPUs, else none."""
    if config.multi_gpu != "auto":
        return config.multi_gpu
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        return "ddp"
    return "dp" if torch.cuda.device_count() > 1 else "none"


def parse_gpu_ids(text: str | None) -> list[int]:
    """--gpu-ids '0,1,3' checked against the visible GPUs; None means all of them."""
    visible = torch.cuda.device_count()
    if text is None:
        return list(range(visible))
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--gpu-ids must be comma-separated integers like 0,1,3; got {text!r}") from None
    unknown = [i for i in ids if not 0 <= i < visible]
    if unknown or not ids or len(set(ids)) != len(ids):
        raise UsageError(
            f"--gpu-ids {text}: GPU id(s) {unknown or ids} not usable; "
            f"visible GPUs are {list(range(visible)) or 'none'} (check CUDA_VISIBLE_DEVICES)"
        )
    return ids


def setup(config: TrainConfig) -> Runtime:
    """Resolve the mode and, under DDP or FSDP, join torchrun's process group (fsdp without torchrun: a group of
    one process, which FSDP's device mesh needs); with --fault-tolerance, join the replica groups too.

    The process-group timeout is --dist-timeout: a rank that died makes the others
    fail after that long instead of hanging forever.
    """
    runtime = _devices_and_group(config)
    if config.fault_tolerance:
        from multigpu.parallel import fault_tolerance  # torchft is imported there, only for such a run

        fault_tolerance.join(config, runtime)
    return runtime


def _devices_and_group(config: TrainConfig) -> Runtime:
    mode = resolve_mode(config)
    if mode in ("dp", "none"):
        runtime = _one_process(mode, config.gpu_ids)
        if (
            config.float8
        ):  # refused before any data is read where the device has no float8 (parallel/float8.py)
            float8.check(config.float8, runtime.device)
        return runtime
    torchrun = launched_by_torchrun()
    if mode == "ddp" and not torchrun:
        raise UsageError(
            f"--multi-gpu ddp needs one process per device, started by torchrun: {torchrun_hint()}"
        )
    if config.gpu_ids is not None:
        raise UsageError(
            "--gpu-ids is for --multi-gpu dp; "
            + (
                "under torchrun choose GPUs with CUDA_VISIBLE_DEVICES"
                if torchrun
                else "for fsdp choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        )
    return _process_group(config, mode, torchrun)


def runtime_for(config: TrainConfig, runtime: Runtime | None) -> tuple[Runtime, bool]:
    """The run's mode, devices and ranks (`runtime` when given, else `setup`), and whether this call made the
    process group: its maker owns the group's end (the trainer's close(), or at exit)."""
    group_before = is_distributed()
    made = runtime or setup(config)
    return made, runtime is None and is_distributed() and not group_before


def _one_process(mode: str, gpu_ids: str | None) -> Runtime:
    """--multi-gpu dp (nn.DataParallel over this process's GPUs) or none (one device): no process group."""
    processes = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    if processes > 1:  # each process would train its own copy into the same files
        raise UsageError(
            f"--multi-gpu {mode} trains in one process, but torchrun started {processes}: "
            f"use --multi-gpu ddp under torchrun, or run without torchrun"
        )
    if gpu_ids is not None and mode != "dp":
        raise UsageError(
            "--gpu-ids selects the GPUs of --multi-gpu dp; for ddp or one GPU "
            "set CUDA_VISIBLE_DEVICES instead"
        )
    if mode == "dp":
        ids = parse_gpu_ids(gpu_ids)
        if len(ids) >= 2:
            return Runtime("dp", torch.device(f"cuda:{ids[0]}"), dp_device_ids=ids)
        where = f"cuda:{ids[0]}" if ids else "cpu"
        print(
            f"--multi-gpu dp needs 2 or more GPUs, found {len(ids)}: training on the single device {where}",
            flush=True,
        )
        return Runtime("none", torch.device(where))
    return Runtime("none", torch.device("cuda:0" if torch.cuda.is_available() else "cpu"))


def _process_group(config: TrainConfig, mode: str, torchrun: bool) -> Runtime:
    """ddp or fsdp: this process's device, and the group joined (torchrun's ranks), or made for the one process
    of fsdp without torchrun."""
    rank, local_rank, world_size = (
        (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
        if torchrun
        else (0, 0, 1)
    )
    device = (
        _device(rank, local_rank)
        if torchrun
        else torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    nodes = nodes_in_job(world_size)
    if torchrun and backend == "nccl" and config.debug_collectives:
        # torch's own check of every collective, the user's included, where it works: on NCCL (on gloo, DDP built
        # on its checking group crashes with torch 2.14, so there only multigpu/parallel/collective_check.py runs).
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    if torchrun and backend == "nccl" and config.watchdog_seconds:
        nccl_flight_recorder_env(config.save_dir or DEFAULT_SAVE_ROOT)
    # Refused before any group forms: a hybrid mesh this run's processes cannot fill (one process: none).
    mesh = config.mesh_shape(world_size, nodes) if mode == "fsdp" else None
    if config.float8:
        float8.check(config.float8, device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=config.dist_timeout)
        _import_before_the_group()
        if torchrun:
            dist.init_process_group(
                backend,
                timeout=timeout,
                device_id=device if backend == "nccl" else None,
                **restart_safe_store(timeout),
            )
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(mode, device, rank, local_rank, world_size, backend, mesh_shape=mesh, nodes=nodes)


def _device(rank: int, local_rank: int) -> torch.device:
    """A torchrun rank's device: its GPU (LOCAL_RANK), set as the current one, or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UsageError(
            f"rank {rank}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs "
            f"are visible; use --nproc_per_node={torch.cuda.device_count()}"
        )
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)  # before anything touches CUDA, so nothing lands on GPU 0
    return device


def nodes_in_job(world_size: int) -> int:
    """The nodes torchrun runs on (GROUP_WORLD_SIZE: its agents, one per node), when each runs the same number of
    processes (LOCAL_WORLD_SIZE); else 1."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return nodes if nodes > 1 and nodes * per_node == world_size else 1


def _import_before_the_group() -> None:
    """Import what DDP imports on its first construction, before the group exists.

    torch.distributed.nn.functional's functions take `group=group.WORLD` as a default argument, read once at
    import: imported while a group exists (DDP imports it), ten defaults hold that group for the life of the
    process, so `destroy_process_group` can never free it and its gloo threads live on into the interpreter's
    finalization (see `teardown`). Imported first, the defaults hold None.
    """
    import torch.distributed.nn  # noqa: F401


def teardown() -> None:
    """Destroy the process group; call it after the trainer (whose DDP reducer holds the group) is gone.

    Then the group's gloo/NCCL threads are joined here, not during the
    interpreter's shutdown, where they can abort the process ("terminate called
    without an active exception": a gloo worker dropping the last collective's
    tensors takes the interpreter lock, which a finalizing interpreter answers
    by ending the thread); gc.collect frees what only reference cycles still
    hold, frozen objects included (an exit-time freeze, multigpu/tuning/gc_pauses.py,
    may have run before an at-exit teardown).
    """
    if dist.is_initialized():
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        gc.collect()
        if frozen:
            gc.freeze()
        dist.destroy_process_group()


def teardown_at_exit(owner: Any) -> Callable[[], None]:
    """Register, for interpreter exit, `owner.close()` while `owner` lives (a trainer that set up the process
    group), else `teardown()`: a script that calls fit() or predict() and simply ends then destroys the group
    and stops the trainer's threads before the interpreter finalizes, as `close()` would. Returns the handler,
    for `atexit.unregister` once the owner closed itself.

    atexit runs its handlers last-registered first: this one, registered when the group is made, runs before
    those of torch and of anything imported before the trainer (the exit-time freeze of multigpu/tuning/gc_pauses.py,
    registered when a command starts, included).
    """
    owner_ref = weakref.ref(owner)

    def at_exit() -> None:
        alive = owner_ref()
        if alive is not None:
            alive.close()
        else:
            teardown()

    atexit.register(at_exit)
    return at_exit


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (a no-op in one process)."""
    if is_distributed():
        with BEAT.recorded("all_reduce", tensor):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def start_all_reduce_sum(tensor: torch.Tensor) -> dist.Work | None:
    """Start summing a tensor over ranks in place; the work to wait on before reading it (None in one process,
    where there is nothing to add). On CUDA the wait orders the device's stream, the host goes on."""
    if not is_distributed():
        return None
    with BEAT.recorded("all_reduce", tensor):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)


def barrier() -> None:
    if is_distributed():
        with BEAT.recorded("barrier"):
            dist.barrier()


T = TypeVar("T")


def gather_objects(obj: T) -> list[T]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    with BEAT.recorded("all_gather_object"):
        dist.all_gather_object(gathered, obj)
    return gathered


def gather_objects_to_main(obj: T) -> list[T] | None:
    """Every rank's `obj`, in rank order, on rank 0 only (None on the others)."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    with BEAT.recorded("gather_object"):
        dist.gather_object(obj, gathered, dst=0)
    return gathered
