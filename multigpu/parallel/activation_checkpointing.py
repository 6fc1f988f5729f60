"""--activation-checkpointing: each block's activations recomputed in backward instead of kept from forward.

A transformer's activations grow with batch x sequence x width x layers, and for a LoRA fine-tune they are most
of the memory left once the base is frozen. Keeping only each block's input and recomputing the rest in
backward costs about one more forward (a third more compute) and gives the same numbers: the recomputation
replays the same operations with the same random state.

The engine is the model's own where it has one and torch's otherwise:

- a transformers model (a PeftModel's base too): its own `activation_checkpointing_enable` (before transformers 5:
  `gradient_checkpointing_enable`), non-reentrant;
- any other model, and every model under fsdp: torch's `checkpoint_wrapper` around each block, the blocks
  `--fsdp-blocks` finds (multigpu/parallel/sharding.py), so under fsdp each FSDP unit is one checkpointed block,
  as torchtitan applies it. The wrapper's `_checkpoint_wrapped_module.` leaves the checkpoint's names as they
  are (torch drops it from state dicts; multigpu/checkpoints/weights.py from names).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from multigpu.errors import UsageError
from multigpu.parallel import lora, sharding


def checkpoint_activations(model: nn.Module, blocks: str | None, sharded: bool) -> str:
    """Make `model` recompute its blocks' activations in backward (in place); the plan's line that says how."""
    inner: Any = lora.base_of(model)
    # transformers 5's name, and before it (its deprecated alias since) gradient_checkpointing_enable.
    enable = getattr(inner, "activation_checkpointing_enable", None) or getattr(
        inner, "gradient_checkpointing_enable", None
    )
    if not sharded and callable(enable) and getattr(inner, "supports_gradient_checkpointing", False):
        enable({"use_reentrant": False})
        if getattr(
            inner.config, "use_cache", False
        ):  # transformers warns at the first forward and sets it so
            inner.config.use_cache = False
        return (
            f"activation checkpointing: {type(inner).__name__}'s own gradient checkpointing (non-reentrant)"
        )
    found = sharding.find_blocks(model, blocks)
    if not found:
        raise UsageError(
            f"--activation-checkpointing: {type(inner).__name__} has no repeated blocks to checkpoint (children "
            f"of a ModuleList or Sequential); name their class with --fsdp-blocks"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = {id(block) for block in found}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in wrapped:
                parent.register_module(name, checkpoint_wrapper(child))
    blocks_do = f"{len(found)} blocks recompute their" if len(found) != 1 else "1 block recomputes its"
    return f"activation checkpointing: {blocks_do} activations in backward"
