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
from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from multigpu.checkpoints import checkpoint, run_folders
from multigpu.checkpoints.checkpointer import Checkpointer
from multigpu.checkpoints.export import ExportOnEnd
from multigpu.checkpoints.weights import InitFrom
from multigpu.config import DEFAULT_SAVE_ROOT, TrainConfig
from multigpu.data.batches import batch_mover, batch_size, sample_batch
from multigpu.data.feed import TrainingData
from multigpu.errors import UsageError
from multigpu.loop import float8
from multigpu.loop.amp import Amp, resolve_dtype
from multigpu.loop.callbacks import EMA, Callbacks, EarlyStopping
from multigpu.loop.forward import ForwardFn
from multigpu.loop.gradient_nodes import hold_gradient_nodes
from multigpu.loop.optim import (INTERVALS, OptimizerArg, SchedulerArg, build_optimizer, build_scheduler,
                                 refuse_schedules_without_length, schedule_config, users_optimizer, users_scheduler)
from multigpu.loop.step import TrainStep
from multigpu.lr_scaling import effective_batch, scaled_lr
from multigpu.monitoring.reporting import Reporter
from multigpu.monitoring.telemetry import Telemetry
from multigpu.parallel import sharding
from multigpu.parallel.distributed import Runtime, gather_objects, is_distributed, setup
from multigpu.parallel.wrapping import prepare_model, wrap_model
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.watchdog import Watchdog
from multigpu.tuning import autotune, batch_size as batch_size_search


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


def run_folder(config: TrainConfig, runtime: Runtime) -> tuple[TrainConfig, Optional[str]]:
    """`config` with its save-dir chosen when --save-dir was not given, and the line that says so.

    Each run then gets a folder of its own under checkpoints/ (run-1, run-2, ...),
    so running one command twice keeps both runs; --resume auto continues the
    newest. Rank 0 chooses, every rank learns its choice.
    """
    if config.save_dir is not None:
        return config, None
    choice = None
    if runtime.is_main:
        try:
            choice = (*run_folders.choose_run_dir(DEFAULT_SAVE_ROOT, config), None)
        except UsageError as error:  # runs are there, none with these settings: every rank stops
            choice = ("", "", str(error))
    path, line, refusal = gather_objects(choice)[0]  # type: ignore[misc]
    if refusal:
        raise UsageError(refusal)
    return dataclasses.replace(config, save_dir=path), line


def run_folder_and_report(config: TrainConfig, runtime: Runtime) -> tuple[TrainConfig, Reporter]:
    """The config with its save-dir chosen (a new run-N folder when --save-dir was not given), and rank 0's
    console, progress bar and TensorBoard, which says the folder first."""
    config, chosen = run_folder(config, runtime)
    report = Reporter(config, runtime.is_main)
    if chosen:
        report.line(chosen)
    return config, report


def precision(config: TrainConfig, runtime: Runtime, say: Callable[[str], None]) -> Amp:
    """--amp resolved for this device (auto: bf16 where the GPU computes in it); fsdp casts the parameters
    itself (FSDP2's MixedPrecisionPolicy) rather than autocasting."""
    return Amp(resolve_dtype(config.amp, runtime.device, say), runtime.device.type, sharded=runtime.mode == "fsdp")


def model_on_device(model: nn.Module, config: TrainConfig, runtime: Runtime, say: Callable[[str], None]) -> nn.Module:
    """The plain module in the form it trains in, on this process's device: --float8, --sync-bn,
    --channels-last and --compile applied (multigpu/parallel/wrapping.py); what fsdp cannot do is refused
    first."""
    if runtime.mode == "fsdp":
        sharding.refuse_unsupported(config)
    if config.float8:  # before --compile compiles the module (multigpu/loop/float8.py)
        float8.for_run(model, config.float8, runtime.device, runtime.mode == "fsdp", say)
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
    lr = built.param_groups[0]["lr"]  # the schedule's base: a warm-up's schedule starts below it
    total_steps = config.planned_steps(data.steps_per_epoch) if data.steps_per_epoch else math.inf
    config = schedule_config(config, given, optimizer is not None, scheduler is not None)
    interval = "step" if scheduler is None else scheduler_interval
    if data.stream is not None and not data.steps_per_epoch:
        refuse_schedules_without_length(config, scheduler is None, scheduler, interval)
    schedule = (build_scheduler(built, config, data.steps_per_epoch) if scheduler is None
                else users_scheduler(scheduler, built, config.lr_scaling,
                                     total_steps if scheduler_interval == "step" else config.epochs))
    return Optimization(built, schedule, interval, optimizer is None, scheduler is None, lr, total_steps, config)


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
    """Where the step's time goes, and FLOPs per training sample for MFU (docs/speed.md, "Speed")."""
    measured = Telemetry(runtime, amp.dtype, loader.num_workers, report.line)
    if loader.num_workers == 0:
        report.import_writer_in_background()
    measured.flops_per_sample = flops_per_sample(measured, amp, model, forward, move, dataset, batch, collate_fn)
    return measured


