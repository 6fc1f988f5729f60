"""The trainer's parts that are made from many of its others: --batch-size auto's search, the telemetry, the
training step, the evaluator, --autotune and the sync points. Each takes the run (MultiGPUTrainer) as its
`__init__` has built it so far, so that `__init__` reads as the order a run is assembled in."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from multigpu.config import TrainConfig
from multigpu.data.batches import batch_mover
from multigpu.engine import build
from multigpu.loop import optim
from multigpu.loop.evaluation import Evaluator
from multigpu.loop.forward import ForwardFn
from multigpu.loop.metrics import MetricsSpec
from multigpu.loop.optim import Optimization, OptimizerArg, SchedulerArg
from multigpu.loop.step import TrainStep
from multigpu.loop.tokens import LossWeighting, token_loss_for
from multigpu.monitoring import telemetry
from multigpu.monitoring.reporting import Reporter
from multigpu.monitoring.sync import SyncPoints
from multigpu.tuning import autotune
from multigpu.tuning import batch_size as batch_size_search


class Run(build.Tunable, Protocol):
    """What the parts read off the trainer (MultiGPUTrainer has it): each part is made once `__init__` has set
    what it reads."""

    given: frozenset
    device: torch.device
    report: Reporter
    forward: ForwardFn
    train_dataset: Dataset
    collate_fn: Callable | None
    loss_fn: Any
    on_device: Any  # DeviceData (data/device_data.py)
    effective_batch: int
    steps_per_epoch: int
    stream: Any
    scheduler: Any
    scheduler_interval: str
    meter: Any  # IntervalMeter (multigpu/monitoring/meters.py)
    telemetry: telemetry.Telemetry
    logged: Any  # LoggedScalars (multigpu/monitoring/meters.py)
    stop: Any  # StopRequest (multigpu/resilience/preemption.py)
    checkpointer: Any  # Checkpointer (multigpu/checkpoints/checkpointer.py)

    # Read only: the parts never set them (the trainer's loader is a property).
    @property
    def weighting(self) -> LossWeighting | None: ...

    @property
    def train_loader(self) -> Any: ...


def _move(run: Run) -> Callable[[Any], Any]:
    """How a batch reaches the run's device, in the run's memory format."""
    return batch_mover(run.device, run.channels_last)


def searched_batch_size(run: Run, optimizer: OptimizerArg) -> TrainConfig:
    """--batch-size auto: the config with the largest batch that fits (multigpu/tuning/batch_size.py)."""
    return batch_size_search.auto_batch_size(
        run.config,
        run.model,
        optimizer,
        run.forward,
        run.loss_fn,
        run.amp,
        _move(run),
        run.train_dataset,
        run.collate_fn,
        run.runtime,
        run.report.line,
    )


def optimization(
    run: Run, optimizer: OptimizerArg, scheduler: SchedulerArg, scheduler_interval: str
) -> Optimization:
    """The optimizer and its schedule, the LR scaled for the effective batch (multigpu/loop/optim.py)."""
    return optim.optimization(
        run.model,
        run.config,
        run.given,
        optimizer,
        scheduler,
        scheduler_interval,
        run.effective_batch,
        run.steps_per_epoch,
        run.stream is not None,
    )


def run_telemetry(run: Run) -> telemetry.Telemetry:
    """The step clock, data wait, FLOPs per sample and MFU (docs/speed.md, "Speed")."""
    return telemetry.run_telemetry(
        run.runtime,
        run.amp,
        run.train_loader,
        run.report,
        run.model,
        run.forward,
        _move(run),
        run.train_dataset,
        _batch_size(run.config),
        run.collate_fn,
        run.weighting,
    )


def _batch_size(config: TrainConfig) -> int:
    assert isinstance(config.batch_size, int), "--batch-size auto is resolved before"
    return config.batch_size


def train_step(run: Run, wrapped: nn.Module, no_sync: Callable[[], Any]) -> TrainStep:
    """Forward, backward and the optimizer over a step's micro-batches (multigpu/loop/step.py); `run` also
    has its optimizer, schedule and meter by now."""
    rt = run.runtime
    return TrainStep(
        run.model,
        wrapped,
        no_sync,
        run.forward,
        run.loss_fn,
        run.amp,
        run.optimizer,
        run.scheduler,
        run.scheduler_interval,
        run.config.clip_grad_norm,
        run.meter,
        run.telemetry.clock.fetch,
        _move(run),
        run.weighting,
        token_loss_for(run.forward, run.loss_fn, run.model, rt.mode, rt.world_size),
    )


def evaluator(run: Run, metrics: MetricsSpec) -> Evaluator:
    """Loss and metrics over every sample exactly once, at any world size (multigpu/loop/evaluation.py)."""
    return Evaluator(
        run.runtime,
        run.amp,
        run.forward,
        run.loss_fn,
        metrics,
        run.config.num_workers,
        run.collate_fn,
        _move(run),
        run.weighting,
    )


def autotuner(run: Run) -> autotune.Autotuner | None:
    """--autotune's trials (or --data-on-device auto's alone), run in fit's first steps; None if not asked."""
    if not run.config.autotune and not run.on_device.measured:
        return None
    return autotune.make_autotuner(
        run.config,
        run.runtime,
        run.model,
        run.given,
        lambda setting: build.use_setting(run, setting),
        run.report.line,
        data=run.on_device.measured,
        data_cost=run.data.device_step_seconds,
    )


def sync_points(run: Run) -> SyncPoints:
    """The steps where the host reads the meters, logs, and the ranks agree on stopping
    (multigpu/monitoring/sync.py); `run` has its checkpointer by now."""
    return SyncPoints(
        run.config,
        run.runtime,
        run.meter,
        run.logged,
        run.report,
        run.telemetry,
        run.amp,
        run.stop,
        run.checkpointer.newest,
    )
