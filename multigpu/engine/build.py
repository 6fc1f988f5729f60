"""MultiGPUTrainer's parts that span concerns: the arguments checked, the built-in callbacks (from loop/ and
checkpoints/), --hang-timeout's watchdog, and --autotune's switch between settings.

Every other part is made by a factory beside it (`run_folder`, `Amp.resolved`, `prepare_model`,
`Checkpointer.at_start` ...), from the settings it needs; train_multi_gpu.py's `__init__` calls them in the
order a run needs them, so reading it shows what a run is made of.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from multigpu.checkpoints.export import ExportOnEnd
from multigpu.checkpoints.weights import InitFrom
from multigpu.config import TrainConfig
from multigpu.data.batches import batch_mover
from multigpu.errors import UsageError
from multigpu.loop.amp import Amp
from multigpu.loop.callbacks import EMA, Callbacks, EarlyStopping
from multigpu.loop.optim import INTERVALS
from multigpu.loop.step import TrainStep
from multigpu.parallel.distributed import Runtime
from multigpu.parallel.wrapping import as_ddp, wrap_model
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.watchdog import Watchdog
from multigpu.tuning import autotune


def check_arguments(model: Any, scheduler_interval: str) -> None:
    """One clear exception for arguments torch would fail on deep inside the set-up (`'function' object has
    no attribute 'to'`): a model that is not an nn.Module instance, an unknown scheduler interval."""
    if scheduler_interval not in INTERVALS:
        raise ValueError(
            f"scheduler_interval must be one of {', '.join(INTERVALS)}; got {scheduler_interval!r}"
        )
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(
            f"model is the class {model.__name__}, not a model: build it first, e.g. "
            f"MultiGPUTrainer({model.__name__}(...), ...)"
        )
    raise TypeError(
        f"model must be a torch.nn.Module (its parameters are what trains); got a "
        f"{type(model).__name__}: {model!r:.60}"
    )


def callbacks(config: TrainConfig, users: Sequence[Any], has_validation: bool) -> Callbacks:
    """The flags' built-in features first, then the user's callbacks; each hook's list is made once
    (multigpu/loop/callbacks.py). --init-from comes first: every other callback (EMA's copy) starts from the
    weights it loads."""
    if config.early_stop_patience and not has_validation:
        raise UsageError(
            "--early-stop-patience watches a validation metric, and this run has no validation "
            "set: give one, or leave --early-stop-patience at 0"
        )
    builtin = [
        InitFrom(config.init_from, config.init_strict) if config.init_from else None,
        ExportOnEnd(config.export_on_end, config.tokenizer_path) if config.export_on_end else None,
        EarlyStopping(config.early_stop_patience, config.early_stop_min_delta)
        if config.early_stop_patience > 0
        else None,
        EMA(config.ema_decay) if config.ema_decay > 0 else None,
    ]
    return Callbacks([*filter(None, builtin), *users])


def hang_watchdog(
    config: TrainConfig,
    runtime: Runtime,
    global_step: int,
    save_dir: str,
    save_last_step: Callable[[dict[str, Any]], str],
) -> Watchdog | None:
    """--hang-timeout's watchdog, started (None with 0): rank 0's saves the last completed step through
    `save_last_step` when it decides (docs/hangs.md, "When a run hangs")."""
    seconds = config.watchdog_seconds
    # --fault-tolerance: a step that waits for a lost group is torchft's to end (its process-group timeout,
    # then a quorum without it), not a hang to stop this group for; a process lost within a group ends that
    # group's torchrun job, and the group heals when started again.
    if not seconds or runtime.replicas is not None:
        return None
    BEAT.restart()
    BEAT.step = global_step
    assert runtime.mesh_shape is not None  # Runtime.__post_init__ fills it
    mesh = runtime.mesh_shape if runtime.mode == "fsdp" and runtime.mesh_shape[0] > 1 else None
    return Watchdog(
        runtime.rank, runtime.world_size, seconds, save_dir, runtime.backend, save_last_step, mesh=mesh
    ).start()


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
    data: Any  # TrainingData (data/feed.py)
    progress: Any  # where the epoch is


def use_setting(run: Tunable, setting: autotune.Setting) -> None:
    """Switch the run to an --autotune setting between two steps: the threads, the memory format (weights,
    optimizer state, batches), compiled or not, and where the batches come from (--data-on-device auto); nothing
    a step computes changes beyond rounding."""
    torch.set_num_threads(setting.threads)
    if setting.data_on_device is not None:  # the same batches, from the same place in the epoch
        run.data.use_device(setting.data_on_device, run.progress.epoch, run.progress.samples_in_epoch)
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
            as_ddp(run.step.wrapped)._remove_autograd_hooks()
            run.step.wrapped = wrap_model(
                run.model, run.config, run.runtime, lambda line: None, run.amp.dtype
            )
            run.step.no_sync = as_ddp(run.step.wrapped).no_sync
    if setting.compiled and run.model._compiled_call_impl is None:
        run.model.compile()  # in place, inside DDP's wrapper: as --compile, plain state_dict keys
    elif not setting.compiled:
        run.model._compiled_call_impl = None  # what nn.Module.compile set: the plain forward again
