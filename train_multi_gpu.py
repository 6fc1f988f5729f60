"""MultiGPUTrainer: one training loop for DDP, DataParallel, one GPU and the CPU.

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

import contextlib
import gc
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from multigpu import checkpoint, faults, rng
from multigpu.amp import Amp, resolve_dtype
from multigpu.batches import ForwardFn, batch_size, check_first_batch, compute_loss, default_forward, to_device
from multigpu.checkpointer import Checkpointer
from multigpu.config import TrainConfig
from multigpu.data import build_loader
from multigpu.data.sampler import ResumableDistributedSampler
from multigpu.distributed import Runtime, gather_objects, is_distributed, setup, teardown
from multigpu.errors import TrainingStopped, UsageError
from multigpu.evaluation import Evaluator
from multigpu.lr_scaling import describe_lr, scaled_lr
from multigpu.meters import IntervalMeter
from multigpu.metrics import MetricsSpec, lower_is_better
from multigpu.optim import (INTERVALS, OptimizerArg, SchedulerArg, build_optimizer, build_scheduler,
                            move_schedule_to, users_optimizer, users_scheduler)
from multigpu.prediction import Predictor
from multigpu.preemption import StopRequest, stops_handled
from multigpu.reporting import Reporter

__all__ = ["MultiGPUTrainer", "TrainConfig"]


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # the epoch being trained (== epochs when done)
    global_step: int = 0  # optimizer steps taken
    samples_in_epoch: int = 0  # global samples of `epoch` already trained on, in the sampler's order
    best_value: Optional[float] = None  # of the monitored validation metric


class MultiGPUTrainer:
    """Trains `model` on `train_dataset` with the devices and settings in `config`.

    Bring your own task (MULTI_GPU_GUIDE.md, "Your own task"): `loss_fn` is any
    `(outputs, targets) -> scalar` (default cross-entropy); `optimizer` an
    Optimizer on the model's parameters or a function `params -> Optimizer`
    (default: `config.optimizer`); `scheduler` a function `optimizer -> scheduler`
    or a built one, stepped per optimizer step or, with `scheduler_interval="epoch"`,
    per epoch (default: `config.lr_schedule`); `metrics` names and/or functions
    (multigpu/metrics.py); batches of any structure, through `forward_fn(model,
    batch) -> (outputs, targets)` where the default pair/dict handling does not fit.

    Every rank constructs the trainer and calls `fit`; only rank 0 prints, logs
    and writes files. A trainer that set up the process group itself destroys it
    on `close()` (or at the end of a `with` block); one given a `runtime` leaves it alone.
    """

    def __init__(self, model: nn.Module, train_dataset: Dataset, val_dataset: Optional[Dataset] = None,
                 config: Optional[TrainConfig] = None, *, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 optimizer: OptimizerArg = None, scheduler: SchedulerArg = None, scheduler_interval: str = "step",
                 metrics: MetricsSpec = None, collate_fn: Optional[Callable] = None,
                 forward_fn: Optional[ForwardFn] = None, runtime: Optional[Runtime] = None):
        if scheduler_interval not in INTERVALS:
            raise ValueError(f"scheduler_interval must be one of {', '.join(INTERVALS)}; got {scheduler_interval!r}")
        self.config = config = config or TrainConfig()
        owned_before = is_distributed()
        self.runtime = rt = runtime or setup(config)
        self.owns_process_group = runtime is None and is_distributed() and not owned_before
        self.device = rt.device
        self.report = Reporter(config, rt.is_main)
        self.amp = Amp(resolve_dtype(config.amp, self.device, self.report.line), self.device.type)
        self.model = self._prepare_model(model)  # the plain module: checkpoints and evaluation use it
        self.wrapped = self._wrap(self.model)  # what training calls: DDP, DataParallel or the module itself
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.forward = forward_fn or default_forward
        self.train_dataset, self.val_dataset = train_dataset, val_dataset

        # --- batches: --batch-size is per device, DataParallel splits its bigger batch over its GPUs ---
        per_step = max(1, len(rt.dp_device_ids))
        self.loader_batch = config.batch_size * per_step
        self.eval_batch = (config.eval_batch_size or config.batch_size) * per_step
        self.effective_batch = config.batch_size * rt.devices_per_step * config.grad_accum_steps
        self.sampler = self._sampler(len(train_dataset))  # type: ignore[arg-type]
        self.train_loader = build_loader(train_dataset, self.device, config.num_workers, config.seed + rt.rank,
                                         sampler=self.sampler, batch_size=self.loader_batch, collate_fn=collate_fn)
        self.steps_per_epoch = math.ceil(len(self.sampler) / (self.loader_batch * config.grad_accum_steps))

        # --- optimisation: the user's optimizer and schedule, or the config's; LR scaling applies to both ---
        if optimizer is None:
            self.optimizer = build_optimizer(self.model, config, scaled_lr(config.lr, config.lr_scaling,
                                                                           self.effective_batch, config.lr_base_batch))
        else:
            self.optimizer = users_optimizer(optimizer, self.model, scaled_lr(1.0, config.lr_scaling,
                                                                              self.effective_batch, config.lr_base_batch))
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.builtin_optimizer, self.builtin_schedule = optimizer is None, scheduler is None
        self.scheduler = (build_scheduler(self.optimizer, config, self.steps_per_epoch) if scheduler is None
                          else users_scheduler(scheduler, self.optimizer, config.lr_scaling))
        self.scheduler_interval = "step" if scheduler is None else scheduler_interval

        self.evaluator = Evaluator(rt, self.amp, self.forward, self.loss_fn, metrics, config.num_workers, collate_fn)
        self.checkpointer = Checkpointer(config, rt, self.report)
        self.progress = Progress()
        self.metrics: dict[str, float] = {}
        self.monitor: Optional[str] = config.monitor  # resolved at the first evaluation when not given

        # Dropout and augmentation differ per rank but repeat on a rerun (MULTI_GPU_GUIDE.md, "Randomness").
        rng.seed_all(config.seed + rt.rank)
        checkpoint.check_writable(config.save_dir)  # on every rank: all of them stop with the same line
        self.train_samples, self.train_seconds, self.applied_lr = 0, 0.0, self.lr
        self.stop = StopRequest()
        self.die_at_step = faults.fault_step(rt.rank)
        self.meter = IntervalMeter(config.log_every, self.device)
        self._resumed, self._batch_checked = False, False

    # ------------------------------------------------------------------ set-up
    def _prepare_model(self, model: nn.Module) -> nn.Module:
        """--sync-bn conversion (before the DDP wrap) and the small-batch BatchNorm warning."""
        has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        # SyncBatchNorm raises in training mode on the CPU: it is a CUDA feature.
        synced = self.config.sync_bn and self.runtime.mode == "ddp" and self.device.type == "cuda"
        if synced:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # keeps weights, buffers and train/eval flags
        elif self.config.sync_bn:
            self.report.line("--sync-bn needs DDP on CUDA devices; keeping per-device BatchNorm")
        if has_batchnorm and not synced and self.runtime.devices_per_step > 1 and self.config.batch_size < 16:
            self.report.line(f"warning: BatchNorm statistics come from {self.config.batch_size} samples per device; "
                             f"results will depend on the device count (consider --sync-bn or a larger batch)")
        return model.to(self.device)

    def _wrap(self, model: nn.Module) -> nn.Module:
        rt = self.runtime
        if rt.mode == "ddp":
            return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if rt.mode == "dp":
            self.report.line("warning: nn.DataParallel drives all GPUs from one process (GPU 0 holds more memory, "
                             "other replicas' BatchNorm statistics are lost); DDP via torchrun is faster")
            return nn.DataParallel(model, device_ids=rt.dp_device_ids, output_device=rt.dp_device_ids[0])
        return model

    def _sampler(self, size: int) -> ResumableDistributedSampler:
        rt = self.runtime
        if size < rt.world_size:
            raise UsageError(f"a training set of {size} sample(s) cannot be shared by {rt.world_size} processes: "
                             f"use more data or fewer processes")
        return ResumableDistributedSampler(size, rt.rank, rt.world_size, self.config.seed)

    def _print_plan(self) -> None:
        config, rt = self.config, self.runtime
        batch_rule = ("dp splits each batch of batch-size x GPUs over the GPUs" if rt.mode == "dp"
                      else "ddp: --batch-size is per process" if rt.mode == "ddp" else "one device")
        steps_left = (config.epochs - self.progress.epoch) * self.steps_per_epoch - self._steps_done_in_epoch()
        last_step = self.progress.global_step + max(0, steps_left)
        resumed = f" ({steps_left} left)" if self.progress.global_step else ""
        schedule = (f"schedule {config.lr_schedule}, warm-up {round(config.warmup_epochs * self.steps_per_epoch)} "
                    f"steps" if self.builtin_schedule else
                    f"scheduler {type(self.scheduler).__name__} per {self.scheduler_interval}")
        self.report.line(rt.describe())
        self.report.line(f"batch {config.batch_size} per device x {rt.devices_per_step} devices x "
                         f"{config.grad_accum_steps} accumulation = {self.effective_batch} effective ({batch_rule})")
        self.report.line(f"optimizer {type(self.optimizer).__name__}, {self._describe_lr()}; {schedule}, "
                         f"{self.steps_per_epoch} steps/epoch, {last_step} steps{resumed}; amp {self.amp.name}")

    def _describe_lr(self) -> str:
        if self.builtin_optimizer:
            return describe_lr(self.config, self.effective_batch)
        scaling = self.config.lr_scaling
        return f"lr {self.lr:g} (the optimizer's own{'' if scaling == 'none' else f', --lr-scaling {scaling}'})"

    @property
    def amp_dtype(self) -> Optional[torch.dtype]:
        return self.amp.dtype

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.amp.scaler

    # ------------------------------------------------------------------ training
    def fit(self) -> dict[str, Any]:
        """Resume if asked, train to `config.epochs` evaluating and checkpointing after each epoch,
        and return the final metrics. The progress bar and TensorBoard writer are closed however it ends."""
        config, rt = self.config, self.runtime
        started = time.perf_counter()
        try:
            with stops_handled(self.stop, rt.rank, rt.world_size, min(config.dist_timeout, 10.0)):
                self.resume()
                self._print_plan()
                while self.progress.epoch < config.epochs:
                    if not self._run_epoch():
                        return self._stop_for_signal()
                    self._end_epoch()
            summary = self._summary(wall_time=time.perf_counter() - started)
            self._report_done(summary)
            return summary
        finally:
            self.report.close()

    def _run_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a stop signal ended it early."""
        progress, config = self.progress, self.config
        done_steps = self._steps_done_in_epoch()
        samples_left = len(self.sampler)  # this rank's, equal on every rank
        self.report.start_epoch(progress.epoch, config.epochs, self.steps_per_epoch, done_steps)
        self.wrapped.train()
        self.meter.started = time.perf_counter()  # evaluation and saving are not training time
        batches = iter(self.train_loader)
        while samples_left > 0:
            window = min(config.grad_accum_steps * self.loader_batch, samples_left)
            self._train_step(batches, window)
            samples_left -= window
            progress.samples_in_epoch += window * self.runtime.world_size
            progress.global_step += 1
            if self._at_sync_point(samples_left == 0) and self._sync_and_log():
                return False
            if config.save_every_steps and progress.global_step % config.save_every_steps == 0:
                self.checkpointer.save_step(self.state_dict())
            if progress.global_step == self.die_at_step:
                faults.kill_self()  # test-only fault injection: SIGKILL, like a preempted or OOM-killed worker
        self.report.end_epoch()
        return True

    def _steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already taken; also points the sampler at the rest."""
        self.sampler.start_at(self.progress.epoch, self.progress.samples_in_epoch)
        return self.steps_per_epoch - math.ceil(len(self.sampler) / (self.loader_batch * self.config.grad_accum_steps))

    def _train_step(self, batches: Iterator, window_samples: int) -> None:
        """One optimizer step over the micro-batches holding this rank's next `window_samples` samples.

        Each micro-batch's mean loss is weighted by its share of the window, so the
        gradient is the mean over the window whatever its size, including a short
        last window at the end of an epoch. DDP all-reduces only in the last
        micro-batch's backward: the others run forward and backward in no_sync
        (MULTI_GPU_GUIDE.md, "The effective-batch rule").
        """
        micro_batches = math.ceil(window_samples / self.loader_batch)
        for index in range(micro_batches):
            batch = to_device(next(batches), self.device)
            sync = index == micro_batches - 1
            with contextlib.nullcontext() if sync or self.runtime.mode != "ddp" else self.wrapped.no_sync():
                with self.amp.autocast():
                    outputs, targets = self.forward(self.wrapped, batch)
                    if not self._batch_checked:  # once: a mismatch is one clear line, not an error deep in the loss
                        check_first_batch(outputs, targets, self.loss_fn)
                        self._batch_checked = True
                    loss = compute_loss(outputs, targets, self.loss_fn)
                samples = batch_size(batch)
                share = loss if samples == window_samples else loss * (samples / window_samples)
                self.scaler.scale(share).backward()
            self.meter.add(loss, samples)  # kept on the device: read only at the next sync point
        self.meter.end_step(window_samples)
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        """unscale -> clip -> step -> update, in the only order that is right (MULTI_GPU_GUIDE.md, "Mixed precision")."""
        scaler = self.scaler
        if self.config.clip_grad_norm > 0:
            scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        self.applied_lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, as TensorBoard shows it
        if scaler.is_enabled():
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
        interval = self.meter.reduce(self.stop.requested)
        step = self.progress.global_step
        first_step = step - len(interval.step_losses) + 1
        bad = [first_step + i for i, loss in enumerate(interval.step_losses) if not math.isfinite(loss)]
        if bad and not self.scaler.is_enabled():
            raise TrainingStopped(f"loss became non-finite at step {bad[0]}; stopped without saving, last good "
                                  f"checkpoint kept: {self.checkpointer.newest()}")
        self.train_samples += interval.samples
        self.train_seconds += interval.seconds
        loss, per_sec = interval.mean_loss, interval.samples / max(interval.seconds, 1e-9)
        self.report.scalars({"train/loss": loss, "train/lr": self.applied_lr, "train/samples_per_sec": per_sec,
                             "train/samples_per_sec_per_device": per_sec / self.runtime.devices_per_step}, step)
        if self.scaler.is_enabled():
            # This rank's own count, not a sum: DDP gives every rank the same gradients, so all skip alike.
            skipped, scale = int(self.meter.skipped_steps), self.scaler.get_scale()
            self.report.scalars({"train/skipped_steps": skipped, "train/loss_scale": scale}, step)
            if skipped:
                self.report.line(f"steps {first_step}-{step}: the fp16 loss scaler skipped {skipped:.0f} step(s) "
                                 f"with inf/NaN gradients (weights unchanged there); loss scale now {scale:g}")
        self.report.advance(len(interval.step_losses), {"loss": f"{loss:.4f}", "lr": f"{self.applied_lr:.3g}",
                                                        "samples/s": f"{per_sec:.0f}"})
        if not self.config.progress:
            self.report.line(f"step {step}: loss {loss:.4f}, lr {self.applied_lr:.3g}, {per_sec:.0f} samples/s")
        self.meter.reset()
        return interval.stop_votes > 0

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, dataset: Optional[Dataset] = None) -> dict[str, float]:
        """Loss and metrics over every sample of `dataset` (default: the validation set) exactly once:
        `{"loss": ..., <each metric>: ..., "count": ...}`, the same numbers for any world size."""
        dataset = dataset if dataset is not None else self.val_dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset: none given and the trainer has no val_dataset")
        # The plain module, so no DDP collective runs per batch; DataParallel still splits the batch.
        model = self.wrapped if self.runtime.mode == "dp" else self.model
        return self.evaluator.run(model, dataset, self.eval_batch)

    def predict(self, dataset: Optional[Dataset] = None, *, batch_size: Optional[int] = None,
                output_path: Optional[str] = None, to: Any = "cpu") -> Any:
        """The model's outputs for every sample of `dataset` (default: the validation set) in dataset order,
        on every rank, exactly as one process gets them; `batch_size` per device (default: the evaluation's).
        With `output_path`, rank 0 streams them to that file instead (MULTI_GPU_GUIDE.md, "Prediction")."""
        model = self.wrapped if self.runtime.mode == "dp" else self.model
        batch = self.eval_batch if batch_size is None else batch_size * max(1, len(self.runtime.dp_device_ids))
        predictor = Predictor(self.runtime, self.amp, self.forward, self.evaluator.num_workers,
                              self.evaluator.collate_fn)
        return predictor.run(model, dataset if dataset is not None else self.val_dataset, batch, output_path, to)

    def _end_epoch(self) -> None:
        """Evaluate, log, move to the next epoch and save last.pt (and best.pt on a new best)."""
        progress = self.progress
        progress.epoch += 1
        progress.samples_in_epoch = 0
        if self.scheduler_interval == "epoch":
            self.scheduler.step()
        if self.val_dataset is not None:
            result = self.evaluate()
            self.metrics = {f"val_{name}": value for name, value in result.items() if name != "count"}
            self.report.scalars({f"val/{name}": value for name, value in result.items() if name != "count"},
                                progress.global_step)
            shown = ", ".join(f"val {name} {value:.4f}" for name, value in result.items() if name != "count")
            self.report.line(f"epoch {progress.epoch}/{self.config.epochs}: {shown} ({result['count']} samples)")
        is_best = self._is_new_best()
        self.checkpointer.save(self.state_dict(), "last.pt", also_as="best.pt" if is_best else None)
        self.report.flush()

    def _is_new_best(self) -> bool:
        """Whether this epoch's monitored metric beats the best so far (and record it): timm's eval_metric."""
        if not self.metrics:
            return False
        self.monitor = self.monitor or ("val_acc" if "val_acc" in self.metrics else "val_loss")
        if self.monitor not in self.metrics:
            raise UsageError(f"--monitor {self.monitor} is not a validation metric of this run; it has "
                             f"{', '.join(self.metrics)}")
        value, best = self.metrics[self.monitor], self.progress.best_value
        lower = (self.config.monitor_mode == "min" or
                 (self.config.monitor_mode == "auto" and lower_is_better(self.monitor)))
        better = math.isfinite(value) and (best is None or (value < best if lower else value > best))
        if better:
            self.progress.best_value = value
        return better

    def _summary(self, **extra: Any) -> dict[str, Any]:
        """What fit returns: the last validation metrics, the best monitored value, progress and throughput."""
        best = {"monitor": self.monitor, "best": self.progress.best_value}
        if self.monitor:
            best[f"best_{self.monitor}"] = self.progress.best_value
        return {**self.metrics, **best, "epochs": self.progress.epoch, "global_step": self.progress.global_step,
                "samples_per_sec": self.train_samples / max(self.train_seconds, 1e-9), **extra}

    def _report_done(self, summary: dict[str, Any]) -> None:
        best = (f"best {self.monitor.replace('_', ' ', 1)} {summary['best']:.4f}" if summary["best"] is not None
                else "no validation set" if self.val_dataset is None else "no finite validation metric")
        self.report.line(f"done: {best}, {summary['epochs']} epochs, wall time {summary['wall_time']:.1f}s, "
                         f"{summary['samples_per_sec']:.0f} samples/s "
                         f"({summary['samples_per_sec'] / self.runtime.devices_per_step:.0f} per device)")
        final = {key: value for key, value in summary.items()
                 if isinstance(value, float) and (key.startswith("val_") or key.startswith("best_"))}
        self.report.hparams(self.config, final)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, in plain types so it loads with weights_only=True.

        Every rank must call it (the ranks' RNG states are gathered). Saves happen
        between optimizer steps only, so no gradient accumulation is ever in flight.
        """
        rng_states = gather_objects(rng.rng_state(self.device))
        model = getattr(self.model, "_orig_mod", self.model)  # torch.compile'd modules save plain keys
        return {
            "format_version": checkpoint.FORMAT_VERSION,
            "torch_version": str(torch.__version__),  # a str subclass that weights_only refuses
            "model": model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_class": type(self.optimizer).__name__,
            "scheduler": self.scheduler.state_dict(),
            "scheduler_class": type(self.scheduler).__name__,
            "scheduler_interval": self.scheduler_interval,
            "scaler": self.scaler.state_dict(),
            "epoch": self.progress.epoch,
            "global_step": self.progress.global_step,
            "samples_in_epoch": self.progress.samples_in_epoch,
            "steps_per_epoch": self.steps_per_epoch,
            "sampler_seed": self.sampler.seed,
            "train_size": self.sampler.dataset_size,
            "monitor": self.monitor,
            "best_value": self.progress.best_value,
            "metrics": dict(self.metrics),
            "world_size": self.runtime.world_size,
            "rng": rng_states,
            "config": self.config.to_dict(),
        }

    def save_checkpoint(self, name: str, also_as: Optional[str] = None) -> str:
        """Write a checkpoint to <save-dir>/name (rank 0 writes; every rank must call this)."""
        return self.checkpointer.save(self.state_dict(), name, also_as)

    def resume(self) -> bool:
        """Load --resume PATH, --resume auto's newest good checkpoint, or after a torchrun restart the newest
        one, into the live objects; True if one was loaded. fit() calls it first; once per trainer."""
        if self.scheduler.optimizer is not self.optimizer:
            raise UsageError("trainer.optimizer was replaced after construction, but the LR scheduler still drives "
                             "the old one: pass optimizer=... (and scheduler=...) to MultiGPUTrainer instead")
        if self._resumed:
            return False
        self._resumed = True
        found = self.checkpointer.find()
        if found is None:
            return False
        path, state = found
        self.checkpointer.check(path, state, self._identity())
        self.load_state_dict(state, path)
        self.report.line(f"resumed from {path}: epoch {self.progress.epoch + 1}, step {self.progress.global_step}, "
                         f"{self.progress.samples_in_epoch} samples into the epoch")
        self.report.purge_step = self.progress.global_step + 1
        return True

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it."""
        return {**{name: getattr(self.config, name) for name in ("mode", "dataset", "image_shape", "num_classes")},
                "model": self.config.model_name, "train_size": self.sampler.dataset_size,
                "optimizer_class": type(self.optimizer).__name__, "scheduler_class": type(self.scheduler).__name__}

    def load_state_dict(self, state: dict[str, Any], path: str = "the checkpoint") -> None:
        """Load a checkpoint into the live model, optimizer, scheduler, scaler, progress and RNG."""
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [repr(error)]
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model/optimizer: "
                                             f"{lines[min(1, len(lines) - 1)][:300]}") from None
        if self.scaler.is_enabled() and not state["scaler"]:
            self.report.line("the checkpoint has no fp16 loss scale (saved without --amp fp16): starting a fresh one")
        else:
            self.scaler.load_state_dict(state["scaler"])
        same_monitor = state["monitor"] is None or self.monitor in (None, state["monitor"])
        self.monitor = self.monitor or state["monitor"]
        self.progress = Progress(state["epoch"], state["global_step"], state["samples_in_epoch"],
                                 state["best_value"] if same_monitor else None)
        self.metrics = dict(state.get("metrics", {}))
        self.sampler.seed = state.get("sampler_seed", self.sampler.seed)  # the epoch's order must not change
        if state["world_size"] == self.runtime.world_size:
            rng.set_rng_state(state["rng"][self.runtime.rank], self.device)
        else:
            self._continue_on_another_world_size(state["world_size"])

    def _continue_on_another_world_size(self, saved_world_size: int) -> None:
        """The data position is kept in global samples; the built-in schedule moves to the same point of
        training in this run's steps (MULTI_GPU_GUIDE.md, "Resume on another world size")."""
        if self.builtin_schedule:
            step = self.progress.epoch * self.steps_per_epoch + self._steps_done_in_epoch()
            move_schedule_to(self.scheduler, step, self.lr)
            schedule = "the LR schedule continues at the same point in samples"
        elif self.scheduler_interval == "step":
            schedule = "your per-step scheduler continues its own step count (it was built for the old steps/epoch)"
        else:
            schedule = "your per-epoch scheduler continues"
        self.report.line(f"resuming {saved_world_size} ranks' checkpoint with {self.runtime.world_size}: model and "
                         f"optimizer continue, the data position is kept by global sample count and {schedule}, "
                         f"but results are not bit-identical to an uninterrupted run")

    def _stop_for_signal(self) -> dict[str, Any]:
        path = self.save_checkpoint("last.pt")
        self.report.line(f"stopped by {self.stop.signal_name or 'a signal on another rank'} at step "
                         f"{self.progress.global_step}; checkpoint {path} written. Continue with the same "
                         f"command plus --resume auto")
        return self._summary(stopped=True)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the writer and, if this trainer set up the process group, destroy it (after the DDP
        wrapper that holds it is gone)."""
        self.report.close()
        if self.owns_process_group:
            self.wrapped = self.model
            gc.collect()
            teardown()
            self.owns_process_group = False

    def __enter__(self) -> "MultiGPUTrainer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
