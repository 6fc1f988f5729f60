"""What a MultiGPUTrainer's checkpoint holds beyond its parts' own state, and the words of a resume.

The checkpointer (multigpu/checkpoints/checkpointer.py) saves and loads a dict of
stateful things and knows no trainer; the trainer hands it that dict. Here are the
things of that dict that are the run's rather than a part's (where training stands,
what it trained with), the save rank 0 makes alone from its replica when a peer is
lost, and the lines a resume prints.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Protocol

import torch

from multigpu.checkpoints import checkpoint
from multigpu.checkpoints.checkpointer import PROGRESS, Checkpointer
from multigpu.checkpoints.stateful import ModelState, OptimizerState, RngState, Saved, ScalerState
from multigpu.checkpoints.weights import ModelInfo
from multigpu.errors import CheckpointError, UsageError
from multigpu.loop.metrics import Monitor
from multigpu.loop.optim import group_settings, keep_run_settings, schedule_rule
from multigpu.loop.progress import Progress
from multigpu.parallel.lora import Adapters
from multigpu.resilience.heartbeat import BACKWARD, BEAT, CONSISTENT_PHASES


class Run(Protocol):
    """What the run's own checkpoint state reads of the trainer (MultiGPUTrainer has it)."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    scheduler_interval: str
    progress: Progress
    steps_per_epoch: int
    sampler: Any
    monitor: Monitor
    metrics: dict[str, float]
    report: Any  # the Reporter: where the run started (its learning_state)


