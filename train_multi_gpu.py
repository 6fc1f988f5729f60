"""MultiGPUTrainer: one training loop for DDP, DataParallel, one GPU and the CPU.

Read `fit` first: it is the whole story (resume, epochs, evaluation,
checkpoints); every other method is one step of it. Each step costs what the
same step of a hand-written loop costs: the only host syncs are at
`--log-every` steps, where the ranks also agree on stopping.

    from train_multi_gpu import MultiGPUTrainer, TrainConfig
    metrics = MultiGPUTrainer(model, train_set, val_set, TrainConfig(epochs=3)).fit()

Run under `torchrun --nproc_per_node=N` and the same code trains with DDP.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from data import build_loader
from data.sampler import ResumableDistributedSampler, ShardedBatchSampler
from multigpu import checkpoint, preemption, rng
from multigpu.config import TrainConfig
from multigpu.distributed import Runtime, all_reduce_sum, gather_objects, setup
from multigpu.errors import TrainingStopped, UsageError
from multigpu.lr_scaling import describe_lr, scaled_lr
from multigpu.optim import build_optimizer, build_scheduler
from multigpu.preemption import StopRequest, fault_step
from multigpu.reporting import Reporter

__all__ = ["MultiGPUTrainer", "TrainConfig"]

# Config fields a resumed run must share with its checkpoint: another value means another model or data.
MUST_MATCH_ON_RESUME = ("model", "mode", "dataset", "image_shape", "num_classes", "optimizer")


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # the epoch being trained (== epochs when done)
    global_step: int = 0  # optimizer steps taken
    samples_in_epoch: int = 0  # global samples of `epoch` already trained on, in the sampler's order
    best_val_acc: float = -1.0


class MultiGPUTrainer:
    """Trains `model` on `train_dataset` with the devices and settings in `config`.

    `train_dataset`/`val_dataset` are map-style data sets of (input, target)
    pairs; `loss_fn` defaults to cross-entropy. Every rank constructs the trainer
    and calls `fit`; only rank 0 prints, logs and writes files.
    """

    def __init__(self, model: nn.Module, train_dataset: Dataset, val_dataset: Optional[Dataset] = None,
                 config: Optional[TrainConfig] = None, loss_fn: Optional[nn.Module] = None,
                 runtime: Optional[Runtime] = None):
        self.config = config = config or TrainConfig()
        self.runtime = rt = runtime or setup(config)
        self.device = rt.device
        self.report = Reporter(config, rt.is_main)
        self.amp_dtype = self._resolve_amp()
        self.autocast = (functools.partial(torch.autocast, self.device.type, dtype=self.amp_dtype)
                         if self.amp_dtype is not None else contextlib.nullcontext)
        self.model = self._prepare_model(model)  # the plain module: checkpoints and evaluation use it
        self.wrapped = self._wrap(self.model)  # what training calls: DDP, DataParallel or the module itself
        self.loss_fn = loss_fn or nn.CrossEntropyLoss()
        self.train_dataset, self.val_dataset = train_dataset, val_dataset

        # --- batches: --batch-size is per device, DataParallel splits its bigger batch over its GPUs ---
        self.loader_batch = config.batch_size * max(1, len(rt.dp_device_ids))
        self.effective_batch = config.batch_size * rt.devices_per_step * config.grad_accum_steps
        self.sampler = ResumableDistributedSampler(len(train_dataset), rt.rank, rt.world_size, config.seed)
        self.train_loader = build_loader(train_dataset, self.device, config.num_workers, config.seed + rt.rank,
                                         sampler=self.sampler, batch_size=self.loader_batch)
        samples_per_rank = len(self.sampler)
        self.steps_per_epoch = math.ceil(samples_per_rank / (self.loader_batch * config.grad_accum_steps))

        # --- optimisation ---
        self.lr = scaled_lr(config.lr, config.lr_scaling, self.effective_batch, config.lr_base_batch)
        self.optimizer = build_optimizer(self.model, config, self.lr)
        self.scheduler = build_scheduler(self.optimizer, config, self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.progress = Progress()
        self.metrics: dict[str, float] = {}

        # Dropout and augmentation differ per rank but repeat on a rerun (PITFALLS 20).
        rng.seed_all(config.seed + rt.rank)
        checkpoint.check_writable(config.save_dir)  # on every rank: all of them stop with the same line
        self.train_samples, self.train_seconds, self.applied_lr = 0, 0.0, self.lr
        self.last_saved: Optional[str] = None  # the checkpoint to fall back on (set by saves and resume)
        self._resume()
        self.stop = StopRequest()
        self.die_at_step = fault_step(rt.rank)
        self._reset_interval()
        self._print_plan()

    # ------------------------------------------------------------------ set-up
    def _resolve_amp(self) -> Optional[torch.dtype]:
        amp = self.config.amp
        if amp == "fp16" and self.device.type != "cuda":
            self.report.line("--amp fp16 needs a CUDA device; using bf16 autocast on the CPU instead")
            return torch.bfloat16
        if amp == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            self.report.line("--amp bf16 is not supported by this GPU; using fp16 with a GradScaler instead")
            return torch.float16
        return {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp]

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        """--sync-bn conversion (before the DDP wrap) and the small-batch BatchNorm warning (PITFALLS 18)."""
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

    def _print_plan(self) -> None:
        config, rt = self.config, self.runtime
        batch_rule = ("dp splits each batch of batch-size x GPUs over the GPUs" if rt.mode == "dp"
                      else "ddp: --batch-size is per process" if rt.mode == "ddp" else "one device")
        total_steps = config.epochs * self.steps_per_epoch
        self.report.line(rt.describe())
        self.report.line(f"batch {config.batch_size} per device x {rt.devices_per_step} devices x "
                         f"{config.grad_accum_steps} accumulation = {self.effective_batch} effective ({batch_rule})")
        self.report.line(f"{describe_lr(config, self.effective_batch)}; schedule {config.lr_schedule}, warm-up "
                         f"{round(config.warmup_epochs * self.steps_per_epoch)} steps, {self.steps_per_epoch} "
                         f"steps/epoch, {total_steps} steps; amp {self.amp_name}")

    @property
    def amp_name(self) -> str:
        return {None: "off", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.amp_dtype]

    # ------------------------------------------------------------------ training
    def fit(self) -> dict[str, Any]:
        """Train to `config.epochs`, evaluating and checkpointing after each epoch; return the final metrics."""
        config = self.config
        started = time.perf_counter()
        with self._signals_handled():
            while self.progress.epoch < config.epochs:
                if not self._run_epoch():
                    return self._stop_for_signal()
                self._end_epoch()
        summary = self._summary(wall_time=time.perf_counter() - started)
        best = f"best val acc {summary['best_val_acc']:.4f}" if self.val_dataset is not None else "no validation set"
        self.report.line(f"done: {best}, {summary['epochs']} epochs, wall time {summary['wall_time']:.1f}s, "
                         f"{summary['samples_per_sec']:.0f} samples/s "
                         f"({summary['samples_per_sec'] / self.runtime.devices_per_step:.0f} per device)")
        self.report.hparams(config, {k: v for k, v in summary.items() if k in ("val_acc", "val_loss", "best_val_acc")})
        self.report.close()
        return summary

    def _summary(self, **extra: Any) -> dict[str, Any]:
        """What fit returns: the last validation metrics, the best accuracy, progress and throughput."""
        return {**self.metrics, "best_val_acc": self.progress.best_val_acc, "epochs": self.progress.epoch,
                "global_step": self.progress.global_step,
                "samples_per_sec": self.train_samples / max(self.train_seconds, 1e-9), **extra}

    def _run_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a stop signal ended it early."""
        progress, config = self.progress, self.config
        self.sampler.start_at(progress.epoch, progress.samples_in_epoch)
        samples_left = len(self.sampler)  # this rank's, equal on every rank
        done_steps = self.steps_per_epoch - math.ceil(samples_left / (self.loader_batch * config.grad_accum_steps))
        self.report.start_epoch(progress.epoch, config.epochs, self.steps_per_epoch, done_steps)
        self.wrapped.train()
        self.interval_started = time.perf_counter()  # evaluation and saving are not training time
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
                self._save_step_checkpoint()
            if progress.global_step == self.die_at_step:
                preemption.kill_self()  # test-only fault injection: SIGKILL, like a preempted or OOM-killed worker
        self.report.end_epoch()
        return True

    def _train_step(self, batches: Iterator, window_samples: int) -> None:
        """One optimizer step over the micro-batches holding this rank's next `window_samples` samples.

        Each micro-batch's mean loss is weighted by its share of the window, so the
        gradient is the mean over the window whatever its size, including a short
        last window at the end of an epoch (PITFALLS 4). DDP all-reduces only in the
        last micro-batch's backward: the others run forward and backward in no_sync.
        """
        micro_batches = math.ceil(window_samples / self.loader_batch)
        for index in range(micro_batches):
            inputs, targets = next(batches)
            sync = index == micro_batches - 1
            with contextlib.nullcontext() if sync or self.runtime.mode != "ddp" else self.wrapped.no_sync():
                inputs = inputs.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
                with self.autocast():
                    loss = self.loss_fn(self.wrapped(inputs), targets)
                samples = targets.shape[0]
                share = loss if samples == window_samples else loss * (samples / window_samples)
                self.scaler.scale(share).backward()
            # Kept on the device: read only at the next sync point, never per step.
            self.interval_loss[self.interval_steps] += loss.detach().float() * samples
        self.interval_steps += 1
        self.interval_samples += window_samples
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        """unscale -> clip -> step -> update, in the only order that is right (PITFALLS 5)."""
        if self.config.clip_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        self.applied_lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, as TensorBoard shows it
        if self.scaler.is_enabled():
            scale_before = self.scaler._scale.clone()  # private, but get_scale() would sync the host
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skipped_steps += (self.scaler._scale < scale_before).to(torch.int64)  # a lowered scale = a skip
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
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

    def _reset_interval(self) -> None:
        self.interval_loss = torch.zeros(self.config.log_every + 1, device=self.device)
        self.interval_steps = 0
        self.interval_samples = 0
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.interval_started = time.perf_counter()

    def _sync_and_log(self) -> bool:
        """Reduce the interval's losses and flags over ranks (the one host sync), log, and say whether to stop.

        One all-reduce carries everything, so ranks always make the same decision:
        stop on a signal that reached any rank, stop on a non-finite loss (unless
        fp16's scaler handles it by skipping the step).
        """
        steps = self.interval_steps
        flags = torch.tensor([self.interval_samples, float(self.stop.requested)], device=self.device)
        values = all_reduce_sum(torch.cat([self.interval_loss[:steps], flags])).tolist()
        step_losses, (samples, stop_votes) = values[:steps], values[steps:]
        elapsed = time.perf_counter() - self.interval_started
        first_step = self.progress.global_step - steps + 1
        bad = [first_step + i for i, loss in enumerate(step_losses) if not math.isfinite(loss)]
        if bad and not self.scaler.is_enabled():
            raise TrainingStopped(f"loss became non-finite at step {bad[0]}; stopped without saving, last good "
                                  f"checkpoint kept: {self._newest_checkpoint_name()}")
        self.train_samples += samples
        self.train_seconds += elapsed
        loss = sum(step_losses) / samples if samples else float("nan")
        per_sec = samples / max(elapsed, 1e-9)
        step = self.progress.global_step
        self.report.scalars({"train/loss": loss, "train/lr": self.applied_lr, "train/samples_per_sec": per_sec,
                             "train/samples_per_sec_per_device": per_sec / self.runtime.devices_per_step}, step)
        if self.scaler.is_enabled():
            # This rank's own count, not a sum: DDP gives every rank the same gradients, so all skip alike.
            skipped, scale = int(self.skipped_steps), self.scaler.get_scale()
            self.report.scalars({"train/skipped_steps": skipped, "train/loss_scale": scale}, step)
            if skipped:
                self.report.line(f"steps {first_step}-{step}: the fp16 loss scaler skipped {skipped:.0f} step(s) "
                                 f"with inf/NaN gradients (weights unchanged there); loss scale now {scale:g}")
        self.report.advance(steps, {"loss": f"{loss:.4f}", "lr": f"{self.applied_lr:.3g}",
                                    "samples/s": f"{per_sec:.0f}"})
        if not self.config.progress:
            self.report.line(f"step {step}: loss {loss:.4f}, lr {self.applied_lr:.3g}, {per_sec:.0f} samples/s")
        self._reset_interval()
        return stop_votes > 0

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, dataset: Optional[Dataset] = None) -> dict[str, float]:
        """Loss and top-1 accuracy over every sample of `dataset` (default: the validation set) exactly once.

        The set is cut into the same batches for any world size and each rank
        evaluates its share of them without padding. Per-batch sums and counts go
        into one table that is all-reduced (each row comes from one rank, the rest
        add zeros) and summed in batch order, so 1, 2 or 3 ranks give bit-identical
        numbers (PITFALLS 1). The plain module runs, so no DDP collective happens
        per batch and uneven shards cannot hang (PITFALLS 3).
        """
        dataset = dataset if dataset is not None else self.val_dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset: none given and the trainer has no val_dataset")
        rt = self.runtime
        batches = ShardedBatchSampler(len(dataset), self.loader_batch, rt.rank, rt.world_size)
        loader = build_loader(dataset, self.device, self.config.num_workers, batch_sampler=batches)
        model = self.wrapped if rt.mode == "dp" else self.model
        was_training = model.training
        model.eval()
        per_sample_loss = self._per_sample_loss_fn()
        table = torch.zeros(batches.num_batches, 3, dtype=torch.float64, device=self.device)  # loss, correct, n
        for row, (inputs, targets) in zip(batches.batch_indices, loader):
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self.autocast():
                logits = model(inputs)
            losses = per_sample_loss(logits.float(), targets).double()
            table[row, 0] = losses.sum() if losses.dim() else losses * targets.shape[0]
            table[row, 1] = (logits.argmax(1) == targets).sum()
            table[row, 2] = targets.shape[0]
        model.train(was_training)
        loss_sum, correct, count = all_reduce_sum(table).sum(0).tolist()
        return {"loss": loss_sum / count, "acc": correct / count, "count": int(count)}

    def _per_sample_loss_fn(self) -> nn.Module:
        """The loss with reduction='none' where it has one, so evaluation sums per-sample losses."""
        if getattr(self.loss_fn, "reduction", None) == "mean":
            per_sample = copy.copy(self.loss_fn)
            per_sample.reduction = "none"
            return per_sample
        return self.loss_fn

    def _end_epoch(self) -> None:
        """Evaluate, log, move to the next epoch and save last.pt (and best.pt on a new best)."""
        progress = self.progress
        progress.epoch += 1
        progress.samples_in_epoch = 0
        if self.val_dataset is not None:
            result = self.evaluate()
            self.metrics = {"val_loss": result["loss"], "val_acc": result["acc"]}
            self.report.scalars({"val/loss": result["loss"], "val/acc": result["acc"]}, progress.global_step)
            self.report.line(f"epoch {progress.epoch}/{self.config.epochs}: val loss {result['loss']:.4f}, "
                             f"val acc {result['acc']:.4f} ({result['count']} samples)")
        is_best = self.metrics.get("val_acc", -1.0) > progress.best_val_acc
        if is_best:
            progress.best_val_acc = self.metrics["val_acc"]
        self.save_checkpoint("last.pt", also_as="best.pt" if is_best else None)
        self.report.flush()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, name: str, also_as: Optional[str] = None) -> str:
        """Write a checkpoint to <save-dir>/name (rank 0 writes; every rank must call this).

        The ranks' RNG states are gathered first; the success flag all-reduced at
        the end is also the barrier, so no rank runs ahead and a failed write (full
        disk, lost permission) stops every rank with one line instead of leaving
        them waiting; the previous checkpoint is untouched (PITFALLS 6, 7, 11).
        """
        rng_states = gather_objects(rng.rng_state(self.device))
        path = os.path.join(self.config.save_dir, name)
        error = ""
        if self.runtime.is_main:
            try:
                state = self._checkpoint_state(rng_states)
                checkpoint.atomic_save(state, path, before_rename=self._save_fault())
                if also_as:
                    checkpoint.atomic_save(state, os.path.join(self.config.save_dir, also_as))
            except OSError as failure:
                error = f"{failure.strerror or failure}"
        failed = all_reduce_sum(torch.tensor([float(bool(error))], device=self.device)).item()
        if failed:
            raise TrainingStopped(f"could not write checkpoint {path}: {error or 'failed on rank 0'}; stopped at step "
                                  f"{self.progress.global_step}, the previous checkpoint is kept: "
                                  f"{self._newest_checkpoint_name()}")
        self.last_saved = path
        return path

    def _save_fault(self) -> Optional[Callable[[], None]]:
        """Test-only: the fault injector's kill between writing and renaming, at its chosen step."""
        if preemption.save_fault_step(self.runtime.rank) == self.progress.global_step:
            return preemption.kill_self
        return None

    def _checkpoint_state(self, rng_states: list[Any]) -> dict[str, Any]:
        # Plain types only, so it loads with weights_only=True (PITFALLS 12). Saves happen between
        # optimizer steps only, so no gradient accumulation is ever in flight: nothing to save for it.
        model = getattr(self.model, "_orig_mod", self.model)  # torch.compile'd modules save plain keys
        return {
            "format_version": checkpoint.FORMAT_VERSION,
            "torch_version": str(torch.__version__),  # a str subclass that weights_only refuses
            "model": model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.progress.epoch,
            "global_step": self.progress.global_step,
            "samples_in_epoch": self.progress.samples_in_epoch,
            "sampler_seed": self.sampler.seed,
            "train_size": self.sampler.dataset_size,
            "best_val_acc": self.progress.best_val_acc,
            "metrics": dict(self.metrics),
            "world_size": self.runtime.world_size,
            "rng": rng_states,
            "config": self.config.to_dict(),
        }

    def _save_step_checkpoint(self) -> None:
        self.save_checkpoint(checkpoint.step_checkpoint_name(self.progress.global_step))
        if self.runtime.is_main:
            checkpoint.prune_step_checkpoints(self.config.save_dir, self.config.keep_last)

    def _newest_checkpoint_name(self) -> str:
        return self.last_saved or "none written by this run"

    def _resume(self) -> None:
        """Continue from --resume PATH, --resume auto, or the newest checkpoint after a torchrun restart."""
        if self.runtime.is_main:
            removed = checkpoint.remove_unfinished(self.config.save_dir)
            if removed:
                self.report.line(f"removed {len(removed)} unfinished save(s) of a killed run: {', '.join(removed)}")
        found = self._find_resume_checkpoint()
        # Every rank reads --save-dir itself: on nodes without a shared file system they could
        # silently continue from different points (or from scratch), so they must agree.
        steps = gather_objects(None if found is None else found[1]["global_step"])
        if len(set(steps)) > 1:
            raise checkpoint.CheckpointError(f"ranks found different checkpoints to resume (steps by rank: {steps}); "
                                             f"put --save-dir on storage that every node shares")
        if found is None:
            return
        path, state = found
        self._check_resumable(path, state)
        self._load_state(path, state)
        self.last_saved = path  # the checkpoint to fall back on until this run writes one
        self.report.line(f"resumed from {path}: epoch {self.progress.epoch + 1}, step {self.progress.global_step}, "
                         f"{self.progress.samples_in_epoch} samples into the epoch")
        self.report.purge_step = self.progress.global_step + 1

    def _find_resume_checkpoint(self) -> Optional[tuple[str, dict[str, Any]]]:
        """(path, state) to continue from, or None to start from scratch.

        After a torchrun restart the newest checkpoint in --save-dir wins, even
        over --resume PATH: it holds the work done since PATH was loaded (PITFALLS 15).
        """
        config = self.config
        restarted = preemption.restart_count() > 0
        if config.resume is None and not restarted:
            existing = checkpoint.resumable_files(config.save_dir)
            if existing:
                self.report.line(f"{config.save_dir} already holds checkpoints (newest {os.path.basename(existing[0])})"
                                 f"; this run starts from scratch and replaces them (--resume auto continues instead)")
            return None
        if restarted or config.resume == "auto":
            found = checkpoint.load_newest(config.save_dir, self.report.line)
            if found is not None:
                return found
            if config.resume in (None, "auto"):
                self.report.line(f"no checkpoint to resume in {config.save_dir}: starting from scratch")
                return None
            # restarted before this run saved anything: what --resume PATH named is still the newest
        return config.resume, checkpoint.load(config.resume)

    def _check_resumable(self, path: str, state: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model or data set in one line naming the field; log changed settings."""
        saved = state["config"]
        ours = {name: getattr(self.config, name) for name in MUST_MATCH_ON_RESUME}
        theirs = {name: saved.get(name) for name in MUST_MATCH_ON_RESUME}
        ours["model"], theirs["model"] = self.config.model_name, _model_name(saved)  # None means the default
        ours["train_size"], theirs["train_size"] = self.sampler.dataset_size, state.get("train_size")
        for name in ours:
            if theirs[name] is not None and ours[name] != theirs[name]:
                what = "a training set of" if name == "train_size" else f"--{name.replace('_', '-')}"
                raise checkpoint.CheckpointError(
                    f"{what} {ours[name]} contradicts checkpoint {path} (saved with {theirs[name]}): resume "
                    f"with the same value or start a new --save-dir")
        changed = [f"{k}: {saved.get(k)} -> {v}" for k, v in self.config.to_dict().items()
                   if k in saved and saved[k] != v and k != "resume"]
        if changed:
            keeps_seed = "; data order and random state continue the checkpoint's" if self.config.seed != \
                saved.get("seed", self.config.seed) else ""
            self.report.line(f"resuming with changed settings: {'; '.join(changed)}{keeps_seed}")

    def _load_state(self, path: str, state: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [repr(error)]
            raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this --model/--optimizer: "
                                             f"{lines[min(1, len(lines) - 1)][:300]}") from None
        if self.scaler.is_enabled() and not state["scaler"]:
            self.report.line("the checkpoint has no fp16 loss scale (saved without --amp fp16): starting a fresh one")
        else:
            self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(state["epoch"], state["global_step"], state["samples_in_epoch"],
                                 state["best_val_acc"])
        self.metrics = dict(state.get("metrics", {}))
        self.sampler.seed = state.get("sampler_seed", self.sampler.seed)  # the epoch's order must not change
        if state["world_size"] == self.runtime.world_size:
            rng.set_rng_state(state["rng"][self.runtime.rank], self.device)
        else:
            self.report.line(f"resuming {state['world_size']} ranks' checkpoint with {self.runtime.world_size}: "
                             f"model and optimizer continue and the data position is kept by global sample count, "
                             f"but results are not bit-identical to an uninterrupted run")

    # ------------------------------------------------------------------ signals and lost ranks
    @contextlib.contextmanager
    def _signals_handled(self) -> Iterator[None]:
        """During fit: SIGTERM/SIGINT become a clean stop at the next sync point, and a collective that
        fails because another rank died or hung becomes one line on every survivor (PeerLost, exit 1)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
            self.stop.install()
        try:
            yield
        except RuntimeError as error:
            if self.runtime.world_size == 1 or not preemption.is_peer_failure(error):
                raise
            rt = self.runtime
            line = preemption.lost_contact_line(rt.rank, rt.world_size, error, min(self.config.dist_timeout, 10.0))
            if line is None:  # every rank is alive: not a lost peer
                raise
            # Said here, while a signal only sets a flag: torchrun's SIGTERM to survivors cannot cut it off.
            print(line, file=sys.stderr, flush=True)
            raise preemption.PeerLost(line) from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _stop_for_signal(self) -> dict[str, Any]:
        path = self.save_checkpoint("last.pt")
        self.report.line(f"stopped by {self.stop.signal_name or 'a signal on another rank'} at step "
                         f"{self.progress.global_step}; checkpoint {path} written. Continue with the same "
                         f"command plus --resume auto")
        self.report.close()
        return self._summary(stopped=True)


def _model_name(saved_config: dict[str, Any]) -> Optional[str]:
    """The model a checkpoint's config built (its --model, or the default of its --mode)."""
    try:
        return TrainConfig.from_dict(saved_config).model_name
    except UsageError:  # a config this version cannot parse: compare what was written
        return saved_config.get("model")
