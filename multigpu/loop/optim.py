"""Optimizer and LR schedule: the built-in ones from TrainConfig, or the user's own.

The LR scaling rule (multigpu/lr_scaling.py) applies to either: a user's
optimizer has every group's LR multiplied by the rule's factor before its
schedule is built.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import warnings
from collections.abc import Collection, Iterable
from typing import Any, Callable, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.lr_scaling import scaled_lr

OptimizerArg = Union[None, Optimizer, Callable[[Iterable[torch.nn.Parameter]], Optimizer]]
# A scheduler, or a function that builds one: `optimizer -> scheduler`, or `(optimizer, total_steps) -> scheduler`
# (users_scheduler tells them apart by the parameter's name).
SchedulerArg = Union[None, LRScheduler, Callable[..., Any]]
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
        assert optimizer is not None  # None builds the built-in one instead (build_optimizer)
        optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a function params -> Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    ours = {id(p) for p in model.parameters()}
    if any(id(p) not in ours for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer holds parameters that are not the model's: build it on the model "
            "given to MultiGPUTrainer, or pass a function params -> Optimizer (which --multi-gpu fsdp "
            "needs: sharding replaces the parameters by their shards)"
        )
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * lr_factor_
    return optimizer


def lr_factor(step: int, config: TrainConfig, steps_per_epoch: int, steps_offset: int = 0) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based) of this run's count.

    Linear warm-up over warmup_steps (or warmup_epochs), then cosine to 0 / step decay / constant.
    Everything is counted in optimizer steps, so gradient accumulation does not
    stretch or squeeze the schedule. `steps_offset`: how far a resume placed the
    schedule ahead of the optimizer steps taken (TrainConfig.planned_steps).
    """
    warmup_steps = config.warmup_length(steps_per_epoch)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    if config.lr_schedule == "step":
        decay_every = max(1, round(config.lr_step_epochs * steps_per_epoch))
        return config.lr_gamma ** ((step - warmup_steps) // decay_every)
    total_steps = config.planned_steps(steps_per_epoch, steps_offset)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def schedule_rule(config: TrainConfig, steps_per_epoch: int, steps_offset: int = 0) -> Callable[[int], float]:
    """The built-in schedule's multiplier of the base LR at each step (`lr_factor`). A function, not an object:
    LambdaLR saves an object's attributes in the checkpoint, and a resume must follow its own run's settings."""
    return lambda step: lr_factor(step, config, steps_per_epoch, steps_offset)


def build_scheduler(optimizer: Optimizer, config: TrainConfig, steps_per_epoch: int) -> LambdaLR:
    """The built-in schedule: a LambdaLR stepped once per optimizer step."""
    return LambdaLR(optimizer, schedule_rule(config, steps_per_epoch))


def schedule_config(
    config: TrainConfig, given: Collection[str], users_optimizer: bool, users_schedule: bool
) -> TrainConfig:
    """The config the built-in schedule follows. A user's optimizer without a scheduler keeps its own LR, as it
    would in plain PyTorch (lr_schedule constant), unless lr_schedule was set; a warm-up asked for still applies."""
    if users_optimizer and not users_schedule and "lr_schedule" not in given:
        return dataclasses.replace(config, lr_schedule="constant")
    return config


def users_scheduler(
    scheduler: SchedulerArg, optimizer: Optimizer, lr_scaling: str, total_steps: float
) -> Any:
    """The user's scheduler: built here from `optimizer -> scheduler` (or `(optimizer, total_steps) ->
    scheduler`, for OneCycleLR and the like: the times the trainer will step it; math.inf for a stream without
    a length, where such a schedule is refused before), or given built (then on `optimizer`)."""
    if callable(scheduler) and not hasattr(scheduler, "step"):
        if takes_total_steps(scheduler):
            return scheduler(optimizer, total_steps=total_steps)
        return scheduler(optimizer)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "the scheduler drives another optimizer than the trainer's: pass a function "
            "optimizer -> scheduler, or build it on the optimizer you give the trainer"
        )
    if lr_scaling != "none":
        raise UsageError(
            f"--lr-scaling {lr_scaling} cannot rescale a scheduler that is already built (it "
            f"captured the unscaled LR): pass scheduler=lambda optimizer: ... instead"
        )
    return scheduler


