"""The trainer's checkpoint protocol: finding what to resume, checking it fits, saving on rank 0.

The trainer says what a checkpoint holds (`MultiGPUTrainer.state_dict`) and
how to load one into its live objects (`load_state_dict`); this module decides
which file, refuses one that belongs to another model or data set, and writes
atomically from rank 0 while every rank waits for the verdict
(MULTI_GPU_GUIDE.md, "Checkpoints, resume and preemption").
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from multigpu import checkpoint, faults, preemption
from multigpu.checkpoint import CheckpointError
from multigpu.config import TrainConfig
from multigpu.distributed import Runtime, all_reduce_sum, gather_objects
from multigpu.errors import TrainingStopped, UsageError
from multigpu.reporting import Reporter

# What a resumed run must share with its checkpoint: another value means another model, data or optimizer.
MUST_MATCH_ON_RESUME = ("model", "mode", "dataset", "image_shape", "num_classes", "train_size", "optimizer_class",
                        "scheduler_class")


class Checkpointer:
    """Where a run's checkpoints come from and go to. Every rank calls `find` and `save`."""

    def __init__(self, config: TrainConfig, runtime: Runtime, report: Reporter):
        self.config, self.runtime, self.report = config, runtime, report
        self.last_saved: Optional[str] = None  # the checkpoint to fall back on (set by saves and resume)

    # ------------------------------------------------------------------ resume
    def find(self) -> Optional[tuple[str, dict[str, Any]]]:
        """(path, state) to continue from, the same on every rank; None to start from scratch."""
        if self.runtime.is_main:
            removed = checkpoint.remove_unfinished(self.config.save_dir)
            if removed:
                self.report.line(f"removed {len(removed)} unfinished save(s) of a killed run: {', '.join(removed)}")
        found = self._find_here()
        # Every rank reads --save-dir itself: on nodes without a shared file system they could
        # silently continue from different points (or from scratch), so they must agree.
        steps = gather_objects(None if found is None else found[1]["global_step"])
        if len(set(steps)) > 1:
            raise CheckpointError(f"ranks found different checkpoints to resume (steps by rank: {steps}); "
                                  f"put --save-dir on storage that every node shares")
        if found is not None:
            self.last_saved = found[0]
        return found

    def _find_here(self) -> Optional[tuple[str, dict[str, Any]]]:
        """After a torchrun restart the newest checkpoint in --save-dir wins, even over --resume PATH:
        it holds the work done since PATH was loaded (MULTI_GPU_GUIDE.md, "Elastic restarts")."""
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

    def check(self, path: str, state: dict[str, Any], ours: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model, data set or optimizer in one line naming the field;
        log the settings that changed."""
        theirs = {**state["config"], **{key: state.get(key) for key in ("train_size", "optimizer_class",
                                                                           "scheduler_class")}}
        theirs["model"] = _model_name(state["config"])
        for name in MUST_MATCH_ON_RESUME:
            if theirs.get(name) is not None and ours[name] != theirs[name]:
                what = {"train_size": "a training set of", "optimizer_class": "optimizer",
                        "scheduler_class": "LR scheduler"}.get(name, f"--{name.replace('_', '-')}")
                raise CheckpointError(f"{what} {ours[name]} contradicts checkpoint {path} (saved with {theirs[name]}): "
                                      f"resume with the same one or start a new --save-dir")
        saved = state["config"]
        changed = [f"{key}: {saved.get(key)} -> {value}" for key, value in self.config.to_dict().items()
                   if key in saved and saved[key] != value and key != "resume"]
        if changed:
            keeps_seed = "; data order and random state continue the checkpoint's" if self.config.seed != \
                saved.get("seed", self.config.seed) else ""
            self.report.line(f"resuming with changed settings: {'; '.join(changed)}{keeps_seed}")

    # ------------------------------------------------------------------ save
    def save(self, state: dict[str, Any], name: str, also_as: Optional[str] = None) -> str:
        """Write `state` to <save-dir>/name from rank 0; every rank must call this.

        The success flag all-reduced at the end is also the barrier, so no rank
        runs ahead, and a failed write (full disk, lost permission) stops every
        rank with one line while the previous checkpoint stays untouched.
        """
        path = os.path.join(self.config.save_dir, name)
        error = ""
        if self.runtime.is_main:
            try:
                checkpoint.atomic_save(state, path, before_rename=self._save_fault(state["global_step"]))
                if also_as:
                    checkpoint.atomic_save(state, os.path.join(self.config.save_dir, also_as))
            except OSError as failure:
                error = f"{failure.strerror or failure}"
        failed = all_reduce_sum(torch.tensor([float(bool(error))], device=self.runtime.device)).item()
        if failed:
            raise TrainingStopped(f"could not write checkpoint {path}: {error or 'failed on rank 0'}; stopped at step "
                                  f"{state['global_step']}, the previous checkpoint is kept: {self.newest()}")
        self.last_saved = path
        return path

    def save_step(self, state: dict[str, Any]) -> None:
        """A step checkpoint, then the oldest ones beyond --keep-last go (only once the new one is in place)."""
        self.save(state, checkpoint.step_checkpoint_name(state["global_step"]))
        if self.runtime.is_main:
            checkpoint.prune_step_checkpoints(self.config.save_dir, self.config.keep_last)

    def newest(self) -> str:
        """The checkpoint a user can fall back on, for error messages."""
        return self.last_saved or "none written by this run"

    def _save_fault(self, step: int) -> Any:
        """Test-only: the fault injector's kill between writing and renaming, at its chosen step."""
        return faults.kill_self if faults.save_fault_step(self.runtime.rank) == step else None


def _model_name(saved_config: dict[str, Any]) -> Optional[str]:
    """The model a checkpoint's config built (its --model, or the default of its --mode)."""
    try:
        return TrainConfig.from_dict(saved_config).model_name
    except UsageError:  # a config this version cannot parse: compare what was written
        return saved_config.get("model")
