"""MultiGPUTrainer: one training loop for DDP, FSDP and hybrid sharding, DataParallel, one GPU and the CPU.

Read `fit` first: it is the whole story (own the save-dir, resume, plan, epochs, evaluate and save); every
other method is one step of it. `__init__` composes the parts, each made by a factory beside it from the
settings it needs (multigpu/__init__.py maps the package). The only host syncs are at `--log-every` steps,
where the ranks also agree on stopping.

    metrics = MultiGPUTrainer(model, train_set, val_set, TrainConfig(epochs=3)).fit()  # under torchrun: DDP
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
from multigpu.data.device_data import DeviceData
from multigpu.data.feed import batch_sizes, training_data
from multigpu.engine import build, eval_only, parts, replicas, state, summary
from multigpu.loop.amp import Amp
from multigpu.loop.forward import ForwardFn, fitted_forward
from multigpu.loop.metrics import COUNTS, MetricsSpec, Monitor
from multigpu.loop.optim import OptimizerArg, SchedulerArg
from multigpu.loop.prediction import Predictor
from multigpu.loop.progress import Progress
from multigpu.loop.tokens import default_loss, weighting_for
from multigpu.monitoring import plan, reporting
from multigpu.monitoring.meters import IntervalMeter, LoggedScalars
from multigpu.parallel import lora
from multigpu.parallel.distributed import Runtime, gather_objects, runtime_for, teardown, teardown_at_exit
from multigpu.parallel.wrapping import prepare_model, wrapped_for_training
from multigpu.resilience import faults, heartbeat
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.preemption import StopRequest, stops_handled
from multigpu.tuning import cpu_memory
from multigpu.tuning.gc_pauses import long_lived_objects_frozen

__all__ = ["MultiGPUTrainer", "TrainConfig"]

LossFn = Callable[[Any, Any], torch.Tensor]


class MultiGPUTrainer:
    """Trains `model` on `train_dataset` with the devices and settings in `config`; every rank constructs it
    and calls `fit`, only rank 0 prints, logs and writes files.

    Your own task (docs/data.md, "Your own task"): `loss_fn(outputs, targets) -> scalar` (default
    cross-entropy); `optimizer` an Optimizer or `params -> Optimizer`; `scheduler` `optimizer -> scheduler`
    (or `(optimizer, total_steps)`) or a built one, stepped per step or per epoch (`scheduler_interval`);
    `metrics` (multigpu/loop/metrics.py); `forward_fn(model, batch) -> (outputs, targets)` where the default
    does not fit; `callbacks` (multigpu/loop/callbacks.py). A trainer that set up the process group destroys
    it on `close()`.
    """

    def __init__(
        self,
        model: nn.Module,
        train_dataset: Dataset,
        val_dataset: Dataset | None = None,
        config: TrainConfig | None = None,
        *,
        loss_fn: LossFn | None = None,
        optimizer: OptimizerArg = None,
        scheduler: SchedulerArg = None,
        scheduler_interval: str = "step",
        metrics: MetricsSpec = None,
        collate_fn: Callable | None = None,
        forward_fn: ForwardFn | None = None,
        runtime: Runtime | None = None,
        callbacks: Sequence[Any] = (),
    ):
        # Both refuse before the process group is set up: nothing to undo.
        build.check_arguments(model, scheduler_interval)
        config = config or TrainConfig()
        self.callbacks = build.callbacks(config, callbacks, val_dataset is not None)
        self.runtime, self.owns_process_group = runtime_for(config, runtime)
        # The flags the user set (copies of the config forget them).
        self.given = config.fields_given
        # A script that calls fit() or predict() and simply ends: close() runs at exit, destroying the group.
        self._close_at_exit = teardown_at_exit(self) if self.owns_process_group else None
        # A new run-N folder when --save-dir was not given.
        self.config, chosen = run_folders.run_folder(config, self.runtime)
        # A resume of a LoRA run without the LoRA flags adapts the model as the checkpoint's run did.
        self.config = run_folders.resumed_settings(self.config)
        self.device = self.runtime.device
        # Rank 0's console, progress bar and TensorBoard; the other ranks stay quiet.
        self.report = reporting.Reporter(self.config, self.runtime.is_main, chosen)
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.collate_fn = collate_fn
        self._set_up_model(model, loss_fn, forward_fn)
        self._set_up_data(optimizer)
        self._set_up_training(optimizer, scheduler, scheduler_interval)
        self._set_up_evaluation(metrics)
        self._set_up_run_state()
        # --fault-tolerance: torchft's replica groups around the step (multigpu/engine/replicas.py); None without it.
        self.replicas = replicas.join(self)
        # Dropout and augmentation differ per rank (per data rank: every replica group's too), and repeat on a rerun.
        rng.seed_all(self.config.seed + self.runtime.data_rank)

    def _set_up_model(self, model: nn.Module, loss_fn: LossFn | None, forward_fn: ForwardFn | None) -> None:
        """The precision, the model's form on its devices, its forward and the loss."""
        config = self.config
        self.amp = Amp.resolved(config.amp, self.device, self.runtime.mode == "fsdp", self.report.line)
        # Its forward signature is read once, here.
        self.forward = forward_fn or fitted_forward(model)
        # --float8, --sync-bn, --lora-r, --activation-checkpointing, --channels-last, --compile
        self.model = prepare_model(model, config, self.runtime, self.report.line)
        # --lora-r: the adapters' numbers and the frozen base's fingerprint, read while every rank holds it whole.
        self.adapters = lora.adapters_of(self.model, config)
        # Cross-entropy, over token ids too.
        self.loss_fn = loss_fn if loss_fn is not None else default_loss()
        # Means over samples or over tokens (--loss-weighting, multigpu/loop/tokens.py), read off the first
        # samples.
        self.weighting = weighting_for(config.loss_weighting, self.model, self.train_dataset, self.collate_fn)
        self.channels_last = config.channels_last

    def _set_up_data(self, optimizer: OptimizerArg) -> None:
        """The batch sizes (--batch-size auto's trials run here), the training batches and what times them."""
        rt = self.runtime
        dataset = self.train_dataset
        is_stream = streaming.is_stream(dataset)
        # --data-on-device: the set is moved there before --batch-size auto measures what memory is left.
        self.on_device = DeviceData(
            dataset, self.config, self.device, rt.world_size, self.collate_fn, is_stream
        )
        if self.config.batch_size == AUTO:
            self.config = parts.searched_batch_size(self, optimizer)
        sizes = batch_sizes(self.config, rt)
        self.loader_batch = sizes.loader
        self.eval_batch = sizes.evaluation
        self.effective_batch = sizes.effective
        self.data = training_data(
            dataset, self.config, rt, self.loader_batch, self.collate_fn, self.on_device
        )
        self.sampler = self.data.sampler
        self.stream = self.data.stream
        self.steps_per_epoch = self.data.steps_per_epoch
        self.telemetry = parts.run_telemetry(self)
        # A step's loss and samples, read at sync points.
        self.meter = IntervalMeter(self.device, self.loader_batch)

    def _set_up_training(self, optimizer: OptimizerArg, scheduler: SchedulerArg, interval: str) -> None:
        """The model wrapped for its mode, the optimizer and its schedule, and the step that runs them."""
        wrapped, no_sync, self.gradient_nodes = wrapped_for_training(
            self.model, self.config, self.runtime, self.amp.dtype, self.report.line
        )
        made = parts.optimization(self, optimizer, scheduler, interval)
        self.optimizer = made.optimizer
        self.scheduler = made.scheduler
        self.scheduler_interval = made.scheduler_interval
        self.builtin_optimizer = made.builtin_optimizer
        self.builtin_schedule = made.builtin_schedule
        self.lr = made.lr
        self.total_steps = made.total_steps
        # With the LR the scaling rule chose, as the checkpoint and TensorBoard's hparams record it.
        self.config = made.config
        self.step = parts.train_step(self, wrapped, no_sync)

    def _set_up_evaluation(self, metrics: MetricsSpec) -> None:
        """The evaluator, the metric that picks best.pt, and every name evaluation will look up, tried now."""
        self.evaluator = parts.evaluator(self, metrics)
        self.monitor = Monitor(self.config.monitor, self.config.monitor_mode)
        # A callback's module to evaluate and predict with (EMA's average).
        self.eval_model: nn.Module | None = None
        # Metrics, --monitor and targets tried on a few samples: a wrong name costs seconds, not an epoch.
        self.evaluator.check_names(self._eval_model(), self.val_dataset, self.monitor)

    def _set_up_run_state(self) -> None:
        """Where training stands, what stops it, and the parts that write: checkpoints and the sync points."""
        rt = self.runtime
        self._on_step_end = self.callbacks.hooks["on_step_end"]
        # Set by stop_training: the run ends after this epoch.
        self.stop_reason: str | None = None
        self.progress = Progress()
        self.metrics: dict[str, float] = {}
        self._resumed = False
        self.rng_state = stateful.RngState(rt)
        # fit() notes the buffers' versions.
        self.buffers_at_start: list[Any] = []
        self.stop = StopRequest()
        self.die_at_step = faults.fault_step(rt.rank)
        # trainer.log's scalars, until the next sync point.
        self.logged = LoggedScalars(self.device)
        # Tried in fit's first steps.
        self.autotune = parts.autotuner(self)
        self.checkpointer = Checkpointer.at_start(
            self.config, rt, self.report, self.model, self.optimizer, self.total_steps
        )
        # A second signal ends the process at once: --overwrite's files set aside are put back first.
        self.stop.before_exiting_at_once(self.checkpointer.put_back_at_once)
        self.sync = parts.sync_points(self)

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
        the final metrics. The save-dir lock, progress bar and TensorBoard writer are released however it
        ends."""
        rt = self.runtime
        started = time.perf_counter()
        replica = state.ReplicaSave(self)
        # (docs/hangs.md, "When a run hangs")
        save_dir = self.checkpointer.save_dir
        hang_watchdog = build.hang_watchdog(self.config, rt, self.progress.global_step, save_dir, replica)
        # How long a rank waits for the others' word on a stop signal, or for a lost peer's last collective.
        wait_seconds = min(self.config.dist_timeout, 10.0)
        try:
            peer_lost = replica.after_losing_a_peer
            with stops_handled(
                self.stop, rt.rank, rt.world_size, wait_seconds, peer_lost, rt.leave_replica_groups
            ):
                self.report.check_trackers()  # a --logger tracker not there: one line in seconds, not a wait
                self.checkpointer.claim()  # this run owns the save-dir until fit returns
                # A finished run, resumed: said in one line, nothing written.
                if self.resume() and self._trained():
                    return summary.run_summary(self, already_complete=True)
                for line in plan.plan_lines(self.plan_facts()):  # what will train, and how
                    self.report.line(line)
                self.callbacks.call("on_fit_start", self)
                if self.autotune is not None:  # its trials run from the first step ends, until it has chosen
                    self.autotune.start(self.progress.global_step, self.total_steps, self._on_step_end)
                self.telemetry.start()
                # What rank 0's replica needs to save alone when it loses a peer (state.save_from_replica).
                self.buffers_at_start = state.training_starts(self.rng_state, self.model)
                # Short GC pauses (no rank waits on another's); on the CPU, freed memory kept for the next
                # step.
                keep_memory = self.device.type == "cpu" and self.config.cache_cpu_memory
                with long_lived_objects_frozen(), cpu_memory.kept_for_the_next_step(keep_memory):
                    while not self._trained() and not self._stopping_early():
                        if self.progress.evaluated and not self._run_epoch():
                            return self._stop_for_signal()
                        # Evaluated already where --eval-every-steps' evaluation stopped the epoch early.
                        if not self.progress.evaluated and not self._evaluate_and_save():
                            return self._stop_for_signal()
            result = summary.finish(self, started)  # the done line, hparams, what fit returns
            self.callbacks.call("on_fit_end", self)  # --export-on-end's export, among others
            return result
        finally:
            if hang_watchdog is not None:
                hang_watchdog.stop()
            try:
                self.report.close()
            finally:  # also when the logs cannot be closed: the save-dir is given up, --overwrite's put back
                self.checkpointer.release()

    def _run_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a stop signal ended it early."""
        progress = self.progress
        config = self.config
        done_steps = self.steps_done_in_epoch()
        steps = self.steps_per_epoch or None  # None: one pass of a stream without __len__, its steps unknown
        if steps and config.max_steps:  # it ends mid-epoch
            steps = min(steps, done_steps + config.max_steps - progress.global_step)
        self.report.start_epoch(progress.epoch, config.epochs, steps, done_steps)
        self.step.wrapped.train()
        self.meter.started = time.perf_counter()  # evaluation and saving are not training time
        for batches, window, sizes, last in self.data.windows(self.report.line):
            self.step(batches, window, sizes)  # forward, backward and the optimizer (multigpu/loop/step.py)
            progress.samples_in_epoch += window * self.runtime.data_ranks  # every replica group's share
            progress.global_step += 1
            # Plain writes: the watchdog reads them.
            BEAT.step = progress.global_step
            BEAT.phase = heartbeat.USER_CODE
            for on_step_end in self._on_step_end:  # an empty list without callbacks
                on_step_end(self)
            BEAT.phase = heartbeat.LOGGING
            reached = progress.reached_max_steps(config.max_steps)  # --max-steps ends the run mid-epoch
            due = self.sync.due(progress.global_step, last or reached)
            if due and self.sync(progress.global_step, self.step.applied_lr):  # the ranks agreed to stop
                return False
            if config.save_every_steps and progress.global_step % config.save_every_steps == 0:
                BEAT.phase = heartbeat.CHECKPOINT
                self.checkpointer.save_step(self.stateful(), progress.global_step)
                self.callbacks.call("on_save", self)
            if self._evaluation_due(last or reached):  # --eval-every-steps, inside the epoch
                if not self._evaluate_and_save(every_steps=True):
                    return False
                if self._stopping_early():  # the epoch ends here, evaluated (fit's loop then ends)
                    self.report.end_epoch()
                    return True
            if (
                progress.global_step == self.die_at_step
            ):  # test-only: SIGKILL (a lost worker), SIGSTOP (a hang)
                faults.misbehave(self.runtime.rank)
            if reached and not last:
                self.report.end_epoch()
                progress.evaluated = False
                return True
        self.report.end_epoch()
        progress.epoch += 1
        progress.samples_in_epoch = 0
        progress.evaluated = False
        BEAT.phase = heartbeat.USER_CODE
        if self.scheduler_interval == "epoch":
            self.scheduler.step()
        self.callbacks.call("on_epoch_end", self)
        return True

    def _evaluation_due(self, epoch_ends: bool) -> bool:
        """Whether --eval-every-steps evaluates after this step: every N optimizer steps, but not where the
        epoch's (or --max-steps') own evaluation follows at once."""
        every = self.config.eval_every_steps
        return bool(every) and self.progress.global_step % every == 0 and not epoch_ends

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

    def evaluate_saved(self) -> dict[str, Any]:
        """--eval-only: load the saved weights (--init-from, --resume, or --model-path's own), evaluate the
        validation set, say it in one line and write <save-dir>/eval.json; nothing trains, no checkpoint is
        written (multigpu/engine/eval_only.py). Every rank calls it."""
        try:
            return eval_only.evaluate_saved(self)
        finally:
            self.report.close()

    def predict(
        self,
        dataset: Dataset | None = None,
        *,
        batch_size: int | None = None,
        output_path: str | None = None,
        to: Any = "cpu",
    ) -> Any:
        """The model's outputs for every sample of `dataset` (default: the validation set) in dataset order,
        on every rank, as one process gets them; `batch_size` per device (default: the evaluation's). With
        `output_path`, rank 0 streams them to that file instead (docs/prediction.md, "Prediction")."""
        if batch_size is not None:  # per device: DataParallel's devices share one batch
            batch_size *= max(1, len(self.runtime.dp_device_ids))
        predictor = Predictor(self.runtime, self.amp, self.forward, self.config.num_workers, self.collate_fn)
        dataset = dataset if dataset is not None else self.val_dataset
        return predictor.run(self._eval_model(), dataset, batch_size or self.eval_batch, output_path, to)

    def _eval_model(self) -> nn.Module:
        # A callback's module (EMA's average), else the plain module, so no DDP collective runs per batch;
        # DataParallel still splits the trained model's batch.
        if self.eval_model is not None:
            return self.eval_model
        return self.step.wrapped if self.runtime.mode == "dp" else self.model

    def _evaluate_and_save(self, every_steps: bool = False) -> bool:
        """Evaluate the epoch just trained (`every_steps`: the steps so far, for --eval-every-steps), log it, save
        last (and best on a new best). False when a stop signal came during evaluation: the epoch's training is
        saved, unevaluated."""
        progress = self.progress
        BEAT.phase = heartbeat.EVALUATION
        if self.val_dataset is not None:
            result = self.evaluator.run(self._eval_model(), self.val_dataset, self.eval_batch, stop=self.stop)
            if result is None:
                return False
            self.metrics = {f"val_{name}": value for name, value in result.items() if name not in COUNTS}
            # mid_epoch: --max-steps ended the epoch there.
            mid_epoch = progress.samples_in_epoch > 0
            self.report.epoch_metrics(
                progress.epoch,
                self.config.epochs,
                result,
                progress.global_step,
                mid_epoch=mid_epoch,
                why="--eval-every-steps" if every_steps else "--max-steps",
            )
        progress.evaluated = True
        best = self.monitor.new_best(self.metrics, progress.best_value)
        progress.best_value = progress.best_value if best is None else best
        BEAT.phase = heartbeat.USER_CODE
        # Before the save: the checkpoint holds what the callbacks decided.
        self.callbacks.call("on_validation_end", self)
        # What trainer.log got since the last sync point.
        self.report.scalars(self.logged.reduce(), progress.global_step)
        BEAT.phase = heartbeat.CHECKPOINT
        self.save_checkpoint("last.pt", also_as="best.pt" if best is not None else None)
        self.report.flush()
        return True

    # ------------------------------------------------------------------ checkpoints
    def stateful(self, known_rng: stateful.Saved | None = None) -> dict[str, Any]:
        """What a checkpoint holds, each with state_dict()/load_state_dict() (multigpu/engine/state.py)."""
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
        return state.resume(self) if self.replicas is None else self.replicas.resume()

    def _stop_for_signal(self) -> dict[str, Any]:
        state.stop_for_signal(self)
        return summary.run_summary(self, stopped=True)

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
        reasons = gather_objects(self.stop_reason)
        self.stop_reason = next(filter(None, reasons), None)
        return self.stop_reason is not None

    # ------------------------------------------------------------------ the plan, the end
    def plan_facts(self) -> plan.PlanFacts:
        return summary.plan_facts(self)

    def close(self) -> None:
        """Release the save-dir and the writer and, if this trainer set up the process group, destroy it;
        without a call, at interpreter exit, also for a trainer whose construction failed part-way."""
        built = vars(self)
        if "report" in built:
            self.report.close()
        if "checkpointer" in built:
            self.checkpointer.release()
        if self.owns_process_group:
            if "step" in built:  # DDP and its bound no_sync hold the group: dropped before it is destroyed
                self.step.wrapped = self.model
                self.step.no_sync = contextlib.nullcontext
            teardown()
            self.owns_process_group = False
        if self._close_at_exit is not None:
            atexit.unregister(self._close_at_exit)
            self._close_at_exit = None

    def __enter__(self) -> MultiGPUTrainer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
