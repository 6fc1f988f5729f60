"""Sync points: the log steps, epoch ends and save steps where the ranks compare notes (docs/scaling.md,
"When the loss becomes NaN or inf").

Between them a step costs no host sync; at one, a single all-reduce carries the
interval's losses, its sample count and every rank's stop vote, so all ranks decide
alike, and rank 0 logs what it says.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from multigpu.config import TrainConfig
from multigpu.errors import TrainingStopped
from multigpu.monitoring.meters import IntervalMeter, LoggedScalars
from multigpu.monitoring.reporting import Reporter
from multigpu.monitoring.telemetry import Telemetry
from multigpu.parallel.distributed import Runtime
from multigpu.resilience.preemption import StopRequest


class SyncPoints:
    """Where the run's intervals end, and what happens there: reduce, check, log, and say whether to stop."""

    def __init__(
        self,
        config: TrainConfig,
        runtime: Runtime,
        meter: IntervalMeter,
        logged: LoggedScalars,
        report: Reporter,
        telemetry: Telemetry,
        amp: Any,
        stop: StopRequest,
        newest_checkpoint: Callable[[], str],
    ):
        self.config, self.runtime, self.meter, self.logged, self.report = (
            config,
            runtime,
            meter,
            logged,
            report,
        )
        self.telemetry, self.amp, self.stop, self.newest_checkpoint = telemetry, amp, stop, newest_checkpoint
        # Trained, over the whole run: its throughput.
        self.samples: float = 0
        self.seconds = 0.0

    def due(self, step: int, epoch_end: bool) -> bool:
        """Whether `step` ends an interval: log steps, epoch ends and save steps. Only conditions that are the
        same on every rank may be here, since each sync point is a collective (the fault injector's step is
        not)."""
        config = self.config
        return (
            epoch_end
            or step % config.log_every == 0
            or (config.save_every_steps > 0 and step % config.save_every_steps == 0)
            or (self.runtime.world_size == 1 and self.stop.requested)
        )

    def __call__(self, step: int, applied_lr: float) -> bool:
        """Reduce the interval over ranks (the one host sync), log it, and say whether to stop: on a signal that
        reached any rank; a non-finite loss stops the run here (unless fp16's scaler skips the step)."""
        interval, scaler = self.meter.reduce(self.stop.requested, bool(self.logged.values)), self.amp.scaler
        first_step = step - len(interval.step_losses) + 1
        if not math.isfinite(sum(interval.step_losses)) and not scaler.is_enabled():  # one check per interval
            bad = [first_step + i for i, loss in enumerate(interval.step_losses) if not math.isfinite(loss)]
            raise TrainingStopped(
                f"loss became non-finite at step {bad[0]}; stopped without saving, last good "
                f"checkpoint kept: {self.newest_checkpoint()}"
            )
        self.samples += interval.samples
        self.seconds += interval.seconds
        skipped = (
            int(self.meter.skipped_steps) if scaler.is_enabled() else None
        )  # this rank's: all skip alike
        self.report.interval(
            step,
            first_step,
            interval,
            applied_lr,
            self.runtime.devices_per_step,
            skipped,
            scaler.get_scale() if skipped is not None else None,
            self.telemetry.interval(interval, first_step, step),
        )
        if interval.log_votes:  # some rank has trainer.log scalars: all ranks reduce them
            self.report.scalars(self.logged.reduce(), step)
        self.meter.reset()
        return interval.stop_votes > 0
