"""--fault-tolerance: replica groups that outlive each other's loss, through torchft (docs/fault-tolerance.md).

The model is replicated over --ft-replica-groups groups, each a run of its own: one process, or a torchrun job
whose processes replicate (ddp) or shard (fsdp) the model among themselves, each with its own Runtime.
torchft's Lighthouse keeps the quorum of the live groups; each group's `Manager` (one on every rank: rank r of
each group all-reduces with rank r of the others, which holds the same shard) asks it for the quorum at every
step's start, averages the gradients over the groups in it (the Manager's all-reduce of the step's gradients,
over torchft's process group: gloo on the CPU, NCCL on GPUs) and lets the optimizer step only when the step's
all-reduce succeeded everywhere in the group (`should_commit`, through torchft's optimizer wrapper). A group
that dies is left out of the next quorum once its heartbeats stop, and the others commit on; one that comes
back is sent the trainer's state by a live peer (the state callbacks the trainer registers,
multigpu/engine/replicas.py) and trains on from where that peer is.

The quorum is taken synchronously at the step's start (torchft's `use_async_quorum=False`): a peer's state is
then always read between two steps, never half-way through one, and a healed group trains the very step it
joined in. This module knows torchft and the process layout; what the trainer sends and says is the engine's.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import warnings
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

# torchft logs every quorum and commit from its Rust core at INFO, several lines a step: only its warnings are
# shown, unless RUST_LOG asks for more. Read when torchft's core loads, so set before the import.
os.environ.setdefault("RUST_LOG", "warn")

try:
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.optim import OptimizerWrapper
except ModuleNotFoundError as missing:  # the [ft] extra is not installed
    if missing.name != "torchft":
        raise
    torchft_missing = True
else:
    torchft_missing = False

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# A group's name at the Lighthouse: torchft reads the number at its end as the group's number.
REPLICA_PREFIX = "multigpu_"
# torchft's Python loggers print a traceback for every all-reduce a lost peer breaks; the trainer says it in
# one line instead (multigpu/engine/replicas.py).
logging.getLogger("torchft").setLevel(logging.CRITICAL)
# torchft's transfer of a peer's state reads it from a read-only buffer, which torch warns of once; its tensors are
# copied as they are loaded.
warnings.filterwarnings(
    "ignore", "The given buffer is not writable", UserWarning, "torch.distributed._serialization"
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an fsdp gradient (a DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def lighthouse_address(config: TrainConfig) -> str:
    """--ft-lighthouse, else $TORCHFT_LIGHTHOUSE; the one line that asks for it when neither is given."""
    address = config.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise UsageError(
            f"--fault-tolerance needs torchft's Lighthouse: give its address with --ft-lighthouse "
            f"http://HOST:29510 or {LIGHTHOUSE_ENV} (bash launch_multi_gpu.sh --fault-tolerance "
            f"--replica-groups N starts one with the groups)"
        )
    return address


def _quorum_recorder(base: type) -> type:
    """torchft's process group `base`, also noting the live groups of each quorum it is configured for."""

    class Recorded(base):  # a class made at run time, from torchft's
        quorum_ranks: list[int] = []

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            # The quorum's members, each as its group number x group size + this rank's place in its group.
            self.quorum_ranks = list(global_ranks or [])
            super().configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )

    Recorded.__name__ = Recorded.__qualname__ = f"Recorded{base.__name__}"
    return Recorded


