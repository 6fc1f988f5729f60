"""The things a checkpoint holds, each with `state_dict()` / `load_state_dict(state)` (DCP's Stateful protocol).

The trainer hands the checkpointer a dict of these (multigpu/checkpoints/checkpointer.py),
the way torchtitan's checkpointer takes its ModelWrapper and OptimizersContainer:
the checkpointer knows no trainer, and its two writers (one file, sharded
directory) save the same dict. The model's and optimizer's states go through
torch.distributed.checkpoint.state_dict, which gives the same keys for a plain
module, DDP (no "module." prefix) and an FSDP2-sharded module: whole tensors on
rank 0 for the one-file writer (`full=True`), each rank's own shards for DCP. (The optimizer of an
unsharded model keeps torch's own format in a one-file checkpoint: see OptimizerState.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from multigpu import rng
from multigpu.parallel import lora, sharding
from multigpu.parallel.distributed import Runtime, gather_objects


def _api() -> Any:
    """torch.distributed.checkpoint.state_dict, imported at its first use: it costs half as much again as
    torch's own import (0.7 s here), which a run with an unsharded model never needs (see ModelState)."""
    import torch.distributed.checkpoint.state_dict as api

    return api


def _options(full: bool) -> Any:
    # Whole tensors gathered to rank 0's CPU (the only rank that writes a file), or each rank's shards in place.
    return _api().StateDictOptions(full_state_dict=full, cpu_offload=full)


class ModelState:
    """The model's weights and buffers, keyed by parameter name (torch.compile's and DDP's wrappers add nothing).

    An unsharded model's whole state is torch's own `state_dict()`: the same keys and tensors that
    get_model_state_dict would give, without the import; a sharded model, or its shards, go through it.
    `trainable_only` (a LoRA run: multigpu/parallel/lora.py): the trainable parameters and the buffers alone,
    the frozen base left to the folder it was loaded from."""

    def __init__(self, model: torch.nn.Module, full: bool = True, trainable_only: bool = False):
        self.model, self.full = getattr(model, "_orig_mod", model), full
        self.trainable_only = trainable_only
        self.plain = full and not sharding.is_sharded(self.model)

    def as_shards(self) -> ModelState:
        """The same model, as each rank's shards (for DCP)."""
        return ModelState(self.model, full=False, trainable_only=self.trainable_only)

    def state_dict(self) -> dict[str, Any]:
        if self.plain and self.trainable_only:
            return lora.trainable_part(self.model, self.model.state_dict())
        if self.plain:
            return self.model.state_dict()
        return sharding.module_state_dict(self.model, self.full, self.trainable_only)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.plain and self.trainable_only:
            lora.load_trainable_part(self.model, state)
        elif self.plain:
            self.model.load_state_dict(state)
        else:
            sharding.load_module_state_dict(self.model, state, self.full, self.trainable_only)


class OptimizerState:
    """The optimizer's state: torch's own `optimizer.state_dict()` (keyed by parameter number) in a one-file
    checkpoint of an unsharded model, as this format always held it; keyed by parameter name (FQN) through
    get_optimizer_state_dict for a sharded model and for DCP, which read it at any world size.

    Either key loads into either: numbers are the optimizer's parameters in param-group
    order (torch's numbering), names are the model's. Only the name-keyed calls touch an
    optimizer without state: torch initialises it by a step with zero gradients and LR 0.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: bool = True):
        self.model, self.optimizer, self.full = getattr(model, "_orig_mod", model), optimizer, full
        self.sharded = sharding.is_sharded(self.model)

    def as_shards(self) -> OptimizerState:
        return OptimizerState(self.model, self.optimizer, full=False)

    def state_dict(self) -> dict[str, Any]:
        if self.full and not self.sharded:
            return self.optimizer.state_dict()
        return _api().get_optimizer_state_dict(self.model, self.optimizer, options=_options(self.full))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.sharded:
            self.optimizer.load_state_dict(self._keyed(state, by_name=False))
        else:
            _api().set_optimizer_state_dict(
                self.model,
                self.optimizer,
                self._keyed(state, by_name=True),
                options=_api().StateDictOptions(full_state_dict=self.full),
            )

    def _keyed(self, state: dict[str, Any], by_name: bool) -> dict[str, Any]:
        """`state` keyed by parameter name (`by_name`) or by number, whichever it was keyed by."""
        keys = [key for group in state["param_groups"] for key in group["params"]]
        if all(isinstance(key, str) for key in keys) == by_name:
            return state
        names = {id(param): name for name, param in self.model.named_parameters()}
        ordered = [names[id(param)] for group in self.optimizer.param_groups for param in group["params"]]
        if len(ordered) != len(keys):
            raise ValueError(
                f"the checkpoint's optimizer has {len(keys)} parameters, this one {len(ordered)}"
            )
        # By position: the k-th parameter of the checkpoint's groups is the k-th of ours.
        new_key = dict(zip(keys, ordered if by_name else range(len(ordered))))
        return {
            "state": {new_key[key]: value for key, value in state["state"].items()},
            "param_groups": [
                {**group, "params": [new_key[key] for key in group["params"]]}
                for group in state["param_groups"]
            ],
        }


class ScalerState:
    """The fp16 loss scale; a checkpoint saved without one leaves a fresh scale, said in one line."""

    def __init__(self, scaler: torch.amp.GradScaler, say: Callable[[str], None]):
        self.scaler, self.say = scaler, say

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler.is_enabled() and not state:
            self.say("the checkpoint has no fp16 loss scale (saved without --amp fp16): starting a fresh one")
        else:
            self.scaler.load_state_dict(state)


class RngState:
    """Every rank's random number generators (gathered: every rank must call `state_dict`). Each rank continues
    its own on the same world size; on another one they keep this run's seeding (the trainer says so).

    The states last gathered stay known: the save from rank 0's replica alone, where a collective would hang
    (multigpu/resilience/hang_report.py), can write them while they still hold (`still_gathered`)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.gathered: list[dict[str, Any]] | None = None

    def state_dict(self) -> list[dict[str, Any]]:
        self.gathered = gather_objects(rng.rng_state(self.runtime.device))
        return self.gathered

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == self.runtime.world_size:
            rng.set_rng_state(states[self.runtime.rank], self.runtime.device)

    def still_gathered(self) -> Saved | None:
        """Every rank's states as last gathered, if this rank has drawn no random number since; else None.

        The ranks run the same code, so where this rank drew nothing, no rank did (no dropout, no random
        augmentation in the main process): the gathered states are every rank's now. Where it drew, the other
        ranks' states are unknown without a collective."""
        if self.gathered is None:
            return None
        now = rng.rng_state(self.runtime.device)
        return Saved(self.gathered) if rng.same_state(now, self.gathered[self.runtime.rank]) else None


class Saved:
    """A state known already, as a thing whose `state_dict()` returns it (a save without a collective)."""

    def __init__(self, state: Any):
        self.state = state

    def state_dict(self) -> Any:
        return self.state
