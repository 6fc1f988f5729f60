"""How MultiGPUTrainer's parts are made from a TrainConfig and the user's arguments.

Each function makes one part (or the few that belong together) from what it is given;
train_multi_gpu.py's `__init__` calls them in the order a run needs them, so reading it
shows what a run is made of, and reading one of these shows how that part is chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn as nn

from multigpu.checkpoints.checkpointer import with_run_folder
from multigpu.checkpoints.export import ExportOnEnd
from multigpu.checkpoints.weights import InitFrom
from multigpu.config import TrainConfig
from multigpu.data import build_loader, streaming
from multigpu.data.batches import batch_size, sample_batch
from multigpu.data.sampler import ResumableDistributedSampler
from multigpu.errors import UsageError
from multigpu.loop.amp import Amp, resolve_dtype
from multigpu.loop.callbacks import EMA, Callbacks, EarlyStopping
from multigpu.loop.forward import ForwardFn
from multigpu.loop.gradient_nodes import hold_gradient_nodes
from multigpu.loop.optim import (INTERVALS, OptimizerArg, SchedulerArg, build_optimizer, build_scheduler,
                                 refuse_schedules_without_length, schedule_config, users_optimizer, users_scheduler)
from multigpu.lr_scaling import effective_batch, scaled_lr
from multigpu.monitoring.reporting import Reporter
from multigpu.monitoring.telemetry import Telemetry
from multigpu.parallel import sharding
from multigpu.parallel.distributed import Runtime, is_distributed, prepare_model, setup, wrap_model
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.watchdog import Watchdog
from multigpu.tuning import batch_size as batch_size_search


def check_arguments(model: Any, scheduler_interval: str) -> None:
    """One clear exception for arguments torch would fail on deep inside the set-up (`'function' object has
    no attribute 'to'`): a model that is not an nn.Module instance, an unknown scheduler interval."""
    if scheduler_interval not in INTERVALS:
        raise ValueError(f"scheduler_interval must be one of {', '.join(INTERVALS)}; got {scheduler_interval!r}")
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(f"model is the class {model.__name__}, not a model: build it first, e.g. "
                        f"MultiGPUTrainer({model.__name__}(...), ...)")
    raise TypeError(f"model must be a torch.nn.Module (its parameters are what trains); got a "
                    f"{type(model).__name__}: {model!r:.60}")


def process_group(config: TrainConfig, runtime: Optional[Runtime]) -> tuple[Runtime, bool]:
    """The run's mode, devices and ranks (`runtime` when given), and whether the trainer made the process
    group itself: then it owns the group's end (close(), or at exit)."""
    group_before = is_distributed()
    made = runtime or setup(config)
    return made, runtime is None and is_distributed() and not group_before


def run_folder_and_report(config: TrainConfig, runtime: Runtime) -> tuple[TrainConfig, Reporter]:
    """The config with its save-dir chosen (a new run-N folder when --save-dir was not given), and rank 0's
    console, progress bar and TensorBoard, which says the folder first."""
    config, run_folder = with_run_folder(config, runtime)
    report = Reporter(config, runtime.is_main)
    if run_folder:
        report.line(run_folder)
    return config, report


def precision(config: TrainConfig, runtime: Runtime, say: Callable[[str], None]) -> Amp:
    """--amp resolved for this device (auto: bf16 where the GPU computes in it); fsdp casts the parameters
    itself (FSDP2's MixedPrecisionPolicy) rather than autocasting."""
    return Amp(resolve_dtype(config.amp, runtime.device, say), runtime.device.type, sharded=runtime.mode == "fsdp")


def model_on_device(model: nn.Module, config: TrainConfig, runtime: Runtime, say: Callable[[str], None]) -> nn.Module:
    """The plain module in the form it trains in, on this process's device: --sync-bn, --channels-last and
    --compile applied (multigpu/parallel/distributed.py); what fsdp cannot do is refused first."""
    if runtime.mode == "fsdp":
        sharding.refuse_unsupported(config)
    return prepare_model(model, config, runtime, say)