class ReplicaGroups:
    """This process's replica group among the run's, and torchft's Manager over them."""

    def __init__(
        self,
        manager: Any,
        process_group: Any,
        groups: int,
        replica_id: int,
        group_size: int,
        store: Any = None,
    ):
        self.manager, self.process_group = manager, process_group
        self.groups, self.replica_id, self.group_size = groups, replica_id, group_size
        self.store = store  # the group's store, which torchft's clients connect to: kept alive with them

    def live_groups(self) -> list[int]:
        """The groups of the current quorum, ascending (this one included once it is in)."""
        return sorted({rank // self.group_size for rank in self.process_group.quorum_ranks})

    def average_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        """The parameters' gradients averaged over the quorum's groups, in one all-reduce of them all flattened,
        through the Manager (`Manager.allreduce`): an all-reduce that a lost group breaks is noted there, and the
        step then does not commit. (torchft 0.2.0's DistributedDataParallel does the same from DDP's gradient
        hook, but its hook fails an assertion on such an all-reduce, which would end the surviving group too.)
        Under fsdp each rank averages its own shards (a DTensor's local tensor), as its counterparts hold the
        same."""
        grads = [_local(param.grad) for param in parameters if param.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        self.manager.allreduce(flat).wait()
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    def gated(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """torchft's optimizer wrapper: `step()` steps `optimizer` only when the step may commit."""
        return _CommitGated(self.manager, optimizer)

    def start_quorum(self) -> None:
        """Join the quorum of the step about to start, synchronously: a group behind its peers takes a live peer's
        state here, through the callbacks given to `share_state`."""
        self.manager.start_quorum()

    @property
    def committed_steps(self) -> int:
        """The steps this group committed (torchft's own count; a healed group takes its peer's)."""
        return self.manager.current_step()

    def set_committed_steps(self, steps: int) -> None:
        """Where a run resumed from a checkpoint stands, for the next quorum to compare the groups by."""
        self.manager.load_state_dict({"step": steps, "batches_committed": self.manager.batches_committed()})

    def error(self) -> Exception | None:
        """Why the current step cannot commit (a peer lost in its all-reduce), or None."""
        return self.manager.errored()

    def share_state(self, key: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """What a live group sends a healing peer under `key` (`state()`, read between two steps) and how the
        healing group takes it in (`load`)."""
        self.manager.register_state_dict_fn(key, load, state)

    def close(self) -> None:
        """Leave the Lighthouse and stop torchft's servers (idempotent)."""
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=False)


if not torchft_missing:

    class _CommitGated(OptimizerWrapper):
        """torchft's optimizer wrapper, whose `step()` commits only what every group of the quorum computed. The
        quorum is joined at the step's start (ReplicaGroups.start_quorum), not in `zero_grad`, which the trainer
        calls at a step's end."""

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.optim.zero_grad(set_to_none)


def join(config: TrainConfig, runtime: Any) -> ReplicaGroups:
    """Join the run's replica groups as group --ft-replica-id: torchft's Manager on every rank of this group
    (rank 0's runs the group's torchft server), connected to the Lighthouse; `runtime`
    (multigpu/parallel/distributed.py's Runtime, which calls this from its set-up) then names the groups and
    holds them. UsageError (one line) without torchft, without a Lighthouse that answers, or for a group that
    is not one process or a torchrun job of ddp or fsdp."""
    if torchft_missing:
        raise UsageError(
            "--fault-tolerance needs torchft: pip install 'multigpu[ft]' (or pip install torchft), or run "
            "without --fault-tolerance"
        )
    _check_group_layout(runtime)
    address = lighthouse_address(config)
    timeout = timedelta(seconds=config.dist_timeout)
    host, port, store = _group_store(runtime, timeout)
    backend = ProcessGroupNCCL if runtime.device.type == "cuda" else ProcessGroupGloo
    process_group = _quorum_recorder(backend)(timeout=timeout)
    try:
        manager = Manager(
            pg=process_group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.ft_min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=min(10.0, config.dist_timeout)),
            rank=runtime.rank,
            world_size=runtime.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=address,
            replica_id=f"{REPLICA_PREFIX}{config.ft_replica_id}",
        )
    except RuntimeError as error:
        if "connect" not in str(error):
            raise
        raise UsageError(
            f"--fault-tolerance: no torchft Lighthouse answers at {address} ({_first_clause(error)}): start "
            f"one (torchft_lighthouse --min_replicas 1), or let bash launch_multi_gpu.sh --fault-tolerance "
            f"--replica-groups N start it with the groups; or give its address with --ft-lighthouse or "
            f"{LIGHTHOUSE_ENV}"
        ) from None
    groups, replica_id = config.ft_replica_groups, config.ft_replica_id
    assert groups is not None and replica_id is not None  # TrainConfig refuses --fault-tolerance without them
    replicas = ReplicaGroups(manager, process_group, groups, replica_id, runtime.world_size, store)
    atexit.register(replicas.close)
    runtime.join_replica_groups(replicas.groups, replicas.replica_id, replicas)
    return replicas


def _check_group_layout(runtime: Any) -> None:
    """A replica group is one process (--multi-gpu none) or a torchrun job of ddp or fsdp: the model
    replicated or sharded over the group's processes, and replicated across the groups. fsdp's own hybrid mesh
    would replicate twice; dp's one process drives several GPUs that a group's rank r could not pair with its
    counterparts'."""
    if runtime.mode == "dp":
        raise UsageError(
            "--fault-tolerance with --multi-gpu dp: a replica group trains on one device per process; start "
            "each group as a torchrun job of --multi-gpu ddp (or fsdp), or as one process"
        )
    replicate, shard = runtime.mesh_shape
    if runtime.mode == "fsdp" and replicate > 1:
        raise UsageError(
            f"--fault-tolerance with fsdp's hybrid mesh (replicate {replicate} x shard {shard}): the replica "
            f"groups are the model's replicas, so a group shards over all of its processes; drop "
            f'--dp-replicate and --dp-shard (docs/fault-tolerance.md, "Groups of several processes")'
        )


def _group_store(runtime: Any, timeout: timedelta) -> tuple[str, int, Any]:
    """The group's own store, served by its rank 0 (None elsewhere), and its host and port: torchft's Manager
    on each rank finds the group's torchft server there, and the other groups reach it, when this group leads
    a quorum, at the host's name. A new one per torchrun attempt, so that a restarted group never reads a dead
    attempt's address (torchrun's own store keeps them); its address reaches the group's other ranks through
    the group's process group."""
    store = None
    if runtime.rank == 0:
        store = dist.TCPStore(
            socket.gethostname(), 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
    address: list[Any] = [(socket.gethostname(), store.port) if store is not None else None]
    if runtime.world_size > 1:
        dist.broadcast_object_list(address, src=0)
    host, port = address[0]
    return host, port, store


def _first_clause(error: Exception) -> str:
    """torchft's connection error, up to its advice: 'failed to connect to http://... within timeout of 10s'."""
    return str(error).split(";")[0].strip()
