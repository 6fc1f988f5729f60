"""What fit() returns and says at the end of a run: the summary, the warning of a run that did not learn, the
done line and TensorBoard's hparams."""

from __future__ import annotations

from typing import Any, Optional

import torch

from multigpu.config import TrainConfig
from multigpu.loop.progress import Progress
from multigpu.monitoring import plan
from multigpu.monitoring.reporting import Reporter
from multigpu.monitoring.telemetry import Telemetry


def summary(metrics: dict[str, float], monitor: Optional[str], progress: Progress, samples: int, seconds: float,
            telemetry: Telemetry, **extra: Any) -> dict[str, Any]:
    """What fit returns: the last validation metrics, the best monitored value, progress and throughput."""
    best = progress.best_value
    return {**metrics, "monitor": monitor, "best": best, **({f"best_{monitor}": best} if monitor else {}),
            "epochs": progress.epoch, "global_step": progress.global_step,
            "samples_per_sec": samples / max(seconds, 1e-9), **telemetry.summary(), **extra}


def report_done(report: Reporter, result: dict[str, Any], config: TrainConfig, classes: Optional[int],
                optimizer: torch.optim.Optimizer, lr: float, has_validation: bool, devices_per_step: int,
                telemetry: Telemetry) -> None:
    """The end-of-run lines and hparams; `result` gets `did_not_learn` (why) where the run shows it did not
    learn or ended at chance (a sweep marks such runs: multigpu/sweep/summary.py)."""
    warning = plan.learning_warning(report, classes, optimizer, lr, config.lr_scaling)
    if warning:
        report.line(warning)
    why = "; ".join(plan.no_learning_signs(report, classes)) or plan.at_chance(report, classes)
    if why:
        result["did_not_learn"] = why
    report.line(plan.done_line(result, result["monitor"], has_validation, devices_per_step,
                               telemetry.summary_text(result)))
    report.hparams(config, {key: value for key, value in result.items() if isinstance(value, float)
                            and (key.startswith("val_") or key.startswith("best_"))})
