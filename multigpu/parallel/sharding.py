"""Sharded training (--multi-gpu fsdp): FSDP2's `fully_shard` over a 1-D device mesh, or a 2-D one for hybrid
sharding (--dp-replicate, --dp-shard), on any nn.Module.

Each repeated block (a child of an nn.ModuleList/nn.Sequential that holds a fair
share of the parameters, or the classes --fsdp-blocks names) becomes its own FSDP
unit, then the root, as torchtitan shards each transformer block: a block's
parameters are gathered just before its forward and freed after it, so a rank holds
1/N of the model plus one block at a time (docs/sharding.md, "Sharded training").

Mixed precision is FSDP2's own MixedPrecisionPolicy: the sharded master weights stay
fp32, forward and backward compute in the --amp dtype, gradients are reduced in fp32.
Autocast is then not used (multigpu/loop/amp.py), so nothing casts the computation back.

Checkpoints need nothing here: multigpu/checkpoints/stateful.py reads a sharded model's state
through torch.distributed.checkpoint.state_dict, whole on rank 0 for a one-file
checkpoint or as each rank's shards for a sharded folder (multigpu/checkpoints/sharded.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
import torch.nn as nn

from multigpu.config import AUTO, TrainConfig
from multigpu.errors import UsageError
from multigpu.parallel import lora

# torch.distributed.fsdp and .checkpoint are imported where they are used: importing them costs about a third of
# torch's own import time, which every run that does not shard (and every --help) would pay.

# A child of a ModuleList/Sequential is a block of its own when it holds at least this share of the model's
# parameters: transformer blocks and ResNet stages qualify, a lone activation or a small head does not.
MIN_BLOCK_SHARE = 0.01


def refuse_unsupported(config: TrainConfig) -> None:
    """What fsdp cannot do, refused at start in one line (exit 2) rather than done wrong."""
    if config.batch_size == AUTO:
        raise UsageError(
            "--batch-size auto measures the whole model on one GPU, not the shards fsdp trains: give "
            "--batch-size a number with --multi-gpu fsdp"
        )


def find_blocks(model: nn.Module, names: str | None = None) -> list[nn.Module]:
    """The modules that become FSDP units before the root, outermost first: each module whose class is in
    `names` (comma-separated class names, --fsdp-blocks), or by default each child of an nn.ModuleList or
    nn.Sequential with at least MIN_BLOCK_SHARE of the parameters. A block's own insides are not searched."""
    wanted = {name.strip() for name in names.split(",") if name.strip()} if names else None
    if wanted is not None:
        present = {type(module).__name__ for module in model.modules()}
        unknown = sorted(wanted - present)
        if unknown:
            repeated = sorted(
                {
                    type(child).__name__
                    for module in model.modules()
                    if isinstance(module, (nn.ModuleList, nn.Sequential))
                    for child in module.children()
                }
            )
            raise UsageError(
                f"--fsdp-blocks {names}: the model has no module of class {', '.join(unknown)}; "
                f"name classes it has, e.g. {', '.join(repeated[:6]) or type(model).__name__}"
            )
    total = sum(p.numel() for p in model.parameters())

    def is_block(module: nn.Module, parent: nn.Module) -> bool:
        if wanted is not None:
            return type(module).__name__ in wanted
        own = sum(p.numel() for p in module.parameters())
        return (
            isinstance(parent, (nn.ModuleList, nn.Sequential)) and own > 0 and own >= MIN_BLOCK_SHARE * total
        )

    found: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if is_block(child, parent):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def policy(amp_dtype: torch.dtype | None) -> Any:
    """FSDP2's mixed precision for --amp: parameters in `amp_dtype` for compute, gradients reduced in fp32
    (and fp32 master weights, which stay sharded); None: everything fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32 if amp_dtype else None)


def root_policy(amp_dtype: torch.dtype | None) -> Any:
    """The root's policy: the blocks', and outputs back in fp32, so the loss and metrics are computed as
    under autocast (a bf16 cross-entropy over many classes loses digits)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    inner = policy(amp_dtype)
    return MixedPrecisionPolicy(
        param_dtype=inner.param_dtype,
        reduce_dtype=inner.reduce_dtype,
        output_dtype=torch.float32 if amp_dtype else None,
    )


# The dimensions of a hybrid mesh, as torchtitan names them: parameters are Replicate() over the first and
# Shard(0) over the second (docs/sharding.md, "Hybrid sharding").
MESH_DIMS = ("dp_replicate", "dp_shard")


