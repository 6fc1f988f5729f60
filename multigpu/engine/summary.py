"""What fit() returns and says at the end of a run: the summary, the warning of a run that did not learn, the
done line and TensorBoard's hparams."""

from __future__ import annotations

import time
from typing import Any

import torch

from multigpu.config import TrainConfig
from multigpu.loop.progress import Progress
from multigpu.monitoring import plan
from multigpu.monitoring.reporting import Reporter
from multigpu.monitoring.telemetry import Telemetry


def summary(
    metrics: dict[str, float],
    monitor: str | None,
    progress: Progress,
    samples: float,
    seconds: float,
    telemetry: Telemetry,
    **extra: Any,
) -> dict[str, Any]:
    """What fit returns: the last validation metrics, the best monitored value, progress and throughput."""
    best = progress.best_value
    return {
        **metrics,
        "monitor": monitor,
        "best": best,
        **({f"best_{monitor}": best} if monitor else {}),
        "epochs": progress.epoch,
        "global_step": progress.global_step,
        "samples_per_sec": samples / max(seconds, 1e-9),
        **telemetry.summary(),
        **extra,
    }


def report_done(
    report: Reporter,
    result: dict[str, Any],
    config: TrainConfig,
    classes: int | None,
    optimizer: torch.optim.Optimizer,
    lr: float,
    has_validation: bool,
    devices_per_step: int,
    telemetry: Telemetry,
    epoch_share: float | None = 0.0,
    also: str = "",
) -> None:
    """The end-of-run lines and hparams; `result` gets `did_not_learn` (why) where the run shows it did not
    learn or ended at chance (a sweep marks such runs: multigpu/sweep/summary.py). `epoch_share`: of the epoch it
    ended in (plan.trained); `also`: the done line's last words (--fault-tolerance's bytes between groups)."""
    warning = plan.learning_warning(report, classes, optimizer, lr, config.lr_scaling)
    if warning:
        report.line(warning)
    why = "; ".join(plan.no_learning_signs(report, classes)) or plan.at_chance(report, classes)
    if why:
        result["did_not_learn"] = why
    report.line(
        plan.done_line(
            result,
            result["monitor"],
            has_validation,
            devices_per_step,
            telemetry.summary_text(result) + (f"; {also}" if also else ""),
            epoch_share,
        )
    )
    report.hparams(
        config,
        {
            key: value
            for key, value in result.items()
            if isinstance(value, float) and (key.startswith("val_") or key.startswith("best_"))
        },
    )


def plan_facts(run: Any) -> plan.PlanFacts:
    """What the plan lines describe (multigpu/monitoring/plan.py), read from the live run (the trainer)."""
    return plan.PlanFacts(
        run.config,
        run.runtime,
        run.given,
        run.optimizer,
        run.scheduler,
        run.scheduler_interval,
        run.builtin_optimizer,
        run.builtin_schedule,
        run.lr,
        run.effective_batch,
        run.loader_batch,
        run.steps_per_epoch,
        run.sampler.usable,
        any(p.dim() == 4 for p in run.model.parameters()),
        run.amp.name,
        run.progress,
        run.steps_done_in_epoch(),
        run.stream.plan_line() if run.stream is not None else run.on_device.line,  # a stream: how it is split
        loss_line(run.weighting),
        run.replicas.plan_line() if run.replicas is not None else "",
        run.adapters.plan_line() if run.adapters is not None else "",
    )


def loss_line(weighting: Any) -> str:
    """The plan's line on how the loss averages: said for a loss over tokens, or where --loss-weighting was
    given; a run of images under auto has nothing new to say."""
    if weighting.setting == "auto" and weighting.mode == "samples":
        return ""
    return weighting.describe()


def run_summary(run: Any, **extra: Any) -> dict[str, Any]:
    """`summary` of a MultiGPUTrainer as it stands."""
    return summary(
        run.metrics,
        run.monitor.name,
        run.progress,
        run.sync.samples,
        run.sync.seconds,
        run.telemetry,
        **extra,
    )


def finish(run: Any, started: float) -> dict[str, Any]:
    """The end of a run that trained to its end (or stopped early on a callback's word): the lines that say so,
    TensorBoard's hparams, and what fit returns."""
    if run.stop_reason:
        run.report.line(run.stop_reason)
    stopped_early = {"stopped_early": run.stop_reason} if run.stop_reason else {}
    replicas = run.replicas.summary() if run.replicas is not None else {}  # --fault-tolerance's account
    result = run_summary(run, wall_time=time.perf_counter() - started, **stopped_early, **replicas)
    samples_per_epoch = getattr(run.sampler, "usable", None)  # a stream's epoch has no known length
    epoch_share = run.progress.samples_in_epoch / samples_per_epoch if samples_per_epoch else None
    report_done(
        run.report,
        result,
        run.config,
        run.evaluator.classes,
        run.optimizer,
        run.lr,
        run.val_dataset is not None,
        run.runtime.devices_per_step,
        run.telemetry,
        epoch_share if run.progress.samples_in_epoch else 0.0,
        run.replicas.between_groups() if run.replicas is not None else "",
    )
    return result