def flops_per_sample(telemetry: Telemetry, amp: Amp, model: nn.Module, forward: ForwardFn,
                     move: Callable[[Any], Any], dataset: Any, batch: int, collate_fn: Optional[Callable]
                     ) -> Optional[float]:
    """FLOPs per training sample, counted on a small batch of the training set on the plain module, before the
    wrap (no collective); None for a data set that only reads inside the loader's workers."""
    try:
        sample = sample_batch(dataset, min(batch, 8), collate_fn)
    except Exception:  # no FLOP count, no perf/
        return None

    def forward_only(moved: Any) -> Any:
        with amp.autocast():
            return forward(model, moved)[0]
    return telemetry.count_flops(model, forward_only, move(sample), batch_size(sample))


def hang_watchdog(config: TrainConfig, runtime: Runtime, global_step: int, save_dir: str,
                  save_last_step: Callable[[dict[str, Any]], str]) -> Optional[Watchdog]:
    """--hang-timeout's watchdog, started (None with 0): rank 0's saves the last completed step through
    `save_last_step` when it decides (docs/hangs.md, "When a run hangs")."""
    seconds = config.watchdog_seconds
    if not seconds:
        return None
    BEAT.restart()
    BEAT.step = global_step
    mesh = runtime.mesh_shape if runtime.mode == "fsdp" and runtime.mesh_shape[0] > 1 else None
    return Watchdog(runtime.rank, runtime.world_size, seconds, save_dir, runtime.backend, save_last_step,
                    mesh=mesh).start()


class Tunable(Protocol):
    """What --autotune switches between two steps (MultiGPUTrainer has it)."""

    config: TrainConfig
    runtime: Runtime
    model: nn.Module
    optimizer: torch.optim.Optimizer
    amp: Amp
    evaluator: Any
    step: TrainStep
    channels_last: bool


def use_setting(run: Tunable, setting: autotune.Setting) -> None:
    """Switch the run to an --autotune setting between two steps: the threads, the memory format (weights,
    optimizer state, batches) and compiled or not; nothing a step computes changes beyond rounding."""
    torch.set_num_threads(setting.threads)
    if setting.channels_last != run.channels_last:
        layout = torch.channels_last if setting.channels_last else torch.contiguous_format
        run.model.to(memory_format=layout)  # 4-D weights only, in place: the optimizer keeps its parameters
        for state in run.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 4:
                    state[key] = value.contiguous(memory_format=layout)
        run.channels_last = setting.channels_last
        run.step.move = run.evaluator.move = batch_mover(run.runtime.device, setting.channels_last)
        if run.runtime.mode == "ddp":  # DDP's gradient buckets take the weights' layout when it is built
            run.step.wrapped._remove_autograd_hooks()
            run.step.wrapped = wrap_model(run.model, run.config, run.runtime, lambda line: None, run.amp.dtype)
            run.step.no_sync = run.step.wrapped.no_sync
    if setting.compiled and run.model._compiled_call_impl is None:
        run.model.compile()  # in place, inside DDP's wrapper: as --compile, plain state_dict keys
    elif not setting.compiled:
        run.model._compiled_call_impl = None  # what nn.Module.compile set: the plain forward again


def checkpointer(config: TrainConfig, runtime: Runtime, report: Reporter, model: nn.Module,
                 optimizer: torch.optim.Optimizer, total_steps: float) -> Checkpointer:
    """Where the run's checkpoints come from and go to; the save-dir (and --log-dir) checked at start, before
    anything is trained: writable, with room for what this run keeps (multigpu/checkpoints/checkpointer.py)."""
    made = Checkpointer(config, runtime, report)
    made.check_folders(checkpoint.estimate_size(model, optimizer, model_copies=2 if config.ema_decay else 1),
                       total_steps)
    return made