def takes_total_steps(scheduler: SchedulerArg) -> bool:
    """Whether `scheduler` is a function `(optimizer, total_steps) -> scheduler` (OneCycleLR and the like)."""
    return callable(scheduler) and not hasattr(scheduler, "step") and "total_steps" in _parameters(scheduler)


def _parameters(function: Callable) -> Collection[str]:
    """The names a function takes; none known for one that hides its signature (some C functions)."""
    try:
        return inspect.signature(function).parameters.keys()
    except (TypeError, ValueError):
        return ()


def peak_lr(scheduler: Any, steps: int, limit: int = 100_000) -> float | None:
    """The highest LR of the first param group over the scheduler's next `steps` steps, found by stepping a copy
    that drives a stand-in optimizer (the real one, its parameters and the scheduler are left as they are).

    None when that cannot be known cheaply: more than `limit` steps, or a scheduler whose step needs more
    (ReduceLROnPlateau wants the metric) or that fails on the copy.
    """
    optimizer = scheduler.optimizer
    if steps > limit:
        return None
    try:
        stand_in = torch.optim.SGD(
            [
                {**{k: v for k, v in group.items() if k != "params"}, "params": [torch.zeros(1)]}
                for group in optimizer.param_groups
            ],
            lr=0.0,
        )
        dry = copy.deepcopy(scheduler, memo={id(optimizer): stand_in})
        peak = stand_in.param_groups[0]["lr"]
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no step is taken here
            warnings.simplefilter("ignore")
            for _ in range(steps - 1):
                dry.step()
                peak = max(peak, stand_in.param_groups[0]["lr"])
    except Exception:  # noqa: BLE001 -- any scheduler may be given; the peak is only for the plan line
        return None
    return peak