class ProgressState:
    """Where training stands and what it trained with, as a checkpoint's top-level keys (the checkpointer's
    PROGRESS): loading it moves the run's progress, monitor, metrics and data order to the checkpoint's."""

    def __init__(self, run: Run):
        self.run = run

    def state_dict(self) -> dict[str, Any]:
        run = self.run
        return {
            "optimizer_class": type(run.optimizer).__name__,
            "scheduler_class": type(run.scheduler).__name__,
            "scheduler_interval": run.scheduler_interval,
            **dataclasses.asdict(run.progress),  # epoch, global_step, samples_in_epoch, best_value, evaluated
            "steps_per_epoch": run.steps_per_epoch,
            "sampler_seed": run.sampler.seed,
            "train_size": run.sampler.dataset_size,
            "monitor": run.monitor.name,
            "metrics": dict(run.metrics),
            # The run's first losses, which the end's divergence check compares with after a resume too.
            "learning": run.report.learning_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run = self.run
        same_monitor = state["monitor"] is None or run.monitor.name in (None, state["monitor"])
        run.monitor.name = run.monitor.name or state["monitor"]
        run.progress = Progress(
            state["epoch"],
            state["global_step"],
            state["samples_in_epoch"],
            state["best_value"] if same_monitor else None,
            state.get("evaluated", True),
        )
        run.metrics = dict(state.get("metrics", {}))
        run.report.load_learning_state(state.get("learning"))  # absent from checkpoints before it was kept
        run.sampler.seed = state.get("sampler_seed", run.sampler.seed)  # the epoch's order must not change


def refuse_another_fit(config: Any) -> UsageError:
    """The refusal of a fit() of a trainer that already trained its run to the end."""
    return UsageError(
        f"fit() already trained this run to its {config.epochs} epochs (epochs is the total, not "
        f"epochs per call): nothing to train; to train further, build a trainer with more epochs and "
        f"resume='auto' (it continues from {config.save_dir})"
    )


def refuse_replaced_optimizer() -> UsageError:
    """The refusal of a resume after trainer.optimizer was replaced: the scheduler drives the old one."""
    return UsageError(
        "trainer.optimizer was replaced after construction, but the LR scheduler still drives the "
        "old one: pass optimizer=... (and scheduler=...) to MultiGPUTrainer instead"
    )


def contents(run: Any, known_rng: Saved | None) -> dict[str, Any]:
    """What a checkpoint of `run` (the trainer) holds, each thing with state_dict()/load_state_dict(), in the
    order the checkpointer saves and loads them. `known_rng`: every rank's RNG states known without a
    collective (rank 0's save alone); else gathered."""
    adapters = run.adapters  # --lora-r: the adapters alone, their base recorded by its fingerprint
    semi_sync = getattr(getattr(run, "replicas", None), "semi_sync", None)  # --semi-sync's own state
    return {
        **({"adapters": adapters} if adapters is not None else {}),
        "model": ModelState(run.model, trainable_only=adapters is not None),
        "model_info": ModelInfo(run.model),  # ties, a transformers config
        "optimizer": OptimizerState(run.model, run.optimizer),
        "scheduler": run.scheduler,
        "scaler": ScalerState(run.scaler, run.report.line),
        PROGRESS: ProgressState(run),
        "callbacks": run.callbacks,
        "rng": known_rng or run.rng_state,
        "trackers": run.report.trackers,  # their runs' ids
        **({"stream_state": run.stream} if run.stream is not None else {}),  # data/streaming.py
        **({"autotune": run.autotune} if run.autotune is not None else {}),  # its choice, reused on resume
        # the outer optimizer, the weights of the last sync, the place in the window
        **({"semi_sync": semi_sync} if semi_sync is not None else {}),
    }


def identity(config: Any, sampler: Any, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint (the checkpointer's MUST_MATCH_ON_RESUME): another
    value means another model, data or optimizer."""
    return {
        **{name: getattr(config, name) for name in ("mode", "dataset", "image_shape", "num_classes")},
        "model": config.model_name,
        "train_size": sampler.dataset_size,
        "optimizer_class": type(optimizer).__name__,
        "scheduler_class": type(scheduler).__name__,
    }


def check_adapters(path: str, saved: dict[str, Any] | None, adapters: Adapters | None) -> None:
    """CheckpointError where the checkpoint's LoRA adapters do not fit this run: one of them trains adapters
    and the other every weight, or the adapters were trained on another base (its fingerprint differs)."""
    if saved is None and adapters is None:
        return
    if adapters is None:
        assert saved is not None  # returned above otherwise
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters (r {saved['rank']} on {saved['layers']} layers) and this run "
            f"trains every weight: resume with the run's LoRA flags (or none, to take them from the checkpoint)"
        )
    if saved is None:
        raise CheckpointError(
            f"checkpoint {path} trained every weight and this run trains LoRA adapters: start from its weights "
            f"with --init-from {path} in a new --save-dir, or drop --lora-r to resume it"
        )
    if saved["fingerprint"] != adapters.fingerprint:
        theirs = saved["base"] or "the model its run built"
        ours = adapters.base or "the model built"
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters of another base model ({theirs}, fingerprint "
            f"{saved['fingerprint']}) than this run's ({ours}, fingerprint {adapters.fingerprint}): resume with "
            f"the base it was trained on, or start a new --save-dir"
        )


def already_complete(path: str, progress: Progress, monitor: str | None, has_validation: bool) -> str:
    """The one line of a resume whose checkpoint has trained and evaluated every epoch (a checkpoint at
    --max-steps is refused before: multigpu/checkpoints/checkpointer.py): what it reached, and how to train
    further."""
    result = (
        f"best {monitor} {progress.best_value:.4f}"
        if monitor and progress.best_value is not None
        else "no validation set"
        if not has_validation
        else "no finite validation metric"
    )
    return (
        f"run in {os.path.dirname(os.path.normpath(path)) or '.'} is already complete: {progress.epoch} "
        f"epochs, {result}; nothing to train (raise --epochs to train further)"
    )


def max_steps_end(config: Any, steps_per_epoch: int, progress: Progress, ahead: int) -> str | None:
    """How --max-steps ends the built-in schedule of a run resumed `ahead` of its optimizer steps (see load), in
    words; None where nothing moved, or --max-steps does not end the run (not given, or --epochs ends it first)."""
    if not ahead or config.planned_steps(steps_per_epoch, ahead) == config.epochs * steps_per_epoch:
        return None
    left = config.max_steps - progress.global_step
    return f"ends with the {left} step{'s' if left != 1 else ''} --max-steps {config.max_steps} leaves"


def other_world_size(
    saved: int, now: int, builtin_schedule: bool, scheduler_interval: str, max_steps_end: str | None = None
) -> str:
    """The line of a resume at another world size: the data position is kept in global samples; the built-in
    schedule was moved to the same point of training in this run's steps (`max_steps_end`: and where
    --max-steps ends it; docs/checkpoints.md, "Resume on another world size")."""
    if builtin_schedule:
        schedule = "the LR schedule continues at the same point in samples" + (
            f" and {max_steps_end}" if max_steps_end else ""
        )
    elif scheduler_interval == "step":
        schedule = (
            "your per-step scheduler continues its own step count (it was built for the old steps/epoch)"
        )
    else:
        schedule = "your per-epoch scheduler continues"
    return (
        f"resuming {saved} ranks' checkpoint with {now}: model and optimizer continue, the data position is "
        f"kept by global sample count and {schedule}, but results are not bit-identical to an uninterrupted run"
    )


def buffer_versions(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Each buffer of `model` and how often it was written (its version counter): a forward that updates its
    buffers (BatchNorm's running statistics) changes them."""
    return [(id(buffer), buffer._version) for buffer in model.buffers()]


def training_starts(rng_state: RngState, model: torch.nn.Module) -> list[tuple[int, int]]:
    """As training starts: every rank's random state gathered, and the model's buffers' versions, what rank 0's
    replica needs to save alone when it loses a peer (`save_from_replica`)."""
    rng_state.state_dict()
    return buffer_versions(model)


@dataclasses.dataclass
class Replica:
    """What rank 0 knows, alone, of the run it may save from its own replica."""

    checkpointer: Checkpointer
    sharded: bool  # fsdp: rank 0 holds a shard only
    streaming: bool  # a stream's position is every rank's count
    step: int  # the last completed optimizer step
    rng_state: RngState
    model: torch.nn.Module
    buffers_at_start: list[tuple[int, int]]  # buffer_versions when training started


class ReplicaRun(Protocol):
    """What rank 0's save from its own replica reads of the trainer (MultiGPUTrainer has it)."""

    checkpointer: Checkpointer
    config: Any
    runtime: Any
    stream: Any
    progress: Progress
    rng_state: RngState
    model: torch.nn.Module
    buffers_at_start: list[tuple[int, int]]

    def stateful(self, known_rng: Saved | None = None) -> dict[str, Any]: ...


class ReplicaSave:
    """Rank 0's save of the last completed step from its own replica, without a collective: what the hang
    watchdog calls when it decides, and what a lost peer triggers (`after_losing_a_peer`)."""

    def __init__(self, run: ReplicaRun):
        self.run = run

    def __call__(self, verdict: dict[str, Any]) -> str:
        run = self.run
        replica = Replica(
            run.checkpointer,
            run.runtime.mode == "fsdp",
            run.stream is not None,
            run.progress.global_step,
            run.rng_state,
            run.model,
            run.buffers_at_start,
        )
        return save_from_replica(replica, verdict["stuck"], run.stateful)

    def after_losing_a_peer(self) -> None:
        """A peer died or hung mid-run: rank 0 says where the last completed step is kept; the hang watchdog,
        when it is ending the run, saves and says it itself."""
        if self.run.runtime.rank == 0 and not BEAT.hang_declared:
            print(f"rank 0: {self({'stuck': {}})}", file=sys.stderr, flush=True)


def save_from_replica(
    replica: Replica, stuck: dict[int, Any], stateful: Callable[[Saved], dict[str, Any]]
) -> str:
    """Rank 0: a checkpoint of the last completed optimizer step from its own replica, without a collective
    (a lost peer, a hang); the line that says where it is, or why none was written.

    Written only where it is exactly what every rank would have saved at that step (docs/hangs.md, "When
    a run hangs"): not when that step is saved already, not when random numbers were drawn since every rank's
    generators were last gathered (then the other ranks' are unknown, and rank 0's own may be the next step's),
    and not when the next step's forward has already updated the model's buffers (BatchNorm's statistics)."""
    checkpointer, step = replica.checkpointer, replica.step
    newest = checkpointer.newest()
    if replica.sharded:
        return (
            "no checkpoint written: under fsdp the last complete sharded checkpoint stays the resume point: "
            f"{newest}"
        )
    if replica.streaming:
        return (
            f"no checkpoint written: a stream's position needs every rank; the newest checkpoint is {newest}"
        )
    if 0 in stuck:
        return f"no checkpoint written: rank 0 itself is stuck; the newest checkpoint is {newest}"
    if BEAT.phase not in CONSISTENT_PHASES:  # inside optimizer.step: the weights may be half updated
        return (
            f"no checkpoint written: rank 0 was inside an optimizer step; the newest checkpoint is {newest}"
        )
    if step == 0:
        return "no checkpoint written: no optimizer step was completed yet"
    if step == checkpointer.saved_step:
        return f"no checkpoint written: step {step} is saved already: {newest}"
    known_rng = replica.rng_state.still_gathered()
    if known_rng is None:
        return (
            f"no checkpoint written: random numbers were drawn (dropout, random augmentation) since every rank's "
            f"generators were last gathered, and rank 0 knows only its own; the newest checkpoint is {newest}"
        )
    # In backward the next step's forward has run; a forward that writes buffers writes them each time. (A peer
    # lost at the forward's start, in DDP's broadcast of the buffers, has left them as the last step did.)
    if BEAT.phase == BACKWARD and buffer_versions(replica.model) != replica.buffers_at_start:
        return (
            f"no checkpoint written: step {step + 1}'s forward had already updated the model's buffers (BatchNorm "
            f"statistics) on rank 0; the newest checkpoint is {newest}"
        )
    path = checkpoint.step_checkpoint_path(checkpointer.save_dir, step, checkpointer.suffix)
    try:
        checkpoint.atomic_save(checkpointer.state_of(stateful(known_rng)), path)
    except Exception as error:  # a failed save must not keep the report from being written
        return (
            f"no checkpoint written: saving step {step} failed ({error}); the newest checkpoint is {newest}"
        )
    return (
        f"checkpoint of the last completed step ({step}) written from rank 0's replica: {path}; continue with "
        f"the same command plus --resume auto"
    )


class Resumable(Protocol):
    """What a resume reads and sets of the trainer (MultiGPUTrainer has it)."""

    config: Any
    adapters: Adapters | None
    runtime: Any
    checkpointer: Checkpointer
    sampler: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scheduler_interval: str
    builtin_optimizer: bool
    builtin_schedule: bool
    steps_per_epoch: int
    progress: Progress
    monitor: Monitor
    val_dataset: Any
    report: Any

    def stateful(self, known_rng: Saved | None = None) -> dict[str, Any]: ...

    def steps_done_in_epoch(self) -> int: ...


def load(run: Resumable, saved: dict[str, Any], path: str, things: dict[str, Any] | None = None) -> None:
    """A checkpoint (a file's state, or a sharded folder's at `path`) into the live run; this run's LR and
    weight decay hold from the next step, the schedule continuing at the same point of training in this run's
    steps (docs/sweeps.md, "Resume"). `things`: what `saved` holds, when not the whole of `run.stateful()`."""
    built = group_settings(run.optimizer)  # this run's LR and weight decay, which the checkpoint's replace
    run.checkpointer.load_into(things or run.stateful(), saved, path)
    place = (
        run.progress.epoch * run.steps_per_epoch + run.steps_done_in_epoch()
    )  # the samples seen, in our steps
    ahead = (
        place - run.progress.global_step
    )  # not 0 after another world size or batch: --max-steps ends that far on
    keep_run_settings(
        run.optimizer,
        run.scheduler,
        built,
        place,
        run.builtin_schedule,
        run.builtin_optimizer,
        schedule_rule(run.config, run.steps_per_epoch, ahead),
    )
    if saved["world_size"] != run.runtime.data_ranks:  # the data's shares, over every replica group too
        run.report.line(
            other_world_size(
                saved["world_size"],
                run.runtime.data_ranks,
                run.builtin_schedule,
                run.scheduler_interval,
                max_steps_end(run.config, run.steps_per_epoch, run.progress, ahead),
            )
        )


def resume(run: Resumable) -> bool:
    """--resume PATH, --resume auto's newest good checkpoint, or after a torchrun restart the newest one,
    checked against this run and loaded into it; True if one was loaded. A finished run's says so in one line."""
    found = run.checkpointer.find()
    if found is None:
        return False
    path, saved = found
    run.checkpointer.check(path, saved, identity(run.config, run.sampler, run.optimizer, run.scheduler))
    check_adapters(path, saved.get("adapters"), run.adapters)
    load(run, saved, path)
    progress = run.progress
    if progress.finished(run.config.epochs, run.config.max_steps):
        run.report.line(already_complete(path, progress, run.monitor.name, run.val_dataset is not None))
        return True
    run.report.line(
        f"resumed from {path}: epoch {progress.epoch + 1}, step {progress.global_step}, "
        f"{progress.samples_in_epoch} samples into the epoch"
    )
    run.report.purge_step = progress.global_step + 1
    return True


def stop_for_signal(run: Any) -> None:
    """A SIGTERM or Ctrl-C ended the run (the trainer): every rank saves last, unless --overwrite's previous run
    is still set aside (then that comes back instead), and rank 0 says how to continue."""
    stopped = (
        f"stopped by {run.stop.signal_name or 'a signal on another rank'} at step {run.progress.global_step}"
    )
    if run.checkpointer.keeps_previous_run:
        run.report.line(f"{stopped}, before this run's first checkpoint: nothing of it is saved")
    else:
        run.report.line(
            f"{stopped}; checkpoint {run.save_checkpoint('last.pt')} written. Continue with the same "
            f"command plus --resume auto"
        )
