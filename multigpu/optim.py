"""Optimizer and LR schedule: the built-in ones from TrainConfig, or the user's own.

The LR scaling rule (multigpu/lr_scaling.py) applies to either: a user's
optimizer has every group's LR multiplied by the rule's factor before its
schedule is built.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

OptimizerArg = Union[None, Optimizer, Callable[[Iterable[torch.nn.Parameter]], Optimizer]]
SchedulerArg = Union[None, LRScheduler, Callable[[Optimizer], Any]]
INTERVALS = ("step", "epoch")


def build_optimizer(model: torch.nn.Module, config: TrainConfig, lr: float) -> Optimizer:
    """SGD (with momentum) or AdamW over the model's trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)


def users_optimizer(optimizer: OptimizerArg, model: torch.nn.Module, lr_factor_: float) -> Optimizer:
    """The user's optimizer (built, or built here from `params -> Optimizer`), its LRs times the scaling factor."""
    if not isinstance(optimizer, Optimizer):
        optimizer = optimizer([p for p in model.parameters() if p.requires_grad])  # type: ignore[misc]
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a function params -> Optimizer, "
                        f"got {type(optimizer).__name__}")
    ours = {id(p) for p in model.parameters()}
    if any(id(p) not in ours for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's: build it on the model "
                         "given to MultiGPUTrainer (or pass a function params -> Optimizer)")
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * lr_factor_
    return optimizer


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


def build_scheduler(optimizer: Optimizer, config: TrainConfig, steps_per_epoch: int) -> LambdaLR:
    """The built-in schedule: a LambdaLR stepped once per optimizer step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, config, steps_per_epoch))


def users_scheduler(scheduler: SchedulerArg, optimizer: Optimizer, lr_scaling: str) -> Any:
    """The user's scheduler: built here from `optimizer -> scheduler`, or given built (then on `optimizer`)."""
    if callable(scheduler) and not hasattr(scheduler, "step"):
        return scheduler(optimizer)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("the scheduler drives another optimizer than the trainer's: pass a function "
                         "optimizer -> scheduler, or build it on the optimizer you give the trainer")
    if lr_scaling != "none":
        raise UsageError(f"--lr-scaling {lr_scaling} cannot rescale a scheduler that is already built (it "
                         f"captured the unscaled LR): pass scheduler=lambda optimizer: ... instead")
    return scheduler


def move_schedule_to(scheduler: LambdaLR, step: int, base_lr: float) -> None:
    """Put the built-in schedule at optimizer step `step` of this run, starting from `base_lr`.

    A resume on another number of processes changes the steps per epoch: the
    schedule continues from the same point of training counted in samples, in
    the new run's steps (MULTI_GPU_GUIDE.md, "Resume on another world size").
    """
    scheduler.base_lrs = [base_lr for _ in scheduler.optimizer.param_groups]
    scheduler.last_epoch = step
    lrs = [base * rule(step) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"], group["initial_lr"] = lr, base_lr
    scheduler._last_lr = lrs  # what get_last_lr() reports
