"""The LR scaling rule: the one place its formula lives.

The trainer uses `scaled_lr`, and so does the launcher's rule set
(multigpu/launch/launch_rules.py, torch-free like this module), so the LR the launcher
prints is exactly the LR the run will use.
"""

from __future__ import annotations

import math

from multigpu.config import TrainConfig


def scaled_lr(lr: float, rule: str, effective_batch: int, base_batch: int) -> float:
    """--lr scaled from the batch it was tuned for to the effective batch.

    linear: lr * effective/base (Goyal et al., for SGD); sqrt: lr * sqrt(effective/base),
    gentler, usual for Adam-like optimizers; none: lr unchanged.
    """
    ratio = effective_batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown LR scaling rule {rule!r}")


def effective_batch(config: TrainConfig, devices_per_step: int) -> int:
    """Samples in one optimizer step: --batch-size x devices x --grad-accum-steps."""
    assert isinstance(config.batch_size, int), "--batch-size auto is resolved before"
    return config.batch_size * devices_per_step * config.grad_accum_steps


def describe_lr(config: TrainConfig, effective_batch: int) -> str:
    """One line saying which LR is used and how it was derived."""
    lr = scaled_lr(config.lr, config.lr_scaling, effective_batch, config.lr_base_batch)
    if config.lr_scaling == "none":
        return f"lr {lr:g} (as given; --lr-scaling none)"
    return (
        f"lr {lr:g} = {config.lr:g} x {config.lr_scaling}({effective_batch}/{config.lr_base_batch}) "
        f"(--lr-scaling {config.lr_scaling})"
    )
