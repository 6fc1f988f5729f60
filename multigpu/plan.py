"""What a run says before its first step and after its last: the plan, its warnings, and the done line.

The lines read the live trainer, so they describe what really runs: the
resumed position, the LR after scaling, the batch each device gets. Only rank 0
prints them (the trainer passes them to its Reporter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from multigpu import config_checks
from multigpu.lr_scaling import describe_lr, scaled_lr
from multigpu.optim import lr_factor, peak_lr

if TYPE_CHECKING:  # the trainer imports this module
    from train_multi_gpu import MultiGPUTrainer


def plan_lines(trainer: MultiGPUTrainer) -> list[str]:
    """The device layout, the batch arithmetic, the optimizer and schedule, then a warning for each setting that
    these numbers do not really describe."""
    config, rt, progress = trainer.config, trainer.runtime, trainer.progress
    batch_rule = ("dp splits each batch of batch-size x GPUs over the GPUs" if rt.mode == "dp"
                  else f"{rt.mode}: --batch-size is per process" if rt.mode in ("ddp", "fsdp") else "one device")
    steps_left = (config.epochs - progress.epoch) * trainer.steps_per_epoch - trainer.steps_done_in_epoch()
    last_step = progress.global_step + max(0, steps_left)
    warmup_steps = round(config.warmup_epochs * trainer.steps_per_epoch)
    schedule = (f"schedule {config.lr_schedule}{_why_schedule(trainer)}, warm-up {warmup_steps} steps"
                if trainer.builtin_schedule else f"scheduler {type(trainer.scheduler).__name__} per "
                f"{trainer.scheduler_interval}")
    schedule += _lr_range(trainer, steps_left)
    lr = (describe_lr(config, trainer.effective_batch) if trainer.builtin_optimizer else f"lr {trainer.lr:g} (the "
          f"optimizer's own{'' if config.lr_scaling == 'none' else f', --lr-scaling {config.lr_scaling}'})")
    return [rt.describe(),
            f"batch {config.batch_size} per device x {rt.devices_per_step} devices x {config.grad_accum_steps} "
            f"accumulation = {trainer.effective_batch} effective ({batch_rule})",
            f"optimizer {type(trainer.optimizer).__name__}, {lr}; {schedule}, {trainer.steps_per_epoch} steps/epoch, "
            f"{last_step} steps{f' ({steps_left} left)' if progress.global_step else ''}; amp {trainer.amp.name}",
            *_warnings(trainer, warmup_steps)]


def _why_schedule(trainer: MultiGPUTrainer) -> str:
    """Why a user's optimizer keeps its LR: it has no scheduler, and lr_schedule was not set."""
    if trainer.builtin_optimizer or "lr_schedule" in trainer.given:
        return ""
    return " (your optimizer's own LR: no scheduler given, lr_schedule not set)"


def _lr_range(trainer: MultiGPUTrainer, steps_left: int) -> str:
    """The LR the next step applies and the highest the schedule reaches: the optimizer's LR above is only
    the schedule's base (a warm-up or OneCycleLR starts far below it)."""
    first = trainer.optimizer.param_groups[0]["lr"]
    steps = steps_left if trainer.scheduler_interval == "step" else trainer.config.epochs - trainer.progress.epoch
    if trainer.builtin_schedule:  # it only falls after its warm-up: the peak is at the warm-up's end at the latest
        warmup_steps = round(trainer.config.warmup_epochs * trainer.steps_per_epoch)
        steps = min(steps, max(0, warmup_steps - trainer.progress.global_step) + 1)
    peak = peak_lr(trainer.scheduler, max(1, steps))
    return f" (first step lr {first:g}, peak {'unknown' if peak is None else f'{peak:g}'})"


