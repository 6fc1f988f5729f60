"""Optimizer and LR schedule (the LR scaling rule is in multigpu/lr_scaling.py)."""

from __future__ import annotations

import math

import torch

from multigpu.config import TrainConfig


def build_optimizer(model: torch.nn.Module, config: TrainConfig, lr: float) -> torch.optim.Optimizer:
    """SGD (with momentum) or AdamW over the model's trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)


def lr_factor(step: int, config: TrainConfig, steps_per_epoch: int) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based).

    Linear warm-up over warmup_epochs, then cosine to 0 / step decay / constant.
    Everything is counted in optimizer steps, so gradient accumulation does not
    stretch or squeeze the schedule.
    """
    warmup_steps = round(config.warmup_epochs * steps_per_epoch)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    if config.lr_schedule == "step":
        decay_every = max(1, round(config.lr_step_epochs * steps_per_epoch))
        return config.lr_gamma ** ((step - warmup_steps) // decay_every)
    total_steps = config.epochs * steps_per_epoch
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, steps_per_epoch))