def move_schedule_to(
    scheduler: LambdaLR, step: int, base_lrs: list[float], rule: Callable[[int], float] | None = None
) -> None:
    """Put the built-in schedule at optimizer step `step` of this run, each param group starting from its
    `base_lrs` entry (and following `rule`, `schedule_rule`'s, where given): the LR of the next step is then the
    schedule's value there.

    A resume does it, so the rest of the run follows this run's settings: a new
    --lr or --epochs, or another number of processes, whose steps per epoch
    differ (the schedule continues from the same point of training counted in
    samples; docs/checkpoints.md, "Resume on another world size"). With the
    settings unchanged it sets exactly what the schedule's own step would.
    """
    if rule is not None:
        scheduler.lr_lambdas = [rule] * len(scheduler.optimizer.param_groups)
    scheduler.base_lrs = list(base_lrs)
    scheduler.last_epoch = step
    lrs = [base * rule(step) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr, base in zip(scheduler.optimizer.param_groups, lrs, base_lrs):
        group["lr"], group["initial_lr"] = lr, base
    scheduler._last_lr = lrs  # what get_last_lr() reports


def group_settings(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (all but its parameters), copied: what this run built, kept before a
    checkpoint's param groups replace them (see `keep_run_settings`)."""
    return [
        {key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups
    ]


def keep_run_settings(
    optimizer: Optimizer,
    scheduler: Any,
    built: list[dict[str, Any]],
    step: int,
    builtin_schedule: bool,
    builtin_optimizer: bool,
    rule: Callable[[int], float] | None = None,
) -> None:
    """After a resume has loaded the checkpoint's optimizer and scheduler: this run's LR and weight decay (`built`,
    from `group_settings` before the load) hold from the next step, as the changed-settings line says; the
    optimizer's state (its moments, step counts) and the schedule's position continue (docs/sweeps.md,
    "Resume").

    Weight decay is this run's in every group (no scheduler changes it). The built-in schedule moves to `step`
    from this run's base LRs (following `rule`, where given), and the built-in SGD takes this run's --momentum.
    A scheduler of the user's continues the checkpoint's LR, which cannot be given another base: a base LR other
    than the checkpoint's is refused in one line.
    """
    if not builtin_schedule:
        for ours, group in zip(built, optimizer.param_groups):
            theirs = group.get("initial_lr")
            if ours.get("initial_lr") not in (None, theirs) and theirs is not None:
                raise UsageError(
                    f"this run's optimizer starts from lr {ours['initial_lr']:g} and the checkpoint's "
                    f"from {theirs:g}, but your scheduler {type(scheduler).__name__} continues the "
                    f"checkpoint's LR (a scheduler's state cannot be moved to another base LR): resume "
                    f"with lr {theirs:g}, or start afresh in a new --save-dir"
                )
    kept = ("weight_decay", "momentum") if builtin_optimizer and builtin_schedule else ("weight_decay",)
    for ours, group in zip(built, optimizer.param_groups):
        group.update({key: ours[key] for key in kept if key in ours and key in group})
    if builtin_schedule:
        move_schedule_to(scheduler, step, [ours["initial_lr"] for ours in built], rule)


def refuse_schedules_without_length(config: Any, builtin: bool, scheduler: Any, interval: str) -> None:
    """A stream without __len__ trains by passes, of steps unknown until each ends: UsageError for a schedule
    that needs the run's length in steps (cosine or step decay, a warm-up in epochs, a scheduler function taking
    total_steps), naming the flags that give it. A constant LR, or a scheduler of your own that needs no total,
    trains as it is."""
    unknown = "this training stream has no __len__, so an epoch is one pass of steps unknown until it ends"
    give = (
        "give --steps-per-epoch N or --max-steps N (steps_per_epoch=N, max_steps=N), or the dataset a __len__"
    )
    if builtin and config.warmup_epochs:
        raise UsageError(
            f"--warmup-epochs {config.warmup_epochs:g} counts steps in epochs, and {unknown}: {give}; "
            f"or drop the warm-up"
        )
    if builtin and config.lr_schedule != "constant":
        raise UsageError(
            f"--lr-schedule {config.lr_schedule} needs the run's length in steps, and {unknown}: "
            f"{give}; or use --lr-schedule constant"
        )
    if not builtin and interval == "step" and takes_total_steps(scheduler):
        raise UsageError(f"your scheduler takes total_steps, and {unknown}: {give}")


@dataclasses.dataclass
class Optimization:
    """The optimizer and LR schedule, built-in or the user's, with the LR scaling rule applied to either."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    scheduler_interval: str  # "step" or "epoch"
    builtin_optimizer: bool
    builtin_schedule: bool
    lr: float  # the first param group's LR after scaling: the schedule's base
    total_steps: float  # optimizer steps of the whole run; inf for a stream without __len__
    config: TrainConfig  # with the schedule a user's optimizer gets (schedule_config)


def optimization(
    model: torch.nn.Module,
    config: TrainConfig,
    given: Collection[str],
    optimizer: OptimizerArg,
    scheduler: SchedulerArg,
    scheduler_interval: str,
    effective_batch: int,
    steps_per_epoch: int,
    stream: bool,
) -> Optimization:
    """The run's optimizer and schedule. A stream without __len__ (`steps_per_epoch` 0) knows no total: it is
    taken as unbounded where a length is only weighed (room for checkpoints, --autotune's payback), and a
    schedule that needs it exactly is refused in one line."""
    factor = scaled_lr(1.0, config.lr_scaling, effective_batch, config.lr_base_batch)  # the rule, for either
    total_steps = config.planned_steps(steps_per_epoch) if steps_per_epoch else math.inf
    built = (
        build_optimizer(model, config, config.lr * factor)
        if optimizer is None
        else users_optimizer(optimizer, model, factor)
    )
    lr = built.param_groups[0]["lr"]  # the schedule's base: a warm-up's schedule starts below it
    config = schedule_config(config, given, optimizer is not None, scheduler is not None)
    interval = "step" if scheduler is None else scheduler_interval
    if stream and not steps_per_epoch:
        refuse_schedules_without_length(config, scheduler is None, scheduler, interval)
    schedule = (
        build_scheduler(built, config, steps_per_epoch)
        if scheduler is None
        else users_scheduler(
            scheduler,
            built,
            config.lr_scaling,
            total_steps if scheduler_interval == "step" else config.epochs,
        )
    )
    return Optimization(
        built, schedule, interval, optimizer is None, scheduler is None, lr, total_steps, config
    )
