"""MultiGPUTrainer: one training loop for DDP, FSDP, DataParallel, one GPU and the CPU.

Read `fit` first: it is the whole story (resume, epochs, evaluation,
checkpoints); every other method is one step of it, and every other concern
lives in its own module of `multigpu/` (checkpointer, evaluation, meters,
preemption, ...). Each step costs what the same step of a hand-written loop
costs: the only host syncs are at `--log-every` steps, where the ranks also
agree on stopping.

    from train_multi_gpu import MultiGPUTrainer, TrainConfig
    metrics = MultiGPUTrainer(model, train_set, val_set, TrainConfig(epochs=3)).fit()

Run under `torchrun --nproc_per_node=N` and the same code trains with DDP.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from multigpu.tuning import batch_size as batch_size_search
from multigpu import config_checks
from multigpu.checkpoints import checkpoint
from multigpu.data import streaming
from multigpu import rng
from multigpu.monitoring import plan
from multigpu.parallel import sharding
from multigpu.resilience import faults, hang_report, heartbeat, watchdog
from multigpu.tuning import autotune, cpu_memory
from multigpu.loop.amp import Amp, resolve_dtype
from multigpu.data.batches import batch_mover, batch_size, sample_batch
from multigpu.loop.forward import ForwardFn, check_first_batch, compute_loss, fitted_forward
from multigpu.loop.callbacks import Callbacks, builtin_callbacks
from multigpu.checkpoints.checkpointer import PROGRESS, Checkpointer, with_run_folder
from multigpu.config import AUTO, TrainConfig
from multigpu.data import build_loader
from multigpu.data.sampler import ResumableDistributedSampler
from multigpu.parallel.distributed import (Runtime, gather_objects, is_distributed, prepare_model, setup, teardown,
                                  teardown_at_exit, wrap_model)
from multigpu.loop import float8
from multigpu.data.device_data import DeviceData
from multigpu.errors import TrainingStopped, UsageError
from multigpu.loop.evaluation import Evaluator
from multigpu.tuning.gc_pauses import long_lived_objects_frozen
from multigpu.loop.gradient_nodes import hold_gradient_nodes
from multigpu.resilience.heartbeat import BEAT
from multigpu.lr_scaling import scaled_lr
from multigpu.monitoring.meters import IntervalMeter, LoggedScalars
from multigpu.loop.metrics import MetricsSpec, Monitor
from multigpu.loop.optim import (INTERVALS, OptimizerArg, SchedulerArg, build_optimizer, build_scheduler,
                                 refuse_schedules_without_length,
                                 group_settings,
                            keep_run_settings, schedule_config, users_optimizer, users_scheduler)
from multigpu.loop.prediction import Predictor
from multigpu.resilience.preemption import StopRequest, stops_handled
from multigpu.monitoring.reporting import Reporter
from multigpu.checkpoints.stateful import ModelState, OptimizerState, RngState, Saved, ScalerState
from multigpu.monitoring.telemetry import Telemetry
from multigpu.checkpoints.weights import ModelInfo

__all__ = ["MultiGPUTrainer", "TrainConfig"]


def _check_model(model: Any) -> None:
    """A TypeError in one line where `model` is no torch.nn.Module instance (torch's own error would come from
    deep inside the set-up, such as `'function' object has no attribute 'to'`)."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(f"model is the class {model.__name__}, not a model: build it first, e.g. "
                        f"MultiGPUTrainer({model.__name__}(...), ...)")
    raise TypeError(f"model must be a torch.nn.Module (its parameters are what trains); got a "
                    f"{type(model).__name__}: {model!r:.60}")


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # epochs whose training is done (== epochs at the end)
    global_step: int = 0  # optimizer steps taken
    samples_in_epoch: int = 0  # global samples of the current epoch already trained on, in the sampler's order
    best_value: Optional[float] = None  # of the monitored validation metric
    evaluated: bool = True  # False between an epoch's last step and the end of its evaluation


