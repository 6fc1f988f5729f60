"""--float8 tensorwise|rowwise: Linear layers trained in float8 through torchao (docs/speed.md, "float8").

torchao's `convert_to_float8_training` swaps each chosen nn.Linear for its Float8Linear, whose matmuls cast
inputs, weights and gradients to float8 with dynamic scales (one per tensor, or one per row) and run on the
tensor cores' float8 path, which GPUs of compute capability 8.9 or above have (Ada, Hopper, Blackwell).
The layers chosen are torchtitan's: torchao's filter for the recipe skips the layers too small to gain (for
tensorwise, those with at most 4096 inputs and at most 1024 outputs; for rowwise, larger bounds) and those whose
sizes are not multiples of 16, which float8 matmuls need. Under fsdp (tensorwise) the parameters are also
all-gathered in float8, half the bytes of bf16. A Float8Linear keeps a Linear's parameters and their names, so a
checkpoint loads into a model with or without --float8. Elsewhere --float8 is refused in one line; the tests
use torchao's emulation on the CPU (`convert(..., emulate=True)`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable

import torch
import torch.nn as nn

from multigpu.errors import UsageError

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0, 12.0)
SKIPPED_NAMES = ("lm_head", "output")  # a model's output layer stays in bf16, as in torchtitan


def check(recipe: str, device: torch.device) -> None:
    """UsageError, in one line naming the device, where --float8 cannot run: no GPU with float8 tensor cores,
    or torchao missing."""
    if device.type != "cuda":
        raise UsageError(
            f"--float8 {recipe} needs a GPU of compute capability {_dotted(MIN_CAPABILITY)} or above "
            f"(H100, H200, L4, RTX 4090 ...), and this run trains on the {device.type.upper()}; "
            f"drop --float8"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UsageError(
            f"--float8 {recipe} needs a GPU of compute capability {_dotted(MIN_CAPABILITY)} or above, "
            f"and {device} is a {torch.cuda.get_device_name(device)} of compute capability "
            f"{_dotted(capability)}; drop --float8 (--amp bf16 is this GPU's fast path)"
        )
    if importlib.util.find_spec("torchao") is None:
        raise UsageError(f"--float8 {recipe} needs torchao: pip install '.[float8]' (or pip install torchao)")


def _dotted(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def convert(model: nn.Module, recipe: str, *, fsdp: bool = False, emulate: bool = False) -> list[str]:
    """Swap `model`'s Linear layers that gain from float8 for torchao's Float8Linear, in place, with `recipe`'s
    scaling (float8 all-gather under `fsdp`, tensorwise only); the names of those converted. `emulate`: float8
    computed without float8 tensor cores (torchao's emulation: any device, for tests)."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise",
    )
    gains = _auto_filter_for_recipe(recipe, filter_fqns=list(SKIPPED_NAMES))
    converted: list[str] = []

    def chosen(module: nn.Module, name: str) -> bool:
        if gains(module, name):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    return converted


def convert_for_training(
    model: nn.Module, recipe: str, device: torch.device, fsdp: bool, say: Callable[[str], None]
) -> None:
    """--float8 for the trainer: checked, then `model`'s gaining Linear layers converted, in one line."""
    check(recipe, device)
    linears = sum(isinstance(module, nn.Linear) for module in model.modules())
    converted = convert(model, recipe, fsdp=fsdp)
    gather = ", all-gathered in float8 under fsdp" if fsdp and recipe == "tensorwise" else ""
    say(
        f"--float8 {recipe}: {len(converted)} of {linears} Linear layers in float8{gather}; the others are too "
        f"small to gain (torchao's filter for {recipe}) or the output layer"
        + ("" if converted else ": nothing converted, this model trains as without --float8")
    )