def _warnings(trainer: MultiGPUTrainer, warmup_steps: int) -> list[str]:
    config, samples_per_rank = trainer.config, trainer.sampler.usable // trainer.runtime.world_size
    total_steps = config.epochs * trainer.steps_per_epoch
    facts = config_checks.RunFacts(trainer.builtin_optimizer, trainer.builtin_schedule,
                                   convolutions=any(p.dim() == 4 for p in trainer.model.parameters()))
    lines = config_checks.ignored_flags(config, trainer.given, facts)  # flags given that do nothing
    if samples_per_rank < trainer.loader_batch * config.grad_accum_steps:
        lines.append(f"warning: each process gets {samples_per_rank} training samples per epoch, fewer than one "
                     f"step's {trainer.loader_batch} x {config.grad_accum_steps}: every step uses "
                     f"{samples_per_rank} samples per process, not the effective batch above")
    if config.lr_scaling == "linear" and "adam" in type(trainer.optimizer).__name__.lower():
        sqrt_lr = trainer.lr * scaled_lr(1.0, "sqrt", trainer.effective_batch, config.lr_base_batch) / scaled_lr(
            1.0, "linear", trainer.effective_batch, config.lr_base_batch)
        lines.append(f"warning: --lr-scaling linear is the rule for SGD; {type(trainer.optimizer).__name__} usually "
                     f"scales by sqrt (lr {trainer.lr:g} here, {sqrt_lr:g} with --lr-scaling sqrt)")
    if trainer.builtin_schedule and warmup_steps > total_steps:
        peak = trainer.lr * lr_factor(total_steps - 1, config, trainer.steps_per_epoch)
        lines.append(f"warning: the warm-up ({warmup_steps} steps) is longer than the run ({total_steps} steps): "
                     f"the LR peaks at {peak:g}, never at {trainer.lr:g}")
    return lines


# Where each optimizer usually trains (peak LR), for a run that did not learn: the first suspect is the LR.
USUAL_LR = {"sgd": "0.01 to 0.1", "adam": "1e-4 to 3e-3"}


def learning_warning(trainer: MultiGPUTrainer) -> Optional[str]:
    """One warning line when this run ended where it started: validation loss not below the first epoch's,
    accuracy at chance for the class count, or a training loss that grew tenfold; with the likely cause."""
    report, classes = trainer.report, trainer.evaluator.classes
    first, last = report.first_val or {}, report.last_val or {}
    signs = []
    if last is not first and "loss" in last and not last["loss"] < first["loss"]:
        signs.append(f"val loss {last['loss']:.4g}, not below the first epoch's {first['loss']:.4g}")
    if classes and classes > 1 and "acc" in last and last["acc"] < 1.5 / classes:
        signs.append(f"val acc {last['acc']:.4f}, chance for {classes} classes is {1 / classes:.4f}")
    if report.first_loss is not None and report.last_loss > 10 * report.first_loss:  # NaN never gets here
        signs.append(f"training loss grew from {report.first_loss:.4g} to {report.last_loss:.4g}")
    if not signs:
        return None
    name = type(trainer.optimizer).__name__
    usual = next((f"; {name} usually trains at {lrs}" for key, lrs in USUAL_LR.items() if key in name.lower()), "")
    scaled = "" if trainer.config.lr_scaling == "none" else f" after --lr-scaling {trainer.config.lr_scaling}"
    return (f"warning: the run ended where it started ({'; '.join(signs)}): check the LR first, "
            f"lr {trainer.lr:g}{scaled}{usual}")


def done_line(trainer: MultiGPUTrainer, summary: dict[str, Any]) -> str:
    """The end-of-run line: the best monitored value, epochs, wall time, throughput and the telemetry totals."""
    name = trainer.monitor.name
    best = (f"best {name.replace('_', ' ', 1)} {summary['best']:.4f}" if name and summary["best"] is not None
            else "no validation set" if trainer.val_dataset is None else "no finite validation metric")
    return (f"done: {best}, {summary['epochs']} epochs, wall time {summary['wall_time']:.1f}s, "
            f"{summary['samples_per_sec']:.0f} samples/s "
            f"({summary['samples_per_sec'] / trainer.runtime.devices_per_step:.0f} per device)"
            f"{trainer.telemetry.summary_text(summary)}")