@dataclass
class BatchSizes:
    """--batch-size is per device; DataParallel splits its process's bigger batch over its GPUs."""

    loader: int  # samples per micro-batch of one process
    evaluation: int  # per process, for evaluation and prediction
    effective: int  # samples per optimizer step, all devices and micro-steps together


def batch_sizes(config: TrainConfig, runtime: Runtime) -> BatchSizes:
    per_step = max(1, len(runtime.dp_device_ids))
    return BatchSizes(config.batch_size * per_step, (config.eval_batch_size or config.batch_size) * per_step,
                      effective_batch(config, runtime.devices_per_step))


@dataclass
class TrainingData:
    """Where each step's samples come from."""

    sampler: Any  # this rank's share of every epoch, resumable mid-epoch (a stream keeps its own position)
    stream: Optional[streaming.TrainStream]  # an IterableDataset's split, ends and position; None for map-style
    loader: Any
    steps_per_epoch: int  # 0: a stream without __len__, whose epoch is one pass of steps unknown until it ends


def training_data(dataset: Any, config: TrainConfig, runtime: Runtime, loader_batch: int,
                  collate_fn: Optional[Callable]) -> TrainingData:
    """A map-style set's sampler and loader (DataLoader workers, pinned memory on CUDA), or a stream's split
    over ranks and workers (data/streaming.py)."""
    if streaming.is_stream(dataset):
        stream = streaming.TrainStream(dataset, runtime, loader_batch, config.grad_accum_steps,
                                       config.steps_per_epoch, config.num_workers, config.seed, collate_fn,
                                       build_loader, config.max_steps)
        return TrainingData(stream, stream, stream.loader, stream.steps_per_epoch or 0)
    sampler = ResumableDistributedSampler(len(dataset), runtime.rank, runtime.world_size, config.seed)
    loader = build_loader(dataset, runtime.device, config.num_workers, config.seed + runtime.rank, sampler=sampler,
                          batch_size=loader_batch, collate_fn=collate_fn)
    return TrainingData(sampler, None, loader, math.ceil(len(sampler) / (loader_batch * config.grad_accum_steps)))


def wrapped_model(model: nn.Module, config: TrainConfig, runtime: Runtime, amp_dtype: Optional[torch.dtype],
                  say: Callable[[str], None]) -> tuple[nn.Module, Callable[[], ContextManager], list[Any]]:
    """What trains (DDP, DataParallel, the module sharded in place by fsdp, or the module), the context of the
    inner micro-steps of an accumulation window (no gradient sync), and the gradient nodes held for the run:
    without DDP's reducer to hold them autograd would rebuild every parameter's AccumulateGrad node each step
    (multigpu/loop/gradient_nodes.py); fsdp's parameters are its own to manage."""
    wrapped = wrap_model(model, config, runtime, say, amp_dtype)
    no_sync = (wrapped.no_sync if runtime.mode == "ddp" else contextlib.nullcontext if runtime.mode != "fsdp"
               else sharding.no_gradient_sync(wrapped, config.fsdp_accumulate == "sharded"))
    return wrapped, no_sync, hold_gradient_nodes(model) if runtime.mode in ("none", "dp") else []


@dataclass
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


def optimization(model: nn.Module, config: TrainConfig, given: frozenset, optimizer: OptimizerArg,
                 scheduler: SchedulerArg, scheduler_interval: str, effective_batch: int, data: TrainingData
                 ) -> Optimization:
    """The run's optimizer and schedule. A stream without __len__ knows no total: it is taken as unbounded
    where a length is only weighed (room for checkpoints, --autotune's payback), and a schedule that needs it
    exactly is refused in one line."""
    if optimizer is None:
        built = build_optimizer(model, config, scaled_lr(config.lr, config.lr_scaling, effective_batch,
                                                         config.lr_base_batch))
    else:
        built = users_optimizer(optimizer, model, scaled_lr(1.0, config.lr_scaling, effective_batch,
                                                            config.lr_base_batch))
    total_steps = config.planned_steps(data.steps_per_epoch) if data.steps_per_epoch else math.inf
    config = schedule_config(config, given, optimizer is not None, scheduler is not None)
    interval = "step" if scheduler is None else scheduler_interval
    if data.stream is not None and not data.steps_per_epoch:
        refuse_schedules_without_length(config, scheduler is None, scheduler, interval)
    schedule = (build_scheduler(built, config, data.steps_per_epoch) if scheduler is None
                else users_scheduler(scheduler, built, config.lr_scaling,
                                     total_steps if scheduler_interval == "step" else config.epochs))
    return Optimization(built, schedule, interval, optimizer is None, scheduler is None,
                        built.param_groups[0]["lr"], total_steps, config)