class _ProgressState:
    """Where training stands and what it trained with, as a checkpoint's top-level keys (multigpu/checkpoints/checkpointer.py
    PROGRESS): loading it moves the trainer's progress, monitor, metrics and data order to the checkpoint's."""

    def __init__(self, trainer: "MultiGPUTrainer"):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        return {"optimizer_class": type(trainer.optimizer).__name__,
                "scheduler_class": type(trainer.scheduler).__name__, "scheduler_interval": trainer.scheduler_interval,
                **dataclasses.asdict(trainer.progress),  # epoch, global_step, samples_in_epoch, best_value, evaluated
                "steps_per_epoch": trainer.steps_per_epoch, "sampler_seed": trainer.sampler.seed,
                "train_size": trainer.sampler.dataset_size, "monitor": trainer.monitor.name,
                "metrics": dict(trainer.metrics)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        same_monitor = state["monitor"] is None or trainer.monitor.name in (None, state["monitor"])
        trainer.monitor.name = trainer.monitor.name or state["monitor"]
        trainer.progress = Progress(state["epoch"], state["global_step"], state["samples_in_epoch"],
                                    state["best_value"] if same_monitor else None, state.get("evaluated", True))
        trainer.metrics = dict(state.get("metrics", {}))
        trainer.sampler.seed = state.get("sampler_seed", trainer.sampler.seed)  # the epoch's order must not change


class MultiGPUTrainer:
    """Trains `model` on `train_dataset` with the devices and settings in `config`.

    Bring your own task (MULTI_GPU_GUIDE.md, "Your own task"): `loss_fn` is any
    `(outputs, targets) -> scalar` (default cross-entropy); `optimizer` an
    Optimizer on the model's parameters or a function `params -> Optimizer`
    (default: `config.optimizer`); `scheduler` a function `optimizer -> scheduler`
    (or `(optimizer, total_steps)`, the times it will be stepped, for OneCycleLR)
    or a built one, stepped per optimizer step or, with `scheduler_interval="epoch"`,
    per epoch (default: `config.lr_schedule`, which a user's optimizer gets only when
    `lr_schedule` is set: its LR otherwise stays its own); `metrics` names and/or functions
    (multigpu/loop/metrics.py); batches of any structure, through `forward_fn(model,
    batch) -> (outputs, targets)` where the default (fitted to the model's forward signature) does not fit;
    `callbacks` objects called at fixed points of `fit` (multigpu/loop/callbacks.py).

    Every rank constructs the trainer and calls `fit`; only rank 0 prints, logs
    and writes files. A trainer that set up the process group itself destroys it
    on `close()` (or at the end of a `with` block); one given a `runtime` leaves it alone.
    """

    def __init__(self, model: nn.Module, train_dataset: Dataset, val_dataset: Optional[Dataset] = None,
                 config: Optional[TrainConfig] = None, *, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 optimizer: OptimizerArg = None, scheduler: SchedulerArg = None, scheduler_interval: str = "step",
                 metrics: MetricsSpec = None, collate_fn: Optional[Callable] = None,
                 forward_fn: Optional[ForwardFn] = None, runtime: Optional[Runtime] = None,
                 callbacks: Sequence[Any] = ()):
        if scheduler_interval not in INTERVALS:
            raise ValueError(f"scheduler_interval must be one of {', '.join(INTERVALS)}; got {scheduler_interval!r}")
        _check_model(model)  # before the process group is set up: nothing to undo
        config = config or TrainConfig()
        self.given = config_checks.given(config)  # the flags the user set (before copies of the config forget them)
        group_before = is_distributed()
        self.runtime = rt = runtime or setup(config)
        self.owns_process_group = runtime is None and is_distributed() and not group_before
        # A script that calls fit() or predict() and simply ends: the group is destroyed at exit, as close() does.
        self._close_at_exit = teardown_at_exit(self) if self.owns_process_group else None
        self.config, run_folder = with_run_folder(config, rt)
        config, self.device = self.config, rt.device
        self.report = Reporter(config, rt.is_main)
        if run_folder:
            self.report.line(run_folder)
        self.amp = Amp(resolve_dtype(config.amp, self.device, self.report.line), self.device.type,
                       sharded=rt.mode == "fsdp")
        if rt.mode == "fsdp":
            sharding.refuse_unsupported(config)
        if config.float8:  # before --compile compiles the module (multigpu/loop/float8.py)
            float8.for_run(model, config.float8, self.device, rt.mode == "fsdp", self.report.line)
        self.model = prepare_model(model, config, rt, self.report.line)  # the plain module, on this device
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.forward = forward_fn or fitted_forward(self.model)  # its forward signature read once
        self.channels_last = config.channels_last  # --autotune may switch it (_use_setting)
        self.move = batch_mover(self.device, config.channels_last)  # a batch from the loader to the device
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        # --data-on-device: the set moved there before --batch-size auto measures what memory is left
        self.data = DeviceData(train_dataset, config, self.device, rt.world_size, collate_fn,
                               streaming.is_stream(train_dataset))
        if config.batch_size == AUTO:  # measured before anything that depends on the batch is built
            self.config = config = dataclasses.replace(config, batch_size=self._auto_batch_size(optimizer, collate_fn))

        # --- batches: --batch-size is per device, DataParallel splits its bigger batch over its GPUs ---
        per_step = max(1, len(rt.dp_device_ids))
        self.loader_batch = config.batch_size * per_step
        self.eval_batch = (config.eval_batch_size or config.batch_size) * per_step
        self.effective_batch = config.batch_size * rt.devices_per_step * config.grad_accum_steps
        if streaming.is_stream(train_dataset):  # an IterableDataset: split, ended and resumed by data/streaming.py
            self.sampler = self.stream = streaming.TrainStream(
                train_dataset, rt, self.loader_batch, config.grad_accum_steps, config.steps_per_epoch,
                config.num_workers, config.seed, collate_fn, build_loader, config.max_steps)
            self.train_loader = self.stream.loader
        else:
            self.stream = None
            self.sampler = ResumableDistributedSampler(len(train_dataset), rt.rank, rt.world_size, config.seed)
            self.train_loader = (self.data.batches(self.sampler, self.loader_batch, config.seed) if self.data.on else
                                 build_loader(train_dataset, self.device, config.num_workers, config.seed + rt.rank,
                                              sampler=self.sampler, batch_size=self.loader_batch,
                                              collate_fn=collate_fn))
        # 0: a stream without __len__, whose epoch is one pass of steps unknown until it ends
        self.steps_per_epoch = ((self.stream.steps_per_epoch or 0) if self.stream is not None else
                                math.ceil(len(self.sampler) / (self.loader_batch * config.grad_accum_steps)))

        # --- telemetry (MULTI_GPU_GUIDE.md, "Speed"): FLOPs counted on the plain module, before the wrap ---
        self.telemetry = Telemetry(rt, self.amp.dtype, self.train_loader.num_workers, self.report.line)
        if self.train_loader.num_workers == 0:
            self.report.import_writer_in_background()
        self.telemetry.flops_per_sample = self._flops_per_sample(collate_fn)
        self.clock = self.telemetry.clock  # times each step's wait for data, copy and compute
        # What trains: DDP, DataParallel, the module itself sharded in place (fsdp), or the module.
        self.wrapped = wrap_model(self.model, config, rt, self.report.line, self.amp.dtype)
        self.no_sync = (self.wrapped.no_sync if rt.mode == "ddp" else contextlib.nullcontext if rt.mode != "fsdp"
                        else sharding.no_gradient_sync(self.wrapped, config.fsdp_accumulate == "sharded"))
        # Without DDP's reducer to hold them, autograd would rebuild every parameter's AccumulateGrad node each
        # step (multigpu/loop/gradient_nodes.py); fsdp's parameters are its own to manage.
        self.gradient_nodes = hold_gradient_nodes(self.model) if rt.mode in ("none", "dp") else []

        # --- optimisation: the user's optimizer and schedule, or the config's; LR scaling applies to both ---
        lr_factor_ = scaled_lr(1.0, config.lr_scaling, self.effective_batch, config.lr_base_batch)
        self.builtin_optimizer, self.builtin_schedule = optimizer is None, scheduler is None
        self.optimizer = (build_optimizer(self.model, config, scaled_lr(config.lr, config.lr_scaling,
                                                                        self.effective_batch, config.lr_base_batch))
                          if optimizer is None else users_optimizer(optimizer, self.model, lr_factor_))
        self.lr = self.optimizer.param_groups[0]["lr"]
        # Optimizer steps of the whole run; a stream without __len__: unknown, taken as unbounded where a length is
        # only weighed (room for checkpoints, --autotune's payback); what needs it exactly is refused below.
        self.total_steps = config.planned_steps(self.steps_per_epoch) if self.steps_per_epoch else math.inf
        self.config = config = schedule_config(config, self.given, optimizer is not None, scheduler is not None)
        self.scheduler_interval = "step" if scheduler is None else scheduler_interval
        if self.stream is not None and not self.steps_per_epoch:
            refuse_schedules_without_length(config, scheduler is None, scheduler, self.scheduler_interval)
        self.scheduler = (build_scheduler(self.optimizer, config, self.steps_per_epoch) if scheduler is None
                          else users_scheduler(scheduler, self.optimizer, config.lr_scaling,
                                               self.total_steps if scheduler_interval == "step" else config.epochs))

        self.evaluator = Evaluator(rt, self.amp, self.forward, self.loss_fn, metrics, config.num_workers, collate_fn,
                                   self.move)
        self.monitor = Monitor(config.monitor, config.monitor_mode)  # picks best.pt
        if config.early_stop_patience and val_dataset is None:
            raise UsageError("--early-stop-patience watches a validation metric, and this run has no validation "
                             "set: give one, or leave --early-stop-patience at 0")
        # The flags' built-in features first, then the user's; each hook's list is made once (multigpu/loop/callbacks.py).
        self.callbacks = Callbacks([*builtin_callbacks(config), *callbacks])
        self._on_step_end = self.callbacks.hooks["on_step_end"]
        self.stop_reason: Optional[str] = None  # set by stop_training: the run ends after this epoch
        self.eval_model: Optional[nn.Module] = None  # a callback's module to evaluate and predict with (EMA's)
        # Every name evaluation looks up (metrics, --monitor, the batch's targets) tried on a few validation
        # samples now: a typo costs seconds, not an epoch of training.
        self.evaluator.check_names(self._eval_model(), val_dataset, self.monitor)
        self.progress, self.metrics = Progress(), {}
        # Dropout and augmentation differ per rank but repeat on a rerun (MULTI_GPU_GUIDE.md, "Randomness").
        rng.seed_all(config.seed + rt.rank)
        self.rng_state = RngState(rt)
        self.buffers_at_start: list[tuple[int, int]] = []  # fit() notes them (hang_report.buffer_versions)
        self.train_samples, self.train_seconds, self.applied_lr = 0, 0.0, self.lr
        self.stop = StopRequest()
        self.die_at_step = faults.fault_step(rt.rank)
        self.meter = IntervalMeter(self.device, self.loader_batch)
        self.logged = LoggedScalars(self.device)  # trainer.log's scalars, until the next sync point
        self._resumed, self._batch_checked = False, False
        self.autotune = autotune.for_trainer(self) if config.autotune else None  # tried in fit's first steps
        self.checkpointer = Checkpointer(config, rt, self.report)
        self.checkpointer.check_folders(checkpoint.estimate_size(self.model, self.optimizer,
                                                                 model_copies=2 if config.ema_decay else 1),
                                        self.total_steps)

    @property
    def amp_dtype(self) -> Optional[torch.dtype]:
        return self.amp.dtype

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.amp.scaler

    def _auto_batch_size(self, optimizer: OptimizerArg, collate_fn: Optional[Callable]) -> int:
        """--batch-size auto: the largest batch whose step fits in GPU memory, on a probe optimizer of the same
        kind (a given one is restored after), or the default batch without CUDA."""
        def probe_optimizer() -> torch.optim.Optimizer:
            if isinstance(optimizer, torch.optim.Optimizer):
                return optimizer
            return (build_optimizer(self.model, self.config, self.config.lr) if optimizer is None
                    else users_optimizer(optimizer, self.model, 1.0))
        return batch_size_search.choose(self.model, probe_optimizer, self.forward, self.loss_fn, self.amp, self.move,
                                        self.train_dataset, collate_fn, self.runtime, self.report.line)

    def _flops_per_sample(self, collate_fn: Optional[Callable]) -> Optional[float]:
        """FLOPs per training sample for perf/ (MFU), counted on a small batch of the training set."""
        try:
            batch = sample_batch(self.train_dataset, min(self.config.batch_size, 8), collate_fn)
        except Exception:  # a data set that only reads inside the loader's workers: no FLOP count, no perf/
            return None

        def forward(moved: Any) -> Any:
            with self.amp.autocast():
                return self.forward(self.model, moved)[0]
        return self.telemetry.count_flops(self.model, forward, self.move(batch), batch_size(batch))

    # ------------------------------------------------------------------ training
    def fit(self) -> dict[str, Any]:
        """Resume if asked, train to `config.epochs` evaluating and checkpointing after each epoch, and return
        the final metrics. The save-dir lock, progress bar and TensorBoard writer are released however it ends."""
        rt, started = self.runtime, time.perf_counter()
        hang_watchdog = watchdog.for_trainer(self)  # --hang-timeout (MULTI_GPU_GUIDE.md, "When a run hangs")
        try:
            with stops_handled(self.stop, rt.rank, rt.world_size, min(self.config.dist_timeout, 10.0),
                               on_peer_lost=self._save_after_losing_a_peer):
                self.checkpointer.claim()  # this run owns the save-dir until fit returns
                if self.resume() and self._trained():  # a finished run, resumed: said in one line, nothing written
                    return self._summary(already_complete=True)
                for line in plan.plan_lines(self.plan_facts()):  # what will train, and how (multigpu/monitoring/plan.py)
                    self.report.line(line)
                self.callbacks.call("on_fit_start", self)
                self._start_autotune()
                self.telemetry.start()
                # Every rank's random state, and the model's buffers, as training starts: what rank 0's replica
                # needs to save alone when it loses a peer (hang_report.save_last_step).
                self.rng_state.state_dict()
                self.buffers_at_start = hang_report.buffer_versions(self.model)
                # Short collector pauses (ranks do not wait on one another's), and on the CPU no page faults for
                # memory a step frees and the next takes again (MULTI_GPU_GUIDE.md, "Speed").
                with long_lived_objects_frozen(), cpu_memory.kept_for_the_next_step(
                        self.device.type == "cpu" and self.config.cache_cpu_memory):
                    while not self._trained() and not self._stopping_early():
                        if self.progress.evaluated and not self._run_epoch():
                            return self._stop_for_signal()
                        if not self._evaluate_and_save():
                            return self._stop_for_signal()
            if self.stop_reason:
                self.report.line(self.stop_reason)
            summary = self._summary(wall_time=time.perf_counter() - started,
                                    **({"stopped_early": self.stop_reason} if self.stop_reason else {}))
            self._report_done(summary)
            self.callbacks.call("on_fit_end", self)  # --export-on-end's export, among others
            return summary
        finally:
            if hang_watchdog is not None:
                hang_watchdog.stop()
            try:
                self.report.close()
            finally:  # also when the logs cannot be closed: the save-dir is given up, --overwrite's files put back
                self.checkpointer.release()

    def _save_after_losing_a_peer(self) -> None:
        """A peer died or hung mid-run: rank 0 keeps the last completed step from its own replica, with no
        collective (MULTI_GPU_GUIDE.md, "When a run hangs"); the hang watchdog, when it is ending the run, saves
        and says it itself."""
        if self.runtime.rank == 0 and not BEAT.hang_declared:
            saved = hang_report.save_last_step(self, {"stuck": {}})
            print(f"rank 0: {saved}", file=sys.stderr, flush=True)

    def _start_autotune(self) -> None:
        """--autotune: its trials run from the first step ends, ahead of the callbacks, until it has chosen."""
        hooks = self.callbacks.hooks["on_step_end"]
        if self.autotune is not None and self.autotune.start(self.progress.global_step, self.total_steps):
            self._on_step_end = [self.autotune.on_step_end, *hooks]
            self.autotune.finished = lambda: setattr(self, "_on_step_end", hooks)  # no per-step cost after

    def _use_setting(self, setting: autotune.Setting) -> None:
        """Switch to an --autotune setting between two steps: the threads, the memory format (weights, optimizer
        state, batches) and compiled or not; nothing a step computes changes beyond rounding."""
        torch.set_num_threads(setting.threads)
        if setting.channels_last != self.channels_last:
            layout = torch.channels_last if setting.channels_last else torch.contiguous_format
            self.model.to(memory_format=layout)  # 4-D weights only, in place: the optimizer keeps its parameters
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 4:
                        state[key] = value.contiguous(memory_format=layout)
            self.channels_last = setting.channels_last
            self.move = self.evaluator.move = batch_mover(self.device, setting.channels_last)
            if self.runtime.mode == "ddp":  # DDP's gradient buckets take the weights' layout when it is built
                self.wrapped._remove_autograd_hooks()
                self.wrapped = wrap_model(self.model, self.config, self.runtime, lambda line: None, self.amp.dtype)
                self.no_sync = self.wrapped.no_sync
        if setting.compiled and self.model._compiled_call_impl is None:
            self.model.compile()  # in place, inside DDP's wrapper: as --compile, plain state_dict keys
        elif not setting.compiled:
            self.model._compiled_call_impl = None  # what nn.Module.compile set: the plain forward again

    def _run_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a stop signal ended it early."""
        progress, config = self.progress, self.config
        done_steps = self.steps_done_in_epoch()
        steps = self.steps_per_epoch or None  # None: one pass of a stream without __len__, its steps unknown
        if steps and config.max_steps:  # it ends mid-epoch
            steps = min(steps, done_steps + config.max_steps - progress.global_step)
        self.report.start_epoch(progress.epoch, config.epochs, steps, done_steps)
        self.wrapped.train()
        self.meter.started = time.perf_counter()  # evaluation and saving are not training time
        for batches, window, sizes, last in self._windows():
            self._train_step(batches, window, sizes)
            progress.samples_in_epoch += window * self.runtime.world_size
            progress.global_step += 1
            BEAT.step, BEAT.phase = progress.global_step, heartbeat.USER_CODE  # plain writes: the watchdog reads them
            for on_step_end in self._on_step_end:  # an empty list without callbacks
                on_step_end(self)
            BEAT.phase = heartbeat.LOGGING
            reached = self._reached_max_steps()  # --max-steps ends the run mid-epoch, as an epoch's end would
            if self._at_sync_point(last or reached) and self._sync_and_log():
                return False
            if config.save_every_steps and progress.global_step % config.save_every_steps == 0:
                BEAT.phase = heartbeat.CHECKPOINT
                self.checkpointer.save_step(self.stateful(), self.progress.global_step)
                self.callbacks.call("on_save", self)
            if progress.global_step == self.die_at_step:
                faults.misbehave(self.runtime.rank)  # test-only: SIGKILL (a preempted worker) or SIGSTOP (a hang)
            if reached and not last:
                self.report.end_epoch()
                progress.evaluated = False
                return True
        self.report.end_epoch()
        progress.epoch, progress.samples_in_epoch, progress.evaluated = progress.epoch + 1, 0, False
        BEAT.phase = heartbeat.USER_CODE
        if self.scheduler_interval == "epoch":
            self.scheduler.step()
        self.callbacks.call("on_epoch_end", self)
        return True

    def _reached_max_steps(self) -> bool:
        return bool(self.config.max_steps) and self.progress.global_step >= self.config.max_steps

    def _trained(self) -> bool:
        """The run is done: --epochs (or --max-steps) trained, and the last of it evaluated and saved."""
        return self.progress.evaluated and (self.progress.epoch >= self.config.epochs or self._reached_max_steps())

    def steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already taken; also points the sampler at the rest."""
        if self.stream is not None:
            return self.stream.steps_in_epoch
        self.sampler.start_at(self.progress.epoch, self.progress.samples_in_epoch)
        return self.steps_per_epoch - math.ceil(len(self.sampler) / (self.loader_batch * self.config.grad_accum_steps))

    def _windows(self) -> Iterator[streaming.Window]:
        """The rest of the epoch's steps: (micro-batches, samples, their sizes, last step of the epoch).
        The sampler gives every rank the same number of samples: full micro-batches, then what is left."""
        if self.stream is not None:
            yield from self.stream.windows(self.report.line)
            return
        batches, samples_left, full = iter(self.train_loader), len(self.sampler), self.loader_batch
        full_window = self.config.grad_accum_steps * full
        full_sizes = [full] * self.config.grad_accum_steps  # built once: most steps are full windows
        while samples_left > 0:  # this rank's, equal on every rank
            window = min(full_window, samples_left)
            samples_left -= window
            sizes = full_sizes if window == full_window else \
                [full] * ((window - 1) // full) + [window - (window - 1) // full * full]
            yield batches, window, sizes, samples_left == 0

    def _train_step(self, batches: Iterator, window_samples: int, sizes: list[int]) -> None:
        """One optimizer step over the micro-batches holding this rank's next `window_samples` samples.

        DDP all-reduces (fsdp reduce-scatters) only in the last micro-batch's backward: the others run
        forward and backward in no_sync (MULTI_GPU_GUIDE.md, "The effective-batch rule").
        `sizes`: the samples of each micro-batch.
        """
        fetch = self.clock.fetch  # the next batch on the device, its wait timed
        BEAT.phase = heartbeat.DATA  # and again after each backward: the next fetch
        for size in sizes[:-1]:
            with self.no_sync():
                self._forward_backward(fetch(batches, self.move), size, window_samples)
        self._forward_backward(fetch(batches, self.move), sizes[-1], window_samples)
        self.meter.end_step(window_samples)
        self._optimizer_step()

    def _forward_backward(self, batch: Any, samples: int, window_samples: int) -> None:
        """Forward and backward of one micro-batch of `samples` samples. Its mean loss is weighted by its share
        of the window, so the gradient is the mean over the window whatever its size, a short last window of an
        epoch included."""
        BEAT.phase = heartbeat.FORWARD
        if self.amp.autocasts:
            with self.amp.autocast():
                loss = self._loss(batch)
        else:
            loss = self._loss(batch)
        share = loss if samples == window_samples else loss * (samples / window_samples)
        BEAT.phase = heartbeat.BACKWARD  # DDP's gradient all-reduce runs in here
        (self.amp.scaler.scale(share) if self.amp.scaling else share).backward()
        BEAT.phase = heartbeat.DATA
        self.meter.add(loss, samples)  # kept on the device: read only at the next sync point

    def _loss(self, batch: Any) -> torch.Tensor:
        """The micro-batch's forward and loss. The outputs are dropped on return, before the backward: the
        logits are no input of any backward (log_softmax keeps its own result), so they are freed now, not after
        the whole backward: a lower memory peak by their size, which a large vocabulary makes large."""
        outputs, targets = self.forward(self.wrapped, batch)
        if not self._batch_checked:  # once: a mismatch is one clear line, not an error deep in the loss
            check_first_batch(outputs, targets, self.loss_fn)
            self._batch_checked = True
        return compute_loss(outputs, targets, self.loss_fn)

    def _optimizer_step(self) -> None:
        """unscale -> clip -> step -> update, in the only order that is right (MULTI_GPU_GUIDE.md, "Mixed precision")."""
        BEAT.phase = heartbeat.OPTIMIZER  # until the step's end: the weights may be half updated
        if self.config.clip_grad_norm > 0:
            self.amp.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        self.applied_lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, as TensorBoard shows it
        if self.amp.scaling:
            scaler = self.amp.scaler
            scale_before = scaler._scale.clone()  # private, but get_scale() would sync the host
            scaler.step(self.optimizer)
            scaler.update()
            self.meter.skipped_steps += (scaler._scale < scale_before).to(torch.int64)  # a lowered scale = a skip
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler_interval == "step":
            self.scheduler.step()

    # ------------------------------------------------------------------ sync points
    def _at_sync_point(self, epoch_end: bool) -> bool:
        """Log steps, epoch ends and save steps: where ranks compare notes.

        Only conditions that are the same on every rank may be here, since each sync
        point is a collective (the fault injector's step, set on one rank, is not).
        """
        step, config = self.progress.global_step, self.config
        return (epoch_end or step % config.log_every == 0
                or (config.save_every_steps > 0 and step % config.save_every_steps == 0)
                or (self.runtime.world_size == 1 and self.stop.requested))

    def _sync_and_log(self) -> bool:
        """Reduce the interval over ranks (the one host sync), log it, and say whether to stop.

        One all-reduce carries everything, so ranks always make the same decision:
        stop on a signal that reached any rank, stop on a non-finite loss (unless
        fp16's scaler handles it by skipping the step).
        """
        interval, step = self.meter.reduce(self.stop.requested, bool(self.logged.values)), self.progress.global_step
        first_step = step - len(interval.step_losses) + 1
        if not math.isfinite(sum(interval.step_losses)) and not self.scaler.is_enabled():  # one check per interval
            bad = [first_step + i for i, loss in enumerate(interval.step_losses) if not math.isfinite(loss)]
            raise TrainingStopped(f"loss became non-finite at step {bad[0]}; stopped without saving, last good "
                                  f"checkpoint kept: {self.checkpointer.newest()}")
        self.train_samples += interval.samples
        self.train_seconds += interval.seconds
        skipped = int(self.meter.skipped_steps) if self.scaler.is_enabled() else None  # this rank's: all skip alike
        self.report.interval(step, first_step, interval, self.applied_lr, self.runtime.devices_per_step,
                             skipped, self.scaler.get_scale() if skipped is not None else None,
                             self.telemetry.interval(interval, first_step, step))
        if interval.log_votes:  # some rank has trainer.log scalars: all ranks reduce them
            self.report.scalars(self.logged.reduce(), step)
        self.meter.reset()
        return interval.stop_votes > 0

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, dataset: Optional[Dataset] = None) -> dict[str, float]:
        """Loss and metrics over every sample of `dataset` (default: the validation set) exactly once:
        `{"loss": ..., <each metric>: ..., "count": ...}`, the same numbers for any world size."""
        dataset = dataset if dataset is not None else self.val_dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset: none given and the trainer has no val_dataset")
        result = self.evaluator.run(self._eval_model(), dataset, self.eval_batch)
        assert result is not None  # no stop request without one
        return result

    def predict(self, dataset: Optional[Dataset] = None, *, batch_size: Optional[int] = None,
                output_path: Optional[str] = None, to: Any = "cpu") -> Any:
        """The model's outputs for every sample of `dataset` (default: the validation set) in dataset order,
        on every rank, exactly as one process gets them; `batch_size` per device (default: the evaluation's).
        With `output_path`, rank 0 streams them to that file instead (MULTI_GPU_GUIDE.md, "Prediction")."""
        model = self._eval_model()
        batch = self.eval_batch if batch_size is None else batch_size * max(1, len(self.runtime.dp_device_ids))
        predictor = Predictor(self.runtime, self.amp, self.forward, self.evaluator.num_workers,
                              self.evaluator.collate_fn)
        return predictor.run(model, dataset if dataset is not None else self.val_dataset, batch, output_path, to)

    def _eval_model(self) -> nn.Module:
        # A callback's module (EMA's average), else the plain module, so no DDP collective runs per batch;
        # DataParallel still splits the trained model's batch.
        if self.eval_model is not None:
            return self.eval_model
        return self.wrapped if self.runtime.mode == "dp" else self.model

    def _evaluate_and_save(self) -> bool:
        """Evaluate the epoch just trained, log it, save last.pt (and best.pt on a new best).
        False when a stop signal came during evaluation: the epoch's training is saved, unevaluated."""
        progress = self.progress
        BEAT.phase = heartbeat.EVALUATION
        if self.val_dataset is not None:
            result = self.evaluator.run(self._eval_model(), self.val_dataset, self.eval_batch, stop=self.stop)
            if result is None:
                return False
            self.metrics = {f"val_{name}": value for name, value in result.items() if name != "count"}
            self.report.epoch_metrics(progress.epoch, self.config.epochs, result, progress.global_step,
                                      mid_epoch=progress.samples_in_epoch > 0)  # --max-steps ended it there
        progress.evaluated = True
        is_best = self._is_new_best()
        BEAT.phase = heartbeat.USER_CODE
        self.callbacks.call("on_validation_end", self)  # before the save: the checkpoint holds what they decided
        self.report.scalars(self.logged.reduce(), progress.global_step)  # what was logged since the last sync point
        BEAT.phase = heartbeat.CHECKPOINT
        self.save_checkpoint("last.pt", also_as="best.pt" if is_best else None)
        self.report.flush()
        return True

    def _is_new_best(self) -> bool:
        """Whether this epoch's monitored metric beats the best so far (and record it)."""
        if not self.metrics:
            return False
        value = self.metrics[self.monitor.choose(self.metrics)]
        if not self.monitor.improves(value, self.progress.best_value):
            return False
        self.progress.best_value = value
        return True

    # ------------------------------------------------------------------ checkpoints
    def stateful(self, known_rng: Optional[Saved] = None) -> dict[str, Any]:
        """What a checkpoint holds, each thing with state_dict()/load_state_dict(): the checkpointer saves and
        loads these in this order, and knows nothing else of the trainer (multigpu/checkpoints/stateful.py). `known_rng`:
        every rank's RNG states known without a collective (the save from rank 0's replica alone); else
        gathered."""
        return {"model": ModelState(self.model), "model_info": ModelInfo(self.model),  # ties, a transformers config
                "optimizer": OptimizerState(self.model, self.optimizer),
                "scheduler": self.scheduler, "scaler": ScalerState(self.scaler, self.report.line),
                PROGRESS: _ProgressState(self), "callbacks": self.callbacks,
                "rng": known_rng or self.rng_state, "trackers": self.report.trackers,  # their runs' ids
                **({"stream_state": self.stream} if self.stream is not None else {}),  # data/streaming.py
                **({"autotune": self.autotune} if self.autotune is not None else {})}  # its choice, reused on resume

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, as one checkpoint file holds it (every rank must call it: the ranks' RNG
        states are gathered; rank 0 gets the whole model)."""
        return self.checkpointer.state_of(self.stateful())

    def load_state_dict(self, state: dict[str, Any], path: str = "the checkpoint") -> None:
        """Load a checkpoint (a file's state, or a sharded folder's at `path`) into the live model, optimizer,
        scheduler, scaler, progress and RNG."""
        built = group_settings(self.optimizer)  # this run's LR and weight decay, which the checkpoint's replace
        self.checkpointer.load_into(self.stateful(), state, path)
        # The schedule continues at the same point of training, in this run's steps, from this run's LR.
        keep_run_settings(self.optimizer, self.scheduler, built,
                          self.progress.epoch * self.steps_per_epoch + self.steps_done_in_epoch(),
                          self.builtin_schedule, self.builtin_optimizer)
        if state["world_size"] != self.runtime.world_size:
            self._continue_on_another_world_size(state["world_size"])

    def _continue_on_another_world_size(self, saved_world_size: int) -> None:
        """The data position is kept in global samples; the built-in schedule moves to the same point of
        training in this run's steps (MULTI_GPU_GUIDE.md, "Resume on another world size")."""
        if self.builtin_schedule:  # moved there by keep_run_settings
            schedule = "the LR schedule continues at the same point in samples"
        elif self.scheduler_interval == "step":
            schedule = "your per-step scheduler continues its own step count (it was built for the old steps/epoch)"
        else:
            schedule = "your per-epoch scheduler continues"
        self.report.line(f"resuming {saved_world_size} ranks' checkpoint with {self.runtime.world_size}: model and "
                         f"optimizer continue, the data position is kept by global sample count and {schedule}, "
                         f"but results are not bit-identical to an uninterrupted run")

    def save_checkpoint(self, name: str, also_as: Optional[str] = None) -> str:
        """Write a checkpoint to <save-dir>/name (rank 0 writes; every rank must call this), then call the
        callbacks' on_save."""
        path = self.checkpointer.save(self.stateful(), name, also_as)
        self.callbacks.call("on_save", self)
        return path

    # ------------------------------------------------------------------ your own scalars
    def log(self, values: dict[str, Any]) -> None:
        """Scalars of your own (floats or 0-d tensors, e.g. from a callback or a loss function) for the run's
        TensorBoard: kept on the device, averaged over their calls and the ranks at the next sync point
        (--log-every steps, an epoch's end) and written at that step. No host sync per call."""
        self.logged.add(values)

    # ------------------------------------------------------------------ stopping early
    def stop_training(self, reason: str) -> None:
        """End the run after the current epoch's evaluation and checkpoint, saying `reason` (callbacks call
        this, e.g. early stopping). One rank asking is enough: the ranks agree before each epoch."""
        self.stop_reason = self.stop_reason or reason

    def _stopping_early(self) -> bool:
        """Whether stop_training was called on any rank: one small collective per epoch, so all ranks stop
        after the same epoch."""
        self.stop_reason = next(filter(None, gather_objects(self.stop_reason)), None)  # type: ignore[arg-type]
        return self.stop_reason is not None

    def resume(self) -> bool:
        """Load --resume PATH, --resume auto's newest good checkpoint, or after a torchrun restart the newest
        one, into the live objects; True if one was loaded. fit() calls it first; once per trainer."""
        if self.scheduler.optimizer is not self.optimizer:
            raise UsageError("trainer.optimizer was replaced after construction, but the LR scheduler still drives "
                             "the old one: pass optimizer=... (and scheduler=...) to MultiGPUTrainer instead")
        if self._resumed:  # a later fit() of this trainer: the same run, continued in memory
            if self._trained():
                raise UsageError(f"fit() already trained this run to its {self.config.epochs} epochs (epochs is the "
                                 f"total, not epochs per call): nothing to train; to train further, build a trainer "
                                 f"with more epochs and resume='auto' (it continues from {self.config.save_dir})")
            return False
        self._resumed = True
        found = self.checkpointer.find()
        if found is None:
            return False
        path, state = found
        identity = {**{name: getattr(self.config, name) for name in ("mode", "dataset", "image_shape", "num_classes")},
                    "model": self.config.model_name, "train_size": self.sampler.dataset_size,
                    "optimizer_class": type(self.optimizer).__name__, "scheduler_class": type(self.scheduler).__name__}
        self.checkpointer.check(path, state, identity)
        self.load_state_dict(state, path)
        if self._trained():
            self.report.line(self._already_complete(path))
            return True
        self.report.line(f"resumed from {path}: epoch {self.progress.epoch + 1}, step {self.progress.global_step}, "
                         f"{self.progress.samples_in_epoch} samples into the epoch")
        self.report.purge_step = self.progress.global_step + 1
        return True

    def _already_complete(self, path: str) -> str:
        """The one line of a resume whose checkpoint has trained and evaluated every epoch (a checkpoint at
        --max-steps is refused before: multigpu/checkpoints/checkpointer.py): what it reached, and how to train further."""
        name, best = self.monitor.name, self.progress.best_value
        result = (f"best {name} {best:.4f}" if name and best is not None
                  else "no validation set" if self.val_dataset is None else "no finite validation metric")
        return (f"run in {os.path.dirname(os.path.normpath(path)) or '.'} is already complete: {self.progress.epoch} "
                f"epochs, {result}; nothing to train (raise --epochs to train further)")

    def _stop_for_signal(self) -> dict[str, Any]:
        signal_name = self.stop.signal_name or "a signal on another rank"
        stopped = f"stopped by {signal_name} at step {self.progress.global_step}"
        if self.checkpointer.keeps_previous_run:  # --overwrite before its first save: the old run comes back instead
            self.report.line(f"{stopped}, before this run's first checkpoint: nothing of it is saved")
            return self._summary(stopped=True)
        path = self.save_checkpoint("last.pt")
        self.report.line(f"{stopped}; checkpoint {path} written. Continue with the same command plus --resume auto")
        return self._summary(stopped=True)

    # ------------------------------------------------------------------ the end
    def _summary(self, **extra: Any) -> dict[str, Any]:
        """What fit returns: the last validation metrics, the best monitored value, progress and throughput."""
        name, best = self.monitor.name, self.progress.best_value
        return {**self.metrics, "monitor": name, "best": best, **({f"best_{name}": best} if name else {}),
                "epochs": self.progress.epoch, "global_step": self.progress.global_step,
                "samples_per_sec": self.train_samples / max(self.train_seconds, 1e-9), **self.telemetry.summary(),
                **extra}

    def plan_facts(self) -> plan.PlanFacts:
        """What the plan lines describe (multigpu/monitoring/plan.py), read from the live run."""
        return plan.PlanFacts(
            self.config, self.runtime, self.given, self.optimizer, self.scheduler, self.scheduler_interval,
            self.builtin_optimizer, self.builtin_schedule, self.lr, self.effective_batch, self.loader_batch,
            self.steps_per_epoch, self.sampler.usable, any(p.dim() == 4 for p in self.model.parameters()),
            self.amp.name, self.progress, self.steps_done_in_epoch(), self.data.line)

    def _report_done(self, summary: dict[str, Any]) -> None:
        """The end-of-run lines and hparams; `summary` gets `did_not_learn` (why) where the run shows it did not
        learn or ended at chance (a sweep marks such runs: multigpu/sweep/summary.py)."""
        classes = self.evaluator.classes
        warning = plan.learning_warning(self.report, classes, self.optimizer, self.lr, self.config.lr_scaling)
        if warning:
            self.report.line(warning)
        why = "; ".join(plan.no_learning_signs(self.report, classes)) or plan.at_chance(self.report, classes)
        if why:
            summary["did_not_learn"] = why
        self.report.line(plan.done_line(summary, self.monitor.name, self.val_dataset is not None,
                                        self.runtime.devices_per_step, self.telemetry.summary_text(summary)))
        self.report.hparams(self.config, {key: value for key, value in summary.items() if isinstance(value, float)
                                          and (key.startswith("val_") or key.startswith("best_"))})

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the save-dir and the writer and, if this trainer set up the process group, destroy it
        (after the DDP wrapper that holds it is gone). Without a call, it runs at interpreter exit, also for a
        trainer whose construction failed part-way (which has only some of these)."""
        built = vars(self)
        if "report" in built:
            self.report.close()
        if "checkpointer" in built:
            self.checkpointer.release()
        if self.owns_process_group:
            # DDP and its bound no_sync hold the group: dropped before it is destroyed
            self.wrapped, self.no_sync = built.get("model"), contextlib.nullcontext
            teardown()
            self.owns_process_group = False
        if self._close_at_exit is not None:
            atexit.unregister(self._close_at_exit)
            self._close_at_exit = None

    def __enter__(self) -> "MultiGPUTrainer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
