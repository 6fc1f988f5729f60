"""MultiGPUTrainer: one training loop for DDP, FSDP and hybrid sharding, DataParallel, one GPU and the CPU.

Read `fit` first: it is the whole story (own the save-dir, resume, plan, epochs, evaluate and save); every other
method is one step of it. `__init__` composes the parts, each made by a factory beside it from the settings it
needs (multigpu/__init__.py maps the package). The only host syncs are at `--log-every` steps, where the ranks
also agree on stopping.

    metrics = MultiGPUTrainer(model, train_set, val_set, TrainConfig(epochs=3)).fit()  # or under torchrun: DDP
"""

from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from multigpu import rng
from multigpu.checkpoints import run_folders, stateful
from multigpu.checkpoints.checkpointer import Checkpointer
from multigpu.config import AUTO, TrainConfig
from multigpu.data import streaming
from multigpu.data.batches import batch_mover
from multigpu.data.device_data import DeviceData
from multigpu.data.feed import batch_sizes, training_data
from multigpu.engine import build, state, summary
from multigpu.loop.amp import Amp
from multigpu.loop.evaluation import Evaluator
from multigpu.loop.forward import ForwardFn, fitted_forward
from multigpu.loop.metrics import COUNTS, MetricsSpec, Monitor
from multigpu.loop.optim import OptimizerArg, SchedulerArg, optimization
from multigpu.loop.prediction import Predictor
from multigpu.loop.progress import Progress
from multigpu.loop.step import TrainStep
from multigpu.loop.tokens import default_loss, token_loss_for, weighting_for
from multigpu.monitoring import plan, reporting, telemetry
from multigpu.monitoring.meters import IntervalMeter, LoggedScalars
from multigpu.monitoring.sync import SyncPoints
from multigpu.parallel.distributed import Runtime, gather_objects, runtime_for, teardown, teardown_at_exit
from multigpu.parallel.wrapping import prepare_model, wrapped_for_training
from multigpu.resilience import faults, heartbeat
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.preemption import StopRequest, stops_handled
from multigpu.tuning import autotune, cpu_memory
from multigpu.tuning import batch_size as batch_size_search
from multigpu.tuning.gc_pauses import long_lived_objects_frozen

__all__ = ["MultiGPUTrainer", "TrainConfig"]


