"""--semi-sync: replica groups that train on their own between syncs, through torchft's DiLoCo and LocalSGD
(docs/fault-tolerance.md, "Training across slow links").

Under --fault-tolerance alone the groups all-reduce every step's gradients
(multigpu/parallel/fault_tolerance.py). With --semi-sync each group takes --sync-every (H) optimizer steps of
its own inner optimizer, exchanging nothing, and then the groups sync:

- diloco (Douillard et al. 2023, arXiv 2311.08105): the groups' weight changes since the last sync (the outer
  gradient) are averaged, and an outer SGD with Nesterov momentum (--outer-lr, --outer-momentum) steps the
  weights of the last sync by them. With --fragments K (Streaming DiLoCo, arXiv 2501.18512) the model is cut
  into K fragments of its blocks, and one fragment syncs every H/K steps in turn, so each syncs once every H
  steps and the peak traffic is a K-th. --quantize-outer sends the outer gradients in 8 bits.
- local-sgd (Lin et al. 2018, arXiv 1805.09767): the groups' weights are averaged.

The algorithm is torchft's own (`torchft.local_sgd.DiLoCo` and `LocalSGD`: the outer gradients, the all-reduce
through the Manager, the commit, the outer step, the weights restored when a sync fails). torchft drives them
from hooks inside the inner optimizer's `step()`; here the trainer calls `after_step` once a step is over, so
that a sync (and the quorum in which a healing group takes a live group's state) always falls between two
steps, where the trainer's state is whole, as docs/fault-tolerance.md's heals need. The order of the syncs and
of the fragments is torchft's (one fragment per sync, round-robin by the Manager's count of committed syncs).

The Manager's step counts committed syncs plus one (`MANAGER_STEP_OFFSET`): a group that starts (step 0) is
thereby always behind a live group (step 1 or more), whose quorums are only at its syncs, so it heals from
that group and joins the very sync that group is in (`finish_peer_sync`), never the reverse.

`CountedManager` counts the bytes of every all-reduce issued between the groups, under --fault-tolerance with
or without --semi-sync, for the plan line, the done line and TensorBoard (`between groups: 1.2 MB per step
(DDP: 9.6 MB)`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.parallel.sharding import find_blocks

# A group at its start has Manager step 0; a live group's is its committed syncs plus this (see the
# docstring).
MANAGER_STEP_OFFSET = 1


# ---------------------------------------------------------------- bytes between the groups
class CountedManager:
    """torchft's Manager, counting what each all-reduce through it sends to the other groups: the tensor's
    bytes, or for a quantized one the 8-bit buffer torchft sends (`quantized_bytes`). An all-reduce of a group
    alone in its quorum sends nothing, and one after an error in the same step is not sent; neither is
    counted. Every other attribute is the Manager's own."""

    def __init__(self, manager: Any):
        self.__dict__["manager"] = manager
        self.__dict__["sent_bytes"] = 0
        self.__dict__["allreduces"] = 0

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, **options: Any) -> Any:
        manager = self.manager
        if manager.errored() is None and manager.num_participants() > 1:
            participants = manager.num_participants()
            payload = quantized_bytes(tensor, participants) if should_quantize else tensor_bytes(tensor)
            self.__dict__["sent_bytes"] += payload
            self.__dict__["allreduces"] += 1
        return manager.allreduce(tensor, should_quantize=should_quantize, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["manager"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["manager"], name, value)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def quantized_bytes(tensor: torch.Tensor, participants: int) -> int:
    """The bytes of torchft's 8-bit buffer for `tensor` (torchft.quantization._prepare_quantize_fp8): each
    row, its count padded to a multiple of the participants, as a 4-byte scale and one byte a value padded to
    4 bytes; a 1-D tensor is one column."""
    rows = tensor.shape[0]
    columns = 1 if tensor.dim() == 1 else tensor.shape[1]
    padded_rows = math.ceil(rows / participants) * participants
    return padded_rows * (math.ceil(columns / 4) + 1) * 4


def parameter_bytes(model: nn.Module) -> int:
    """What DDP all-reduces each step: every trained parameter's gradient, in the parameter's dtype."""
    return sum(tensor_bytes(parameter) for parameter in model.parameters() if parameter.requires_grad)


def planned_bytes(config: TrainConfig, model: nn.Module, groups: int) -> float:
    """The bytes a rank sends to the other groups per optimizer step as planned: the gradients every step, or
    the model once every --sync-every steps (8-bit with --quantize-outer)."""
    if config.semi_sync is None:
        return float(parameter_bytes(model))
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if config.quantize_outer:
        per_sync = sum(quantized_bytes(parameter, groups) for parameter in trained)
    else:
        per_sync = sum(tensor_bytes(parameter) for parameter in trained)
    assert config.sync_every is not None  # TrainConfig refuses --semi-sync without it
    return per_sync / config.sync_every


def byte_text(count: float) -> str:
    """A byte count in powers of 1000: '512 B', '1.2 MB', '340 MB'."""
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            break
        count /= 1000
    if unit == "B":
        return f"{count:.0f} B"
    return f"{count:.1f} {unit}" if count < 100 else f"{count:.0f} {unit}"


def between_groups_text(sent_per_step: float, ddp_per_step: float) -> str:
    """'between groups: 1.2 MB per step (DDP: 9.6 MB)'."""
    return f"between groups: {byte_text(sent_per_step)} per step (DDP: {byte_text(ddp_per_step)})"


def plan_text(config: TrainConfig) -> str:
    """The plan's line of --semi-sync: what each group does alone, and what a sync does."""
    assert config.sync_every is not None  # TrainConfig refuses --semi-sync without it
    steps = f"{config.sync_every} step{'s' if config.sync_every > 1 else ''}"
    if config.semi_sync == "local-sgd":
        return (
            f"semi-sync local-sgd (torchft): each replica group trains {steps} on its own, then the groups' "
            f"weights are averaged"
        )
    momentum = f", Nesterov momentum {config.outer_momentum:g}" if config.outer_momentum else ""
    fragments = (
        f"; the model in {config.fragments} fragments, one synced every "
        f"{config.sync_every // config.fragments} steps in turn"
        if config.fragments > 1
        else ""
    )
    quantized = "; the outer gradients sent in 8 bits" if config.quantize_outer else ""
    return (
        f"semi-sync diloco (torchft): each replica group trains {steps} on its own, then the groups' "
        f"weight changes are averaged into an outer SGD step (lr {config.outer_lr:g}{momentum})"
        f"{fragments}{quantized}"
    )


# ---------------------------------------------------------------- fragments
class Fragment(nn.Module):
    """Some of a model's parameters (the same tensors), as a module of their own for torchft's DiLoCo."""

    def __init__(self, parameters: list[nn.Parameter]):
        super().__init__()
        self.weights = nn.ParameterList(parameters)


def model_fragments(model: nn.Module, count: int) -> list[Fragment]:
    """The model's trained parameters cut into `count` fragments of consecutive blocks (multigpu/parallel/
    sharding.py's blocks, as fsdp's units: transformer blocks, ResNet stages); a parameter outside every block
    goes with the block before it (with the first block, before any), as torchtitan gives the embeddings to
    the first fragment and the head to the last. Frozen parameters are in none: they never change, so nothing
    is sent for them. UsageError (one line) for more fragments than blocks."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if count == 1:
        return [Fragment(trained)]
    blocks = find_blocks(model)
    if count > len(blocks):
        kinds = ", ".join(sorted({type(block).__name__ for block in blocks})) or "none"
        raise UsageError(
            f"--fragments {count}: this model has {len(blocks)} block{'s' if len(blocks) != 1 else ''} to "
            f"cut it at ({kinds}); give at most {max(1, len(blocks))}"
        )
    fragment_of = {
        id(parameter): index * count // len(blocks)
        for index, block in enumerate(blocks)
        for parameter in block.parameters()
    }
    parts: list[list[nn.Parameter]] = [[] for _ in range(count)]
    current = 0
    for parameter in trained:
        current = fragment_of.get(id(parameter), current)
        parts[current].append(parameter)
    return [Fragment(part) for part in parts]


# ---------------------------------------------------------------- the algorithm
class SemiSync:
    """torchft's DiLoCo or LocalSGD over this process's replica group and its counterparts in the others: told
    of each finished optimizer step (`after_step`), it says when a sync is due and runs it (`sync`); its state
    (the outer optimizer, the weights of the last sync, the place in the window) is checkpointed and sent to a
    healing group with the trainer's."""

    def __init__(self, config: TrainConfig, manager: CountedManager, model: nn.Module, optimizer: Any):
        from torchft.local_sgd import DiLoCo, LocalSGD

        assert config.semi_sync is not None and config.sync_every is not None  # TrainConfig's rules
        self.method = config.semi_sync
        self.manager = manager
        self.sync_every = config.sync_every
        self.fragment_count = config.fragments
        self.steps_between_syncs = config.sync_every // config.fragments
        self.local_step = 0  # optimizer steps since the last sync (of any fragment)
        self.syncing = False  # in a sync's quorum: a healing group that takes this state joins the sync
        # The state loaded came from a group in a sync (a heal at this one's start).
        self.peer_was_syncing = False
        self.window_group_samples = 0  # this group's samples since the last sync (the ledger's count)
        self.saved_syncs = 0  # the committed syncs of the state loaded at the start (checkpoint)
        self.algorithm: Any
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        fragments = model_fragments(model, config.fragments)
        if self.method == "local-sgd":  # the trained parameters, averaged
            self.algorithm = LocalSGD(manager, fragments[0], optimizer, config.sync_every)
            return
        dtypes = {parameter.dtype for parameter in model.parameters()}
        self.outer_optimizers = [
            torch.optim.SGD(
                fragment.parameters(),
                lr=config.outer_lr,
                momentum=config.outer_momentum,
                nesterov=config.outer_momentum > 0,
            )
            for fragment in fragments
        ]
        self.algorithm = DiLoCo(
            manager,
            fragments,
            optimizer,
            self.outer_optimizers,
            config.sync_every,
            pin_memory=False,
            should_quantize=config.quantize_outer,
            # One all-reduce per fragment sync (a round trip, not one per tensor, over a slow link), its
            # buffer the fragment's size (torchft's buckets of a fixed size can leave a tensor out: see the
            # guide). Per tensor where quantized (torchft quantizes each row of a 2-D tensor, and a flat
            # buffer is one column) or of mixed dtypes (the buffer has the first tensor's).
            use_bucketization=not config.quantize_outer and len(dtypes) == 1,
            bucket_cap_mb=max(parameter_bytes(fragment) for fragment in fragments) / 2**20 + 1,
        )

    # ------------------------------------------------------------------ the schedule
    def after_step(self, group_samples: int) -> bool:
        """An optimizer step is over (`group_samples`: this group's share of it): whether a sync is due
        now."""
        self.local_step += 1
        self.window_group_samples += group_samples
        return self.local_step >= self.steps_between_syncs

    def sync(self) -> bool:
        """The sync that is due, in the quorum just joined (every group of it runs the same one): torchft's
        average of the weights (local-sgd), or of the outer gradients of the fragment whose turn it is and the
        outer step (diloco). Whether it committed; either way a new window starts."""
        self.syncing = False
        committed_before = self.manager.current_step()
        if self.method == "local-sgd":
            self.algorithm._perform_sync()
        else:
            fragment = self.algorithm._fragments[self.turn()]
            fragment.prepare_sync()
            fragment.perform_sync()
        self.local_step = 0
        self.window_group_samples = 0
        return self.manager.current_step() > committed_before

    def turn(self) -> int:
        """The fragment whose turn it is: torchft's round-robin over the committed syncs."""
        return (self.manager.current_step() - MANAGER_STEP_OFFSET) % self.fragment_count

    def finish_peer_sync(self) -> bool:
        """After a heal at this group's start from a group in a sync (`peer_was_syncing`): join that sync,
        with the state it sent (the same outer gradients as its own), so that both end it with the same
        weights."""
        self.peer_was_syncing = False
        return self.sync()

    def resumed_manager_step(self) -> int:
        """The Manager's step for the syncs of the state loaded at the start (0 without one)."""
        return self.saved_syncs + MANAGER_STEP_OFFSET

    @property
    def syncs(self) -> int:
        return max(0, self.manager.current_step() - MANAGER_STEP_OFFSET)

    # ------------------------------------------------------------------ checkpoint and heal
    def state_dict(self) -> dict[str, Any]:
        """Where the window stands, and diloco's outer optimizers and weights of the last sync (per
        fragment)."""
        state: dict[str, Any] = {
            "method": self.method,
            "fragments": self.fragment_count,
            "local_step": self.local_step,
            "syncs": self.syncs,
            "syncing": self.syncing,
            "window_group_samples": self.window_group_samples,
        }
        if self.method == "diloco":
            state["outer_optimizers"] = [optimizer.state_dict() for optimizer in self.outer_optimizers]
            state["last_synced"] = [
                {name: tensor.clone() for name, tensor in fragment.original_parameters.items()}
                for fragment in self.algorithm._fragments
            ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's or a live group's state (nothing in a checkpoint of a run without --semi-sync: the
        window starts here, from these weights). ValueError for another method or fragment count."""
        if not state:
            return
        if (state["method"], state["fragments"]) != (self.method, self.fragment_count):
            raise ValueError(
                f"it was trained with --semi-sync {state['method']} --fragments {state['fragments']}, this "
                f"run uses --semi-sync {self.method} --fragments {self.fragment_count}: resume with the same "
                f"ones"
            )
        self.local_step = state["local_step"]
        self.window_group_samples = state["window_group_samples"]
        self.peer_was_syncing = state["syncing"]
        if self.method == "diloco":
            for optimizer, saved in zip(self.outer_optimizers, state["outer_optimizers"]):
                optimizer.load_state_dict(saved)
            for fragment, saved in zip(self.algorithm._fragments, state["last_synced"]):
                for name, tensor in saved.items():
                    fragment.original_parameters[name].copy_(tensor)
        self.saved_syncs = state["syncs"]


def check_device(config: TrainConfig, device: torch.device, model: nn.Module) -> None:
    """--quantize-outer where torchft's quantized all-reduce runs (CUDA, with Triton, on 1-D and 2-D tensors);
    one line elsewhere."""
    if not config.quantize_outer:
        return
    from torchft import manager as torchft_manager

    if device.type != "cuda" or not torchft_manager.IS_TRITON_AVAILABLE:
        where = "without Triton" if device.type == "cuda" else f"on {device.type}"
        raise UsageError(
            f"--quantize-outer needs torchft's quantized all-reduce, which runs on CUDA GPUs with Triton, "
            f"and this run is {where}: drop --quantize-outer (the outer gradients then go in their own "
            f"precision)"
        )
    shaped = [name for name, parameter in model.named_parameters() if parameter.dim() > 2]
    if shaped:
        raise UsageError(
            f"--quantize-outer: torchft's quantized all-reduce takes 1-D and 2-D tensors, and this model's "
            f"{shaped[0]} has {model.get_parameter(shaped[0]).dim()} dimensions: drop --quantize-outer"
        )