def device_mesh(device: torch.device, world_size: int, replicate: int = 1) -> Any:
    """The ranks as FSDP's device mesh: 1-D ("dp") over all of them, or with `replicate` > 1 the 2-D mesh
    (replicate, world_size / replicate) of MESH_DIMS. Its rows are consecutive ranks, which torchrun puts on one
    node: a shard group's all-gathers and reduce-scatters stay inside a node, only the once-per-step all-reduce of
    the gradient shards crosses nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicate == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (replicate, world_size // replicate), mesh_dim_names=MESH_DIMS)


def shard(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    *,
    blocks: str | None = None,
    reshard_after_forward: bool = True,
    amp_dtype: torch.dtype | None = None,
    mesh: Any = None,
    replicate: int = 1,
) -> tuple[nn.Module, int]:
    """`model` sharded in place over all ranks (with `replicate` > 1: over each shard group of the hybrid mesh,
    replicated across the groups; or over `mesh`, a DeviceMesh of some of them): each block its own FSDP unit,
    then the root. Returns the module (the same object, now an FSDPModule) and the number of blocks."""
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else device_mesh(device, world_size, replicate)
    found = find_blocks(model, blocks)
    for block in found:
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy(amp_dtype)
        )
    # The root's parameters (embeddings, a head) are needed first in backward: no point freeing them after forward.
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward and not found,
        mp_policy=root_policy(amp_dtype),
    )
    return model, len(found)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `shard` (checked by class, so nothing is imported for a module that was not)."""
    if not any(cls.__name__ == "FSDPModule" for cls in type(model).__mro__):
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def no_gradient_sync(model: nn.Module, keep_sharded: bool = False) -> Callable[[], AbstractContextManager]:
    """DDP's no_sync for a sharded model, around the inner micro-steps of accumulation: no collective crosses the
    replica groups of a hybrid mesh before the last micro-step, whose all-reduce is the step's only one across
    them. Meanwhile each rank sums the whole gradients with no collective at all, or with `keep_sharded`
    (--fsdp-accumulate sharded) each micro-step reduce-scatters within its shard group and the rank sums 1/S of
    them (docs/sharding.md, "Hybrid sharding")."""
    from torch.distributed.fsdp import FSDPModule  # see the imports' note: loaded only where used

    assert isinstance(model, FSDPModule)  # shard made it one
    setter = model.set_requires_all_reduce if keep_sharded else model.set_requires_gradient_sync

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        setter(False)
        try:
            yield
        finally:
            setter(True)

    return context


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's shard on this rank (a plain tensor is itself): what per-element updates run on."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


# ---------------------------------------------------------------- an average of the weights that stays sharded
class AveragedShards(nn.Module):
    """--ema-decay under fsdp: the average of a sharded model's floating-point parameters, kept as this rank's
    shards only (a sharded module cannot be deep-copied). It runs as the trained model with the average's
    shards swapped in for the call, so evaluation and prediction gather the average; its state_dict is the
    whole average on rank 0's CPU, as an unsharded EMA saves it."""

    def __init__(self, trained: nn.Module):
        super().__init__()
        self._trained = [trained]  # in a list: not a submodule, so the state_dict is the average's own
        self.params = [p for p in trained.parameters() if p.is_floating_point()]
        self.shards = [t.detach().clone() for t in local_tensors(self.params)]

    def trained_shards(self) -> list[torch.Tensor]:
        """This rank's shards of the trained parameters, fetched afresh: FSDP may re-point them after its lazy
        initialisation at the first forward."""
        return [t.detach() for t in local_tensors(self.params)]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[nn.Module]:
        """The trained module holding the average's shards (what the average is written into), then its own
        again; parameters gathered before or inside are freed first, so no stale copy is used."""
        model = self._trained[0]
        _reshard(model)
        trained = self.trained_shards()
        kept = [t.clone() for t in trained]
        with torch.no_grad():
            torch._foreach_copy_(trained, self.shards)
        try:
            yield model
        finally:
            _reshard(model)
            with torch.no_grad():
                torch._foreach_copy_(self.shards, trained)  # what was loaded or written meanwhile stays
                torch._foreach_copy_(trained, kept)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.swapped_in() as model:
            return model(*args, **kwargs)

    def train(self, mode: bool = True) -> AveragedShards:
        self._trained[0].train(mode)
        return super().train(mode)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # the average's
        with self.swapped_in() as model:
            # Copies: with one shard on the CPU the gathered tensors are the parameters themselves, which get
            # the trained weights back when the swap ends.
            return {name: tensor.clone() for name, tensor in module_state_dict(model).items()}

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        with self.swapped_in() as model:
            load_module_state_dict(model, state)


def _reshard(model: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters (a no-op for those already sharded)."""
    for module in model.modules():
        if is_sharded(module):
            module.reshard()  # type: ignore[operator]  # an FSDP unit (is_sharded)


def _state_dict_api() -> Any:
    import torch.distributed.checkpoint.state_dict as api  # see the imports' note: loaded only where used

    return api


def module_state_dict(model: nn.Module, full: bool = True, trainable_only: bool = False) -> dict[str, Any]:
    """A sharded model's state keyed by parameter name: whole on rank 0's CPU (`full`, what a one-file checkpoint
    holds) or this rank's shards (what a sharded checkpoint holds); `trainable_only` leaves the frozen parameters
    out (a LoRA run's base: multigpu/parallel/lora.py)."""
    api = _state_dict_api()
    options = api.StateDictOptions(
        full_state_dict=full, cpu_offload=full, ignore_frozen_params=trainable_only
    )
    state = api.get_model_state_dict(model, options=options)
    # DCP leaves out the frozen parameters by their first name only: a tied one (GPT-2's lm_head) would stay.
    return lora.trainable_part(model, state) if trainable_only else state


def load_module_state_dict(
    model: nn.Module, state: dict[str, Any], full: bool = True, trainable_only: bool = False
) -> None:
    """Load `state` (whole, or this rank's shards) into a sharded model, refusing one that lacks keys as
    nn.Module.load_state_dict does: set_model_state_dict would fill a missing key with the live value.
    `trainable_only`: `state` holds the trainable parameters alone, and the frozen ones stay as they are."""
    api = _state_dict_api()
    expected = module_state_dict(model, full=False, trainable_only=trainable_only)
    missing = [name for name in expected if name not in state]
    if missing:
        raise RuntimeError(
            f"Error(s) in loading state_dict:\n\tMissing key(s) in state_dict: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    api.set_model_state_dict(
        model, state, options=api.StateDictOptions(full_state_dict=full, strict=not trainable_only)
    )