def callbacks(config: TrainConfig, users: Sequence[Any], has_validation: bool) -> Callbacks:
    """The flags' built-in features first, then the user's callbacks; each hook's list is made once
    (multigpu/loop/callbacks.py). --init-from comes first: every other callback (EMA's copy) starts from the
    weights it loads."""
    if config.early_stop_patience and not has_validation:
        raise UsageError("--early-stop-patience watches a validation metric, and this run has no validation "
                         "set: give one, or leave --early-stop-patience at 0")
    builtin = [InitFrom(config.init_from, config.init_strict) if config.init_from else None,
               ExportOnEnd(config.export_on_end) if config.export_on_end else None,
               EarlyStopping(config.early_stop_patience, config.early_stop_min_delta)
               if config.early_stop_patience > 0 else None,
               EMA(config.ema_decay) if config.ema_decay > 0 else None]
    return Callbacks([*filter(None, builtin), *users])


def auto_batch_size(config: TrainConfig, model: nn.Module, optimizer: OptimizerArg, forward: ForwardFn,
                    loss_fn: Any, amp: Amp, move: Callable[[Any], Any], dataset: Any, collate_fn: Optional[Callable],
                    runtime: Runtime, say: Callable[[str], None]) -> TrainConfig:
    """--batch-size auto: the config with the largest batch whose step fits in GPU memory, measured on a probe
    optimizer of the same kind (a given one is restored after), or the default batch without CUDA. Measured
    before anything that depends on the batch is built."""
    def probe_optimizer() -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        return (build_optimizer(model, config, config.lr) if optimizer is None
                else users_optimizer(optimizer, model, 1.0))
    chosen = batch_size_search.choose(model, probe_optimizer, forward, loss_fn, amp, move, dataset, collate_fn,
                                      runtime, say)
    return dataclasses.replace(config, batch_size=chosen)


def telemetry(runtime: Runtime, amp: Amp, loader: Any, report: Reporter, model: nn.Module, forward: ForwardFn,
              move: Callable[[Any], Any], dataset: Any, batch: int, collate_fn: Optional[Callable]) -> Telemetry:
    """Where the step's time goes, and FLOPs per training sample for MFU, counted on a small batch of the
    training set on the plain module, before the wrap (MULTI_GPU_GUIDE.md, "Speed")."""
    measured = Telemetry(runtime, amp.dtype, loader.num_workers, report.line)
    if loader.num_workers == 0:
        report.import_writer_in_background()
    try:
        sample = sample_batch(dataset, min(batch, 8), collate_fn)
    except Exception:  # a data set that only reads inside the loader's workers: no FLOP count, no perf/
        return measured

    def forward_only(moved: Any) -> Any:
        with amp.autocast():
            return forward(model, moved)[0]
    measured.flops_per_sample = measured.count_flops(model, forward_only, move(sample), batch_size(sample))
    return measured


def hang_watchdog(config: TrainConfig, runtime: Runtime, global_step: int, save_dir: str,
                  save_last_step: Callable[[dict[str, Any]], str]) -> Optional[Watchdog]:
    """--hang-timeout's watchdog, started (None with 0): rank 0's saves the last completed step through
    `save_last_step` when it decides (MULTI_GPU_GUIDE.md, "When a run hangs")."""
    seconds = config.watchdog_seconds
    if not seconds:
        return None
    BEAT.restart()
    BEAT.step = global_step
    mesh = runtime.mesh_shape if runtime.mode == "fsdp" and runtime.mesh_shape[0] > 1 else None
    return Watchdog(runtime.rank, runtime.world_size, seconds, save_dir, runtime.backend, save_last_step,
                    mesh=mesh).start()
