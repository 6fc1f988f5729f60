"""What a run says before its first step and after its last: the plan, its warnings, and the done line.

The lines read the live run's facts (a `PlanFacts` the trainer fills in), so
they describe what really runs: the resumed position, the LR after scaling, the
batch each device gets. Only rank 0 prints them (the trainer passes them to its
Reporter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from multigpu import config_checks
from multigpu.config import TrainConfig
from multigpu.loop.optim import lr_factor, peak_lr
from multigpu.lr_scaling import describe_lr, scaled_lr
from multigpu.monitoring.reporting import Reporter
from multigpu.parallel.distributed import Runtime


@dataclass
class PlanFacts:
    """What the plan lines describe: the run's settings, its optimizer and schedule, its batches and where it
    starts (after a resume)."""

    config: TrainConfig
    runtime: Runtime
    given: frozenset[str]  # the flags the user set
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scheduler_interval: str  # "step" or "epoch"
    builtin_optimizer: bool
    builtin_schedule: bool
    lr: float  # the optimizer's LR after scaling: the schedule's base
    effective_batch: int
    loader_batch: int  # samples per micro-batch on each process
    steps_per_epoch: int  # 0: a stream without __len__, an epoch of one pass whose steps are unknown
    samples_per_epoch: int  # the sampler's usable samples, all ranks together
    convolutions: bool  # the model has 2-d convolutions (--channels-last helps)
    amp: str  # the precision's name
    progress: Any  # epoch and global_step to start from
    steps_done_in_epoch: int
    data: str = ""  # where the training batches come from (data/device_data.py; a stream: data/streaming.py)
    loss: str = (
        ""  # how the loss averages, when that is worth a line: over tokens, or as --loss-weighting asked
    )
    replicas: str = ""  # --fault-tolerance: the replica groups, what a lost one costs, the bytes between them
    adapters: str = ""  # --lora-r: what trains (multigpu/parallel/lora.py)


def plan_lines(run: PlanFacts) -> list[str]:
    """The device layout, the batch arithmetic, the optimizer and schedule, then a warning for each setting that
    these numbers do not really describe."""
    config, rt, progress = run.config, run.runtime, run.progress
    batch_rule = (
        "dp splits each batch of batch-size x GPUs over the GPUs"
        if rt.mode == "dp"
        else f"{rt.mode}: --batch-size is per process"
        if rt.mode in ("ddp", "fsdp")
        else "one device"
    )
    if rt.replica_groups > 1:
        batch_rule = (
            f"--fault-tolerance: --batch-size is per process of each of {rt.replica_groups} replica groups"
        )
    steps_left: int | None  # None for a stream without __len__, below
    steps_left = (config.epochs - progress.epoch) * run.steps_per_epoch - run.steps_done_in_epoch
    if config.max_steps:  # --max-steps counts optimizer steps in all, whichever end comes first
        steps_left = min(steps_left, config.max_steps - progress.global_step)
    length = (
        f"{run.steps_per_epoch} steps/epoch, {progress.global_step + max(0, steps_left)} steps"
        f"{f' ({steps_left} left)' if progress.global_step else ''}"
    )
    if not run.steps_per_epoch:  # a stream without __len__: its passes' steps are counted as they come
        steps_left = None
        length = f"an epoch is one pass of the stream (no __len__: steps unknown), {config.epochs} epochs"
    warmup_steps = config.warmup_length(run.steps_per_epoch)
    schedule = (
        f"schedule {config.lr_schedule}{_why_schedule(run)}, warm-up {warmup_steps} steps"
        if run.builtin_schedule
        else f"scheduler {type(run.scheduler).__name__} per {run.scheduler_interval}"
    )
    schedule += _lr_range(run, steps_left)
    lr = (
        describe_lr(config, run.effective_batch)
        if run.builtin_optimizer
        else f"lr {run.lr:g} (the "
        f"optimizer's own{'' if config.lr_scaling == 'none' else f', --lr-scaling {config.lr_scaling}'})"
    )
    return [
        rt.describe(),
        *run.replicas.splitlines(),
        f"batch {config.batch_size} per device x {rt.devices_per_step * rt.replica_groups} devices x "
        f"{config.grad_accum_steps} accumulation = {run.effective_batch} effective ({batch_rule})",
        f"optimizer {type(run.optimizer).__name__}, {lr}; {schedule}, {length}; amp {run.amp}",
        *([run.adapters] if run.adapters else []),
        *_frozen(run),
        *([run.data] if run.data else []),
        *([run.loss] if run.loss else []),
        *_warnings(run, warmup_steps),
    ]


def _frozen(run: PlanFacts) -> list[str]:
    """The note of a run at --lr 0 (the built-in optimizer's): what it is good for, and that it trains nothing."""
    if not run.builtin_optimizer or run.config.lr != 0:
        return []
    return [
        "--lr 0: the weights will not change (every step applies LR 0: a frozen run, to measure throughput or "
        "to evaluate); buffers a forward updates, such as BatchNorm's running statistics, still do"
    ]


def _why_schedule(run: PlanFacts) -> str:
    """Why a user's optimizer keeps its LR: it has no scheduler, and lr_schedule was not set."""
    if run.builtin_optimizer or "lr_schedule" in run.given:
        return ""
    return " (your optimizer's own LR: no scheduler given, lr_schedule not set)"


def _lr_range(run: PlanFacts, steps_left: int | None) -> str:
    """The LR the next step applies and the highest the schedule reaches: the optimizer's LR above is only
    the schedule's base (a warm-up or OneCycleLR starts far below it). `steps_left` None: not known."""
    first = run.optimizer.param_groups[0]["lr"]
    steps = steps_left if run.scheduler_interval == "step" else run.config.epochs - run.progress.epoch
    if steps is None and not run.builtin_schedule:
        return f" (first step lr {first:g}, peak unknown)"
    if (
        run.builtin_schedule
    ):  # it only falls after its warm-up: the peak is at the warm-up's end at the latest
        warmup_steps = run.config.warmup_length(run.steps_per_epoch)
        steps = min(steps if steps is not None else 1, max(0, warmup_steps - run.progress.global_step) + 1)
    assert steps is not None  # unknown returned above, or found just above
    peak = peak_lr(run.scheduler, max(1, steps))
    return f" (first step lr {first:g}, peak {'unknown' if peak is None else f'{peak:g}'})"


def _warnings(run: PlanFacts, warmup_steps: int) -> list[str]:
    config, samples_per_rank = run.config, run.samples_per_epoch // run.runtime.world_size
    total_steps = config.planned_steps(run.steps_per_epoch)
    facts = config_checks.RunFacts(
        run.builtin_optimizer,
        run.builtin_schedule,
        convolutions=run.convolutions,
        steps_per_epoch=run.steps_per_epoch,
    )
    lines = config_checks.ignored_flags(config, run.given, facts)  # flags given that do nothing
    if run.steps_per_epoch and samples_per_rank < run.loader_batch * config.grad_accum_steps:
        lines.append(
            f"warning: each process gets {samples_per_rank} training samples per epoch, fewer than one "
            f"step's {run.loader_batch} x {config.grad_accum_steps}: every step uses "
            f"{samples_per_rank} samples per process, not the effective batch above"
        )
    if config.lr_scaling == "linear" and "adam" in type(run.optimizer).__name__.lower():
        sqrt_lr = (
            run.lr
            * scaled_lr(1.0, "sqrt", run.effective_batch, config.lr_base_batch)
            / scaled_lr(1.0, "linear", run.effective_batch, config.lr_base_batch)
        )
        lines.append(
            f"warning: --lr-scaling linear is the rule for SGD; {type(run.optimizer).__name__} usually "
            f"scales by sqrt (lr {run.lr:g} here, {sqrt_lr:g} with --lr-scaling sqrt)"
        )
    if run.builtin_schedule and warmup_steps > total_steps:
        peak = run.lr * lr_factor(total_steps - 1, config, run.steps_per_epoch)
        lines.append(
            f"warning: the warm-up ({warmup_steps} steps) is longer than the run ({total_steps} steps): "
            f"the LR peaks at {peak:g}, never at {run.lr:g}"
        )
    return lines


# Where each optimizer usually trains (peak LR), for a run that did not learn: an LR outside it is the first suspect.
USUAL_LR = {"sgd": (0.01, 0.1), "adam": (1e-4, 3e-3)}
# A loss that ended above this share of where it started did not fall (a run that learns slowly gets below it).
NOT_FALLEN = 0.999
# A loss that ended this many times above this run's first step's diverged: the model got far worse than it started
# (AdamW at lr 5 ended 20 to 50 times above an untrained model's 2.3; a run that overfits stays well below).
DIVERGED = 10


def chance_accuracy(classes: int | None) -> float | None:
    """Below this accuracy a classifier of `classes` classes is at chance (1/classes) for this project: less than
    half of chance above it, and at most 0.1 above it (0.15 for 10 classes, 0.6 for 2); None without classes."""
    if not classes or classes < 2:
        return None
    return 1 / classes + min(0.5 / classes, 0.1)


def at_chance(report: Reporter, classes: int | None) -> str | None:
    """The last validation accuracy as a sign, when it is at chance (`chance_accuracy`); else None."""
    acc = (report.last_val or {}).get("acc")
    below = chance_accuracy(classes)
    if acc is None or below is None or classes is None or acc >= below:  # classes: None gives below None too
        return None
    return f"val acc {acc:.4f}, chance for {classes} classes is {1 / classes:.4f}"


def no_better_than_chance(report: Reporter, classes: int | None) -> bool:
    """Whether the last validation accuracy is at most chance (1/classes): nothing learned that guessing lacks."""
    acc = (report.last_val or {}).get("acc")
    # chance_accuracy is None where classes is (or is below 2).
    return (
        acc is not None
        and classes is not None
        and chance_accuracy(classes) is not None
        and acc <= 1 / classes
    )


def divergence_signs(report: Reporter) -> list[str]:
    """Evidence that this run diverged: its training loss, or its last validation loss, ended `DIVERGED` times
    above its first step's training loss (the same loss on the same kind of samples; a positive one only)."""
    start = report.start_loss
    last = report.last_val or {}
    signs: list[str] = []
    if start is None or report.last_loss is None or not start > 0:  # the last loss is set with the start
        return signs
    if report.last_loss > DIVERGED * start:  # NaN never gets here
        signs.append(f"training loss grew from {start:.4g} to {report.last_loss:.4g}")
    if last.get("loss", 0) > DIVERGED * start:
        signs.append(
            f"val loss {last['loss']:.4g}, {last['loss'] / start:.3g}x the first step's loss {start:.4g}"
        )
    return signs


def no_learning_signs(report: Reporter, classes: int | None) -> list[str]:
    """Evidence, as `report` saw it, that this run did not learn: it diverged (`divergence_signs`); or its final
    validation accuracy is no better than chance (`no_better_than_chance`); or its validation loss did not fall (by
    0.1%, over two or more evaluations) while its accuracy stayed near chance or its training loss did not fall
    either; or, without two evaluations, its training loss did not fall (over two or more logged intervals). An
    accuracy near chance but above it is no evidence alone: a run that learns slowly is there too; nor is a
    validation loss that rose while the training loss fell (overfitting)."""
    first, last, signs = report.first_val or {}, report.last_val or {}, divergence_signs(report)
    chance = at_chance(report, classes)
    first_loss = report.first_loss
    last_loss = report.last_loss
    # Both losses are set from the first interval on.
    training_flat = (
        report.loss_intervals > 1
        and first_loss is not None
        and last_loss is not None
        and not last_loss < NOT_FALLEN * first_loss
    )
    if last is not first and "loss" in last:  # two evaluations, of the same samples: no noise between them
        if not last["loss"] < NOT_FALLEN * first["loss"] and (chance or training_flat):
            signs.append(f"val loss {first['loss']:.4g} -> {last['loss']:.4g} since the first epoch")
    elif training_flat and not signs:
        signs.append(f"training loss {report.first_loss:.4g} -> {report.last_loss:.4g} since the first log")
    return signs + [chance] if chance and (signs or no_better_than_chance(report, classes)) else signs


def learning_warning(
    report: Reporter, classes: int | None, optimizer: torch.optim.Optimizer, lr: float, lr_scaling: str
) -> str | None:
    """One warning line when this run shows it did not learn (`no_learning_signs`), with the likely cause: the LR
    (`lr`, after `lr_scaling`) of `optimizer` when it is outside the optimizer's usual range, else the data."""
    signs = no_learning_signs(report, classes)
    if not signs:
        return None
    name = type(optimizer).__name__
    usual = next((lrs for key, lrs in USUAL_LR.items() if key in name.lower()), None)
    scaled = "" if lr_scaling == "none" else f" after --lr-scaling {lr_scaling}"
    if usual is None:
        advice = f"check the LR first, lr {lr:g}{scaled}"
    elif usual[0] <= lr <= usual[1]:
        advice = (
            f"lr {lr:g}{scaled} is in {name}'s usual range ({usual[0]:g} to {usual[1]:g}): check the data and "
            f"targets first (do the targets follow the inputs?), then the LR"
        )
    else:
        advice = (
            f"check the LR first, lr {lr:g}{scaled}; {name} usually trains at {usual[0]:g} to {usual[1]:g}"
        )
    what = "diverged" if divergence_signs(report) else "ended where it started"
    return f"warning: the run {what} ({'; '.join(signs)}): {advice}"


def done_line(
    summary: dict[str, Any],
    monitor: str | None,
    has_val: bool,
    devices_per_step: int,
    telemetry_text: str,
    epoch_share: float | None = 0.0,
) -> str:
    """The end-of-run line: the best monitored value (`monitor` names it), how long it trained (`trained`, of
    `epoch_share`), wall time, throughput (also per device, of `devices_per_step`) and the telemetry totals
    (`telemetry_text`)."""
    best = (
        f"best {monitor.replace('_', ' ', 1)} {summary['best']:.4f}"
        if monitor and summary["best"] is not None
        else "no finite validation metric"
        if has_val
        else "no validation set"
    )
    return (
        f"done: {best}, {trained(summary['epochs'], summary['global_step'], epoch_share)}, wall time "
        f"{summary['wall_time']:.1f}s, "
        f"{summary['samples_per_sec']:.0f} samples/s "
        f"({summary['samples_per_sec'] / devices_per_step:.0f} per device){telemetry_text}"
    )


def trained(epochs: int, steps: int, epoch_share: float | None) -> str:
    """How long a run trained: its whole epochs, or, where it ended inside one (--max-steps), its steps and the
    epochs they make (`epoch_share`: the share of the last epoch trained, 0 at an epoch's end; None where an
    epoch's length is unknown, a stream's)."""
    if epoch_share == 0:
        return f"{epochs} epochs"
    return f"{steps} steps" + ("" if epoch_share is None else f" ({epochs + epoch_share:.2f} epochs)")