class MultiGPUTrainer:
    """Trains `model` on `train_dataset` with the devices and settings in `config`; every rank constructs it and
    calls `fit`, only rank 0 prints, logs and writes files.

    Your own task (docs/data.md, "Your own task"): `loss_fn(outputs, targets) -> scalar` (default
    cross-entropy); `optimizer` an Optimizer or `params -> Optimizer`; `scheduler` `optimizer -> scheduler` (or
    `(optimizer, total_steps)`) or a built one, stepped per step or per epoch (`scheduler_interval`); `metrics`
    (multigpu/loop/metrics.py); `forward_fn(model, batch) -> (outputs, targets)` where the default does not fit;
    `callbacks` (multigpu/loop/callbacks.py). A trainer that set up the process group destroys it on `close()`.
    """

    def __init__(
        self,
        model: nn.Module,
        train_dataset: Dataset,
        val_dataset: Dataset | None = None,
        config: TrainConfig | None = None,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: OptimizerArg = None,
        scheduler: SchedulerArg = None,
        scheduler_interval: str = "step",
        metrics: MetricsSpec = None,
        collate_fn: Callable | None = None,
        forward_fn: ForwardFn | None = None,
        runtime: Runtime | None = None,
        callbacks: Sequence[Any] = (),
    ):
        build.check_arguments(
            model, scheduler_interval
        )  # before the process group is set up: nothing to undo
        config = config or TrainConfig()
        self.callbacks = build.callbacks(
            config, callbacks, val_dataset is not None
        )  # refused before the group too
        self.runtime, self.owns_process_group = runtime_for(config, runtime)
        self.given, rt = (
            config.fields_given,
            self.runtime,
        )  # the flags the user set (copies of the config forget them)
        # A script that calls fit() or predict() and simply ends: the group is destroyed at exit, as close() does.
        self._close_at_exit = teardown_at_exit(self) if self.owns_process_group else None
        config, chosen = run_folders.run_folder(
            config, rt
        )  # a new run-N folder when --save-dir was not given
        self.config, self.report, self.device = (
            config,
            reporting.Reporter(config, rt.is_main, chosen),
            rt.device,
        )
        say = self.report.line  # rank 0's console, progress bar and TensorBoard; the other ranks stay quiet
        self.amp = Amp.resolved(config.amp, rt.device, rt.mode == "fsdp", say)
        self.forward = forward_fn or fitted_forward(model)  # its forward signature read once
        self.model = prepare_model(model, config, rt, say)  # --float8, --sync-bn, --channels-last, --compile
        self.loss_fn = loss_fn if loss_fn is not None else default_loss()  # cross-entropy, token ids too
        # Means over samples or over tokens (--loss-weighting; multigpu/loop/tokens.py), read off the first samples
        self.weighting = weighting_for(config.loss_weighting, self.model, train_dataset, collate_fn)
        self.channels_last, move = config.channels_last, batch_mover(self.device, config.channels_last)
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        # --data-on-device: the set moved there before --batch-size auto measures what memory is left
        self.on_device = DeviceData(
            train_dataset, config, self.device, rt.world_size, collate_fn, streaming.is_stream(train_dataset)
        )
        if config.batch_size == AUTO:
            self.config = config = batch_size_search.auto_batch_size(
                config,
                self.model,
                optimizer,
                self.forward,
                self.loss_fn,
                self.amp,
                move,
                train_dataset,
                collate_fn,
                rt,
                say,
            )
        assert isinstance(config.batch_size, int)  # auto is resolved just above
        sizes = batch_sizes(config, rt)
        self.loader_batch, self.eval_batch, self.effective_batch = (
            sizes.loader,
            sizes.evaluation,
            sizes.effective,
        )
        self.data = data = training_data(
            train_dataset, config, rt, self.loader_batch, collate_fn, self.on_device
        )
        self.sampler, self.stream, self.steps_per_epoch = data.sampler, data.stream, data.steps_per_epoch
        self.telemetry = telemetry.run_telemetry(
            rt,
            self.amp,
            self.train_loader,
            self.report,
            self.model,
            self.forward,
            move,
            train_dataset,
            config.batch_size,
            collate_fn,
            self.weighting,
        )
        self.meter = IntervalMeter(
            self.device, self.loader_batch
        )  # a step's loss and samples, read at sync points
        wrapped, no_sync, self.gradient_nodes = wrapped_for_training(
            self.model, config, rt, self.amp.dtype, say
        )
        made = optimization(
            self.model,
            config,
            self.given,
            optimizer,
            scheduler,
            scheduler_interval,
            self.effective_batch,
            data.steps_per_epoch,
            data.stream is not None,
        )
        self.optimizer, self.scheduler, self.scheduler_interval = (
            made.optimizer,
            made.scheduler,
            made.scheduler_interval,
        )
        self.builtin_optimizer, self.builtin_schedule, self.lr = (
            made.builtin_optimizer,
            made.builtin_schedule,
            made.lr,
        )
        self.total_steps, self.config, config = made.total_steps, made.config, made.config
        token_loss = token_loss_for(self.forward, self.loss_fn, self.model, rt.mode, rt.world_size)
        self.step = TrainStep(
            self.model,
            wrapped,
            no_sync,
            self.forward,
            self.loss_fn,
            self.amp,
            self.optimizer,
            self.scheduler,
            self.scheduler_interval,
            config.clip_grad_norm,
            self.meter,
            self.telemetry.clock.fetch,
            move,
            self.weighting,
            token_loss,
        )
        self.evaluator = Evaluator(
            rt,
            self.amp,
            self.forward,
            self.loss_fn,
            metrics,
            config.num_workers,
            collate_fn,
            move,
            self.weighting,
        )
        self.monitor = Monitor(config.monitor, config.monitor_mode)  # picks best.pt
        self._on_step_end = self.callbacks.hooks["on_step_end"]
        self.stop_reason: str | None = None  # set by stop_training: the run ends after this epoch
        self.eval_model: nn.Module | None = None  # a callback's module to evaluate and predict with (EMA's)
        # Every name evaluation looks up (metrics, --monitor, targets) tried on a few samples: seconds, not an epoch
        self.evaluator.check_names(self._eval_model(), val_dataset, self.monitor)
        self.metrics: dict[str, float]  # the last validation's
        self.buffers_at_start: list[tuple[int, int]]
        self.progress, self.metrics, self._resumed = Progress(), {}, False
        self.rng_state, self.buffers_at_start = stateful.RngState(rt), []  # fit() notes the buffers' versions
        self.stop, self.die_at_step = StopRequest(), faults.fault_step(rt.rank)
        self.logged = LoggedScalars(self.device)  # trainer.log's scalars, until the next sync point
        self.autotune = (
            autotune.make_autotuner(
                config,
                rt,
                self.model,
                self.given,
                lambda setting: build.use_setting(self, setting),
                say,
                data=self.on_device.measured,
            )
            if config.autotune or self.on_device.measured
            else None
        )  # tried in fit's first steps
        self.checkpointer = Checkpointer.at_start(
            config, rt, self.report, self.model, self.optimizer, self.total_steps
        )
        self.sync = SyncPoints(
            config,
            rt,
            self.meter,
            self.logged,
            self.report,
            self.telemetry,
            self.amp,
            self.stop,
            self.checkpointer.newest,
        )
        rng.seed_all(config.seed + rt.rank)  # dropout and augmentation differ per rank, repeat on a rerun

    @property
    def train_loader(self) -> Any:
        """The training batches in use: a DataLoader, or the device's (--data-on-device)."""
        return self.data.loader

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return self.amp.dtype

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.amp.scaler

    # ------------------------------------------------------------------ training
    def fit(self) -> dict[str, Any]:
        """Resume if asked, train to `config.epochs` evaluating and checkpointing after each epoch, and return
        the final metrics. The save-dir lock, progress bar and TensorBoard writer are released however it ends."""
        rt, started, replica = self.runtime, time.perf_counter(), state.ReplicaSave(self)
        hang_watchdog = build.hang_watchdog(
            self.config, rt, self.progress.global_step, self.checkpointer.save_dir, replica
        )  # (docs/hangs.md, "When a run hangs")
        try:
            with stops_handled(
                self.stop,
                rt.rank,
                rt.world_size,
                min(self.config.dist_timeout, 10.0),
                on_peer_lost=replica.after_losing_a_peer,
            ):
                self.checkpointer.claim()  # this run owns the save-dir until fit returns
                if (
                    self.resume() and self._trained()
                ):  # a finished run, resumed: said in one line, nothing written
                    return self._summary(already_complete=True)
                for line in plan.plan_lines(self.plan_facts()):  # what will train, and how
                    self.report.line(line)
                self.callbacks.call("on_fit_start", self)
                if self.autotune is not None:  # its trials run from the first step ends, until it has chosen
                    self.autotune.start(self.progress.global_step, self.total_steps, self._on_step_end)
                self.telemetry.start()
                # What rank 0's replica needs to save alone when it loses a peer (state.save_from_replica).
                self.buffers_at_start = state.training_starts(self.rng_state, self.model)
                # Short GC pauses (no rank waits on another's); on the CPU, freed memory kept for the next step
                with (
                    long_lived_objects_frozen(),
                    cpu_memory.kept_for_the_next_step(
                        self.device.type == "cpu" and self.config.cache_cpu_memory
                    ),
                ):
                    while not self._trained() and not self._stopping_early():
                        if self.progress.evaluated and not self._run_epoch():
                            return self._stop_for_signal()
                        if not self._evaluate_and_save():
                            return self._stop_for_signal()
            result = summary.finish(self, started)  # the done line, hparams, what fit returns
            self.callbacks.call("on_fit_end", self)  # --export-on-end's export, among others
            return result
        finally:
            if hang_watchdog is not None:
                hang_watchdog.stop()
            try:
                self.report.close()
            finally:  # also when the logs cannot be closed: the save-dir is given up, --overwrite's files put back
                self.checkpointer.release()

    def _run_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a stop signal ended it early."""
        progress, config, done_steps = self.progress, self.config, self.steps_done_in_epoch()
        steps = self.steps_per_epoch or None  # None: one pass of a stream without __len__, its steps unknown
        if steps and config.max_steps:  # it ends mid-epoch
            steps = min(steps, done_steps + config.max_steps - progress.global_step)
        self.report.start_epoch(progress.epoch, config.epochs, steps, done_steps)
        self.step.wrapped.train()
        self.meter.started = time.perf_counter()  # evaluation and saving are not training time
        for batches, window, sizes, last in self.data.windows(self.report.line):
            self.step(batches, window, sizes)  # forward, backward and the optimizer (multigpu/loop/step.py)
            progress.samples_in_epoch += window * self.runtime.world_size
            progress.global_step += 1
            BEAT.step, BEAT.phase = (
                progress.global_step,
                heartbeat.USER_CODE,
            )  # plain writes: the watchdog reads them
            for on_step_end in self._on_step_end:  # an empty list without callbacks
                on_step_end(self)
            BEAT.phase = heartbeat.LOGGING
            reached = progress.reached_max_steps(config.max_steps)  # --max-steps ends the run mid-epoch
            if self.sync.due(progress.global_step, last or reached) and self.sync(
                progress.global_step, self.step.applied_lr
            ):
                return False
            if config.save_every_steps and progress.global_step % config.save_every_steps == 0:
                BEAT.phase = heartbeat.CHECKPOINT
                self.checkpointer.save_step(self.stateful(), progress.global_step)
                self.callbacks.call("on_save", self)
            if progress.global_step == self.die_at_step:
                faults.misbehave(
                    self.runtime.rank
                )  # test-only: SIGKILL (a preempted worker) or SIGSTOP (a hang)
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

    def _trained(self) -> bool:
        return self.progress.finished(self.config.epochs, self.config.max_steps)

    def steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already taken; also points the sampler at the rest."""
        return self.data.steps_done(self.progress.epoch, self.progress.samples_in_epoch)

    # ------------------------------------------------------------------ evaluation and prediction
    def evaluate(self, dataset: Dataset | None = None) -> dict[str, float]:
        """Loss and metrics over every sample of `dataset` (default: the validation set) exactly once:
        `{"loss": ..., <each metric>: ..., "count": ...}`, the same numbers for any world size (a loss over
        tokens: the mean over every counted token, `perplexity`, and `tokens` counted)."""
        dataset = dataset if dataset is not None else self.val_dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset: none given and the trainer has no val_dataset")
        return self.evaluator.run(self._eval_model(), dataset, self.eval_batch)  # type: ignore[return-value]

    def predict(
        self,
        dataset: Dataset | None = None,
        *,
        batch_size: int | None = None,
        output_path: str | None = None,
        to: Any = "cpu",
    ) -> Any:
        """The model's outputs for every sample of `dataset` (default: the validation set) in dataset order, on
        every rank, as one process gets them; `batch_size` per device (default: the evaluation's). With
        `output_path`, rank 0 streams them to that file instead (docs/prediction.md, "Prediction")."""
        batch = (
            self.eval_batch if batch_size is None else batch_size * max(1, len(self.runtime.dp_device_ids))
        )
        predictor = Predictor(
            self.runtime, self.amp, self.forward, self.evaluator.num_workers, self.evaluator.collate_fn
        )
        return predictor.run(
            self._eval_model(), dataset if dataset is not None else self.val_dataset, batch, output_path, to
        )

    def _eval_model(self) -> nn.Module:
        # A callback's module (EMA's average), else the plain module, so no DDP collective runs per batch;
        # DataParallel still splits the trained model's batch.
        if self.eval_model is not None:
            return self.eval_model
        return self.step.wrapped if self.runtime.mode == "dp" else self.model

    def _evaluate_and_save(self) -> bool:
        """Evaluate the epoch just trained, log it, save last (and best on a new best). False when a stop
        signal came during evaluation: the epoch's training is saved, unevaluated."""
        progress, BEAT.phase = self.progress, heartbeat.EVALUATION
        if self.val_dataset is not None:
            result = self.evaluator.run(self._eval_model(), self.val_dataset, self.eval_batch, stop=self.stop)
            if result is None:
                return False
            self.metrics = {f"val_{name}": value for name, value in result.items() if name not in COUNTS}
            self.report.epoch_metrics(
                progress.epoch,
                self.config.epochs,
                result,
                progress.global_step,
                mid_epoch=progress.samples_in_epoch > 0,
            )  # --max-steps ended it there
        progress.evaluated, best = True, self.monitor.new_best(self.metrics, progress.best_value)
        progress.best_value = progress.best_value if best is None else best
        BEAT.phase = heartbeat.USER_CODE
        self.callbacks.call(
            "on_validation_end", self
        )  # before the save: the checkpoint holds what they decided
        self.report.scalars(
            self.logged.reduce(), progress.global_step
        )  # what was logged since the last sync point
        BEAT.phase = heartbeat.CHECKPOINT
        self.save_checkpoint("last.pt", also_as="best.pt" if best is not None else None)
        self.report.flush()
        return True

    # ------------------------------------------------------------------ checkpoints
    def stateful(self, known_rng: stateful.Saved | None = None) -> dict[str, Any]:
        """What a checkpoint holds, each thing with state_dict()/load_state_dict() (multigpu/engine/state.py)."""
        return state.contents(self, known_rng)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, as one checkpoint file holds it (every rank must call it)."""
        return self.checkpointer.state_of(self.stateful())

    def load_state_dict(self, saved: dict[str, Any], path: str = "the checkpoint") -> None:
        """Load a checkpoint (a file's state, or a sharded folder's at `path`) into the live run."""
        state.load(self, saved, path)

    def save_checkpoint(self, name: str, also_as: str | None = None) -> str:
        """Write <save-dir>/name (rank 0 writes; every rank must call this), then the callbacks' on_save."""
        path = self.checkpointer.save(self.stateful(), name, also_as)
        self.callbacks.call("on_save", self)
        return path

    def resume(self) -> bool:
        """Load --resume PATH, --resume auto's newest good checkpoint, or after a torchrun restart the newest
        one, into the live objects; True if one was loaded. fit() calls it first; once per trainer."""
        if self.scheduler.optimizer is not self.optimizer:
            raise state.refuse_replaced_optimizer()
        if self._resumed:  # a later fit() of this trainer: the same run, continued in memory
            if self._trained():
                raise state.refuse_another_fit(self.config)
            return False
        self._resumed = True
        return state.resume(self)

    def _stop_for_signal(self) -> dict[str, Any]:
        state.stop_for_signal(self)
        return self._summary(stopped=True)

    # ------------------------------------------------------------------ your own scalars, stopping early
    def log(self, values: dict[str, Any]) -> None:
        """Scalars of your own (floats or 0-d tensors) for TensorBoard and the trackers: kept on the device,
        averaged over their calls and the ranks at the next sync point and written at that step."""
        self.logged.add(values)

    def stop_training(self, reason: str) -> None:
        """End the run after the current epoch's evaluation and checkpoint, saying `reason` (e.g. early
        stopping). One rank asking is enough: the ranks agree before each epoch."""
        self.stop_reason = self.stop_reason or reason

    def _stopping_early(self) -> bool:
        self.stop_reason = next(filter(None, gather_objects(self.stop_reason)), None)
        return self.stop_reason is not None

    # ------------------------------------------------------------------ the plan, the end
    def plan_facts(self) -> plan.PlanFacts:
        return summary.plan_facts(self)

    def _summary(self, **extra: Any) -> dict[str, Any]:
        return summary.summary(
            self.metrics,
            self.monitor.name,
            self.progress,
            self.sync.samples,
            self.sync.seconds,
            self.telemetry,
            **extra,
        )

    def close(self) -> None:
        """Release the save-dir and the writer and, if this trainer set up the process group, destroy it; without
        a call, at interpreter exit, also for a trainer whose construction failed part-way."""
        built = vars(self)
        if "report" in built:
            self.report.close()
        if "checkpointer" in built:
            self.checkpointer.release()
        if self.owns_process_group:
            if "step" in built:  # DDP and its bound no_sync hold the group: dropped before it is destroyed
                self.step.wrapped, self.step.no_sync = self.model, contextlib.nullcontext
            teardown()
            self.owns_process_group = False
        if self._close_at_exit is not None:
            atexit.unregister(self._close_at_exit)
            self._close_at_exit = None

    def __enter__(self) -> MultiGPUTrainer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
