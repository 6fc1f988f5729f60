"""Optimizer, the LR scaling rule and the LR schedule.

`scaled_lr` is the one place the LR scaling formula lives: the trainer uses it
and the launcher calls it (`python -m multigpu.optim --lr ... `) so the LR it
prints is exactly the LR the run will use.
"""

from __future__ import annotations

import argparse
import math

import torch

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


def describe_lr(config: TrainConfig, effective_batch: int) -> str:
    """One line saying which LR is used and how it was derived."""
    lr = scaled_lr(config.lr, config.lr_scaling, effective_batch, config.lr_base_batch)
    if config.lr_scaling == "none":
        return f"lr {lr:g} (as given; --lr-scaling none)"
    return (f"lr {lr:g} = {config.lr:g} x {config.lr_scaling}({effective_batch}/{config.lr_base_batch}) "
            f"(--lr-scaling {config.lr_scaling})")


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


def _main() -> None:
    """`python -m multigpu.optim --lr 0.1 --lr-scaling linear --effective-batch 256 --lr-base-batch 32`"""
    parser = argparse.ArgumentParser(description="print the LR a run would use")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none")
    parser.add_argument("--effective-batch", type=int, required=True)
    parser.add_argument("--lr-base-batch", type=int, default=32)
    args = parser.parse_args()
    # repr: the shortest text that round-trips, so the printed LR is bit-exactly the one used.
    print(repr(scaled_lr(args.lr, args.lr_scaling, args.effective_batch, args.lr_base_batch)))


if __name__ == "__main__":
    _main()
