"""The trainer's checkpoint protocol: owning the save-dir, what a checkpoint holds, finding what to resume,
checking that it fits, loading it into the live objects, and saving from rank 0.

Every rank calls every method here; only rank 0 writes files, and every
decision is taken on rank 0 and shared, so ranks never disagree
(docs/checkpoints.md, "Checkpoints, resume and preemption").
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Protocol

import torch

from multigpu import safe_files
from multigpu.checkpoints import checkpoint, run_folders, run_settings, savedir, sharded
from multigpu.checkpoints.checkpoint import CheckpointError
from multigpu.config import TrainConfig
from multigpu.errors import TrainingStopped, UsageError
from multigpu.parallel.distributed import Runtime, all_reduce_sum, gather_objects
from multigpu.resilience import faults, preemption

# The thing whose state sits at the top of a one-file checkpoint (epoch, global_step, ...), not under its name.
PROGRESS = "progress"
# How long a process ending at once waits for a save in progress before it leaves --overwrite's copy aside.
PUT_BACK_WAIT_SECONDS = 5.0
# What a resumed run must share with its checkpoint: another value means another model, data or optimizer.
MUST_MATCH_ON_RESUME = (
    "model",
    "mode",
    "dataset",
    "image_shape",
    "num_classes",
    "train_size",
    "optimizer_class",
    "scheduler_class",
)


class Says(Protocol):
    """Where the checkpointer's lines go: the run's rank-0 reporter (multigpu/monitoring/reporting.py)."""

    def line(self, text: str) -> None: ...


class Checkpointer:
    """Where a run's checkpoints come from and go to."""

    def __init__(self, config: TrainConfig, runtime: Runtime, report: Says):
        self.config, self.runtime, self.report = config, runtime, report
        self.save_dir: str = config.save_dir  # type: ignore[assignment]  # chosen by run_folders.run_folder
        self.lock = savedir.SaveDirLock(self.save_dir)
        self.last_saved: str | None = None  # the checkpoint to fall back on (set by saves and resume)
        self.saved_step: int | None = None  # its optimizer step
        # --overwrite's copy of the previous run, known on every rank (rank 0 moves the files): dropped at this
        # run's first save, put back if the run ends before it.
        self.set_aside: str | None = None
        # Held while rank 0 writes over or drops that copy, and while a process ending at once puts it back
        # (`put_back_at_once`, from the stop request's thread): the two never interleave.
        self.moving = threading.Lock()
        # Set by the first fit()'s claim: the checkpoints there are then this trainer's own run, which a later
        # fit() of the same trainer continues, not another run's to refuse or set aside.
        self.claimed = False
        self.sharded = (
            config.sharded_checkpoints()
        )  # the writer: one file from rank 0, or every rank's shards
        self.suffix = (
            ".safetensors" if config.checkpoint_format == "safetensors" else ".pt"
        )  # one file's kind
        self.background = sharded.AsyncSaves()  # --async-checkpoint's save in flight

    @classmethod
    def at_start(
        cls,
        config: TrainConfig,
        runtime: Runtime,
        report: Says,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        total_steps: float,
    ) -> Checkpointer:
        """The run's checkpointer, its save-dir (and --log-dir) checked at start, before anything is trained:
        writable, with room for what this run keeps."""
        made = cls(config, runtime, report)
        made.check_folders(
            checkpoint.estimate_size(model, optimizer, model_copies=2 if config.ema_decay else 1), total_steps
        )
        return made

    @property
    def keeps_previous_run(self) -> bool:
        """True between an --overwrite start and this run's first checkpoint: its end puts the old files back."""
        return self.set_aside is not None

    # ------------------------------------------------------------------ owning the save-dir
    def check_folders(self, checkpoint_bytes: int, total_steps: float) -> None:
        """At start, before anything is trained: the save-dir and --log-dir take real bytes on every rank, and
        rank 0's save-dir has room for the checkpoints this run keeps (`total_steps` long, each about
        `checkpoint_bytes`), else refused unless --allow-low-disk. Every rank gets the same verdict."""
        refusal = None
        try:
            checkpoint.check_writable(self.save_dir)
            shortfall = self._room_shortfall(checkpoint_bytes, total_steps) if self.runtime.is_main else None
            if shortfall and not self.config.allow_low_disk:
                raise UsageError(
                    f"--save-dir {self.save_dir} {shortfall[0]}: {shortfall[1]}, or pass "
                    f"--allow-low-disk to start anyway"
                )
            if shortfall:
                self.report.line(
                    f"warning: --save-dir {self.save_dir} {shortfall[0]}; starting anyway "
                    f"(--allow-low-disk): a save that does not fit stops the run"
                )
            checkpoint.check_writable(
                self.config.tensorboard_dir,
                flag="--log-dir" if self.config.log_dir else "--save-dir",
                inside=self.config.tensorboard_root,
            )
        except UsageError as error:
            refusal = str(error)
        refusal = next(filter(None, gather_objects(refusal)), None)
        if refusal:
            raise UsageError(refusal)

    def _room_shortfall(self, checkpoint_bytes: int, total_steps: float) -> tuple[str, str] | None:
        """Rank 0: why the checkpoints will not fit in the save-dir and what would make them, or None.

        At the most, a run keeps last.pt, best.pt and --keep-last step checkpoints
        while it writes the next one beside them (an atomic save replaces a file
        only once the new one is complete). Checkpoints already there are counted
        as room: a resume replaces them, and --overwrite's set-aside copy goes at
        the first save, which writes last.pt and best.pt beside it.
        """
        config = self.config
        # A whole number: total_steps is math.inf only for a stream without a length, where keep_last is the least.
        steps = (
            int(min(config.keep_last, total_steps // config.save_every_steps))
            if config.save_every_steps
            else 0
        )
        files = 2 + steps + 1
        there = sum(checkpoint.size_of(path) for path in run_folders.checkpoint_files(self.save_dir))
        need = max(files * checkpoint_bytes - there, (2 if config.overwrite else 1) * checkpoint_bytes)
        what = (
            f"last.pt, best.pt, {f'{steps} step checkpoint(s), ' if steps else ''}and the one being written, "
            f"about {checkpoint.megabytes(checkpoint_bytes)} each"
            f"{f', less the {checkpoint.megabytes(there)} of the checkpoints there' if there else ''}"
        )
        return checkpoint.room_shortfall(self.save_dir, need, checkpoint_bytes, what)

    def claim(self) -> None:
        """Own the save-dir while training, before anything is written there.

        Rank 0 takes the lock (a second run in the same folder is refused; one
        left by a dead run is taken over with one line), puts back what an
        --overwrite run killed before its first save set aside, and a fresh run
        never replaces another run's checkpoints: refused, or with --overwrite
        kept aside until this run's first save. Every rank learns the verdict.
        """
        refusal: str | None = None
        lines: list[str] = []
        if self.runtime.is_main and not self.lock.held:
            try:
                self.lock.acquire(lines.append)
                restarted_overwrite = preemption.restart_count() > 0 and self.config.overwrite
                self.set_aside, repaired = run_folders.leftovers(self.save_dir, adopt=restarted_overwrite)
                lines += repaired
                refusal = self._refuse_fresh_start_over_checkpoints()
            except UsageError as error:
                refusal = str(error)
        refusal, self.set_aside = gather_objects((refusal, self.set_aside))[0]
        for line in lines:
            self.report.line(line)
        if refusal:
            self.release()
            raise UsageError(refusal)
        self.claimed = True

    def _refuse_fresh_start_over_checkpoints(self) -> str | None:
        """Rank 0: the refusal of a run that would replace the checkpoints in the save-dir, or None (after
        --overwrite's set-aside)."""
        config = self.config
        existing = run_folders.resumable_files(self.save_dir) + run_folders.checkpoint_files(self.save_dir)
        if preemption.restart_count() > 0 or not existing or self.claimed:
            return None
        if (config.resume is not None or config.fault_tolerance) and not config.overwrite:
            return None  # it continues the run here, or (--resume PATH from elsewhere) replaces its files as it saves
        if config.resume is not None and self._resumes_from_save_dir():
            return (
                f"--resume {config.resume} continues the run in --save-dir {self.save_dir}, which --overwrite "
                f"would set aside: give one of them"
            )
        if not config.overwrite:
            return (
                f"--save-dir {self.save_dir} holds another run's checkpoints "
                f"({os.path.basename(existing[0])}): continue it with --resume auto, choose another --save-dir, "
                f"or start afresh with --overwrite (the old files are kept aside until this run saves)"
            )
        self.set_aside = run_folders.set_aside(self.save_dir, extra=(os.path.join(self.save_dir, "tb"),))
        self.report.line(
            f"--overwrite: the previous run's files are kept in {self.set_aside} until this run's "
            f"first checkpoint is written, and put back if it ends before"
        )
        return None

    def _resumes_from_save_dir(self) -> bool:
        """Whether --resume names the save-dir's own run: auto, the save-dir itself, or a file in it."""
        resume = self.config.resume
        assert resume is not None  # asked only where --resume is given
        here = os.path.realpath(self.save_dir)
        return resume == "auto" or here in (
            os.path.realpath(resume),
            os.path.dirname(os.path.realpath(resume)),
        )

    def release(self) -> None:
        """Give the save-dir up (rank 0 holds the lock; a no-op elsewhere and when not held). A run that ends
        before its first checkpoint puts --overwrite's set-aside files back first, unless torchrun will restart
        it (its next attempt continues afresh with them still aside)."""
        try:
            self.finish_saves()  # a background save is put in place before the run ends
        finally:
            self._release_save_dir()

    def _release_save_dir(self) -> None:
        folder, self.set_aside = self.set_aside, None
        if folder and self.runtime.is_main:
            if preemption.restarts_left() > 0:
                self.report.line(
                    f"--overwrite: the previous run's files stay in {folder} while torchrun may restart "
                    f"this run; a run started later in --save-dir {self.save_dir} puts them back"
                )
            else:
                run_folders.put_back(folder)
                self.report.line(
                    f"--overwrite: this run ended before its first checkpoint, so the previous run's "
                    f"files are back in --save-dir {self.save_dir} (this run's own logs there removed)"
                )
        if self.lock.held:
            self.lock.release()

    # ------------------------------------------------------------------ resume
    def find(self) -> tuple[str, dict[str, Any]] | None:
        """(path, state) to continue from, the same on every rank; None to start from scratch."""
        # With --fault-tolerance another replica group may be saving right now: its temporary file is no leftover.
        if self.runtime.is_main and not self.config.fault_tolerance:
            removed = checkpoint.remove_unfinished(self.save_dir)
            if removed:
                self.report.line(
                    f"removed {len(removed)} unfinished save(s) of a killed run: {', '.join(removed)}"
                )
        found = self._find_here()
        # Every rank reads --save-dir itself: on nodes without a shared file system they could
        # silently continue from different points (or from scratch), so they must agree.
        steps = gather_objects(None if found is None else found[1]["global_step"])
        if len(set(steps)) > 1:
            raise CheckpointError(
                f"ranks found different checkpoints to resume (steps by rank: {steps}); "
                f"put --save-dir on storage that every node shares"
            )
        if found is not None:
            self.last_saved, self.saved_step = found[0], found[1]["global_step"]
        return found

    def _find_here(self) -> tuple[str, dict[str, Any]] | None:
        """After a torchrun restart the newest checkpoint in --save-dir wins, even over --resume PATH:
        it holds the work done since PATH was loaded (docs/checkpoints.md, "Elastic restarts under torchrun").
        With --fault-tolerance a replica group started again continues the run as --resume auto does, when no live
        peer healed it (docs/fault-tolerance.md)."""
        config = self.config
        restarted = preemption.restart_count() > 0
        resume = config.resume or ("auto" if config.fault_tolerance else None)
        if resume is None and not restarted:
            return None
        if restarted or resume == "auto":
            found = self._newest_in(self.save_dir, "--resume auto")
            if found is not None:
                return found
            if resume in (None, "auto"):
                self.report.line(f"no checkpoint to resume in {self.save_dir}: starting from scratch")
                return None
            # restarted before this run saved anything: what --resume PATH named is still the newest
        assert config.resume is not None  # without --resume, returned above
        if os.path.isdir(config.resume) and not checkpoint.is_sharded(config.resume):
            found = self._newest_in(config.resume, f"--resume {config.resume}")
            if found is None:
                raise CheckpointError(
                    f"--resume {config.resume} is a folder without checkpoints (last.pt, step-*.pt) "
                    f"or sharded ones (last/): name a checkpoint file, or a folder that holds one"
                )
            return found
        return config.resume, checkpoint.load(config.resume)

    def _newest_in(self, folder: str, flag: str) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint in `folder` that loads (each newer one refused said in a line); None when there
        is none; CheckpointError when there are some and none loads: never a silent fresh start over them."""
        reasons: list[str] = []
        found = checkpoint.load_newest(folder, reasons.append)
        if found is not None:
            for reason in reasons:
                self.report.line(f"{reason}; trying an older one")
            return found
        if reasons:
            raise CheckpointError(f"{flag} found no usable checkpoint in {folder}: {'; '.join(reasons)}")
        return None

    def check(self, path: str, state: dict[str, Any], ours: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model, data set or optimizer in one line naming the field;
        log the settings that changed."""
        saved = state["config"]
        theirs = {
            **saved,
            "model": _model_name(saved),
            **{key: state.get(key) for key in ("train_size", "optimizer_class", "scheduler_class")},
        }
        for name in MUST_MATCH_ON_RESUME:
            if theirs.get(name) is not None and ours[name] != theirs[name]:
                what = {
                    "train_size": "a training set of",
                    "optimizer_class": "optimizer",
                    "scheduler_class": "LR scheduler",
                }.get(name, f"--{name.replace('_', '-')}")
                raise CheckpointError(
                    f"{what} {ours[name]} contradicts checkpoint {path} (saved with {theirs[name]}): "
                    f"resume with the same one or start a new --save-dir"
                )
        self._refuse_past_epochs(path, state)
        changed = run_settings.changes(saved, self.config)
        if changed:
            keeps_seed = (
                "; data order and random state continue the checkpoint's"
                if self.config.seed != saved.get("seed", self.config.seed)
                else ""
            )
            self.report.line(f"resuming with changed settings: {'; '.join(changed)}{keeps_seed}")

    def _refuse_past_epochs(self, path: str, state: dict[str, Any]) -> None:
        """A checkpoint already beyond --epochs or --max-steps (totals, not more): nothing to train, and a plan
        with a negative number of steps left would be a lie."""
        steps, limit = state.get("global_step", 0), self.config.max_steps
        if limit and steps >= limit:
            raise CheckpointError(
                f"checkpoint {path} has trained {steps} optimizer steps, already at --max-steps "
                f"{limit} (the total, not steps more): nothing to train; pass a larger --max-steps "
                f"to train on"
            )
        epochs, partial = state["epoch"], state["samples_in_epoch"] > 0
        if epochs > self.config.epochs or (epochs == self.config.epochs and partial):
            part = " and part of the next" if partial else ""
            raise CheckpointError(
                f"checkpoint {path} has trained {epochs} epoch(s){part}, already past --epochs "
                f"{self.config.epochs} (the total, not epochs more): nothing to train; pass --epochs "
                f"{epochs + 1} or more to train on"
            )

    # ------------------------------------------------------------------ what a checkpoint holds
    def state_of(self, stateful: dict[str, Any]) -> dict[str, Any]:
        """The one-file checkpoint of `stateful` ({name: thing with state_dict()}), in plain types so it loads
        with weights_only=True: each thing's state under its name, PROGRESS's keys at the top (the format's
        keys since version 1). Every rank must call it (the RNG states are gathered; rank 0 gets the whole
        model). Saves happen between optimizer steps only, so no gradient accumulation is ever in flight."""
        state = {name: thing.state_dict() for name, thing in stateful.items()}
        return {
            "format_version": checkpoint.FORMAT_VERSION,
            "torch_version": str(torch.__version__),  # a str subclass that weights_only refuses
            **state.pop(PROGRESS, {}),
            **state,
            "world_size": self.runtime.data_ranks,  # the data's shares, over every replica group too
            "config": self.config.to_dict(),
        }

    def load_into(self, stateful: dict[str, Any], state: dict[str, Any], path: str) -> None:
        """Load checkpoint `state` into each of `stateful`'s things, in the dict's order; one that does not
        fit (another model, optimizer or scheduler) is refused in one line naming `path`. From a sharded folder
        each rank reads the model's and optimizer's shards it holds, at any world size."""
        folder = checkpoint.is_sharded(path)
        errors = (
            RuntimeError,
            ValueError,
            KeyError,
            IndexError,
        )  # a damaged folder is sharded's CheckpointError
        try:
            if folder:
                sharded.load_shards(stateful, path)
            for name, thing in stateful.items():
                if not (folder and name in sharded.SHARDED):
                    thing.load_state_dict(state if name == PROGRESS else state.get(name, {}))
        except errors as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [repr(error)]
            raise CheckpointError(
                f"checkpoint {path} does not fit this model/optimizer: {lines[min(1, len(lines) - 1)][:300]}"
            ) from None

    # ------------------------------------------------------------------ save
    def save(self, stateful: dict[str, Any], name: str, also_as: str | None = None) -> str:
        """Write the checkpoint of `stateful` to <save-dir>/name (and also_as); every rank must call this.
        The sharded format drops the names' .pt: `last.pt` is the folder `last/` there.

        The success flag all-reduced at the end is also the barrier, so no rank
        runs ahead, and a failed write (full disk, lost permission) stops every
        rank with one line naming the file, while the previous checkpoint stays.
        """
        step = stateful[PROGRESS].state_dict()["global_step"]
        if self.sharded:
            return self._save_sharded(
                stateful, name.removesuffix(".pt"), also_as and also_as.removesuffix(".pt"), step
            )
        state = self.state_of(stateful)
        name = name.removesuffix(".pt") + self.suffix
        also_as = None if also_as is None else also_as.removesuffix(".pt") + self.suffix
        path, failed_path, error = os.path.join(self.save_dir, name), "", ""
        if self.runtime.is_main:
            with self.moving if self.set_aside else contextlib.nullcontext():
                for target in [path] + ([os.path.join(self.save_dir, also_as)] if also_as else []):
                    try:
                        checkpoint.atomic_save(state, target, before_rename=self._save_fault(step))
                    except OSError as failure:
                        failed_path, error = target, f"{failure.strerror or failure}"
                        break
                    if target == path:
                        self.last_saved = path
        self._agree(path, failed_path, error, step)
        self._saved(path, step)
        return path

    def _agree(self, path: str, failed_path: str, error: str, step: int) -> None:
        """Every rank learns whether rank 0's writing for `path` failed (`error`), and then stops in one line."""
        failed = all_reduce_sum(torch.tensor([float(bool(error))], device=self.runtime.device)).item()
        if failed:
            kept = (
                "the previous checkpoint is kept"
                if failed_path in ("", path)
                else "the newest checkpoint is kept"
            )
            raise TrainingStopped(
                f"could not write checkpoint {failed_path or path}: {error or 'failed on rank 0'}; "
                f"stopped at step {step}, {kept}: {self.newest()}"
            )

    def _saved(self, path: str, step: int) -> None:
        """`path` (of optimizer step `step`) is in place: the newest checkpoint, and --overwrite's set-aside run
        can go."""
        self.last_saved, self.saved_step = path, step
        with self.moving:
            folder, self.set_aside = self.set_aside, None
            if folder and self.runtime.is_main:
                run_folders.drop_set_aside(folder)  # our first checkpoint is safely written

    def put_back_at_once(self) -> str | None:
        """For a process that ends at once (a second SIGTERM or Ctrl-C, a wait that outlasted its grace): rank 0
        puts --overwrite's set-aside files back, as `release` does when a run ends before its first checkpoint
        (unless torchrun may restart it); the line that says so, or None. Called from the stop request's thread,
        so it writes no line itself."""
        if not self.set_aside or not self.runtime.is_main or preemption.restarts_left() > 0:
            return None
        if not self.moving.acquire(timeout=PUT_BACK_WAIT_SECONDS):  # a save in the middle of its writing
            return (
                f"--overwrite: the previous run's files are still in {self.set_aside}; the next run in "
                f"--save-dir {self.save_dir} puts them back"
            )
        try:
            folder, self.set_aside = self.set_aside, None
            if folder is None:
                return None
            run_folders.put_back(folder)
        finally:
            self.moving.release()
        return (
            f"--overwrite: this run ended before its first checkpoint, so the previous run's files are back in "
            f"--save-dir {self.save_dir}"
        )

    def _save_sharded(self, stateful: dict[str, Any], name: str, also_as: str | None, step: int) -> str:
        """Every rank writes its shards into `<name>.tmp/`, rank 0 the rest; renamed to `name` (and linked as
        `also_as`) once complete, after the writing in the background with --async-checkpoint."""
        started = time.perf_counter()
        self.finish_saves()  # the previous background save first: saves are in place in their order
        path = os.path.join(self.save_dir, name)
        folder, error = sharded.temporary_folder(path), ""
        rest = self.state_of({key: thing for key, thing in stateful.items() if key not in sharded.SHARDED})
        if self.runtime.is_main:
            try:
                if os.path.lexists(folder):  # a killed save's: ours now
                    safe_files.remove(folder)
                safe_files.make_folder(folder, inside=self.save_dir)
                checkpoint.atomic_save(rest, os.path.join(folder, checkpoint.STATE_FILE))
            except OSError as failure:
                error = f"{failure.strerror or failure}"
        self._agree(path, folder, error, step)  # the folder is there before any rank writes into it
        background = self.background if self.config.async_checkpoint else None
        fault = self._save_fault(step)  # test-only: a kill in the background writing, else before the rename
        try:
            pending = sharded.start_save(stateful, folder, background, die_midway=bool(fault and background))
        except Exception as failure:  # DCP raises on every rank when one failed: the ranks stop together
            raise TrainingStopped(
                f"could not write checkpoint {path}: {str(failure).strip()[:300]}; stopped at "
                f"step {step}, the previous checkpoint is kept: {self.newest()}"
            ) from None

        def finish() -> None:  # on every rank, once every rank's shards are written: rank 0 renames
            error = ""
            if self.runtime.is_main:
                if fault:
                    fault()
                try:
                    self._put_in_place(folder, path, also_as)
                except OSError as failure:
                    error = f"{failure.strerror or failure}"
            self._agree(path, path, error, step)
            self._saved(path, step)

        if pending is None:
            finish()
            self.report.line(
                f"checkpoint {path}/ saved in {time.perf_counter() - started:.2f}s "
                f"({checkpoint.megabytes(checkpoint.size_of(path)) if self.runtime.is_main else ''})"
            )
        else:
            self.background.pending = (pending, finish)
            self.report.line(
                f"checkpoint {path}/ being written in the background: training blocked "
                f"{time.perf_counter() - started:.2f}s"
            )
        return path

    def _put_in_place(self, folder: str, path: str, also_as: str | None) -> None:
        """Rank 0: the complete `folder` becomes `path` (and `also_as`, linked), then old step folders go."""
        safe_files.replace_folder(folder, path)
        if also_as:
            also = os.path.join(self.save_dir, also_as)
            copy = sharded.temporary_folder(also)
            if os.path.lexists(copy):  # a killed save's
                safe_files.remove(copy)
            safe_files.linked_copy(path, copy)
            safe_files.replace_folder(copy, also)
        if os.path.basename(path).startswith("step-"):
            checkpoint.prune_step_checkpoints(self.save_dir, self.config.keep_last)

    def finish_saves(self) -> None:
        """Wait for the background save still being written, and put it in place (every rank calls this)."""
        try:
            self.background.wait()
        except TrainingStopped:  # its renaming failed: said already
            raise
        except Exception as failure:  # every rank's future fails alike: DCP's collective reports it to each
            raise TrainingStopped(
                f"could not write a checkpoint in the background: {str(failure).strip()[:300]}; "
                f"the previous checkpoint is kept: {self.newest()}"
            ) from None

    def save_step(self, stateful: dict[str, Any], global_step: int) -> None:
        """A step checkpoint, then the oldest ones beyond --keep-last go (only once the new one is in place)."""
        self.save(
            stateful, checkpoint.step_checkpoint_name(global_step)
        )  # .pt: save() gives it the run's suffix
        if self.runtime.is_main and not self.sharded:  # a sharded one prunes once it is in place
            checkpoint.prune_step_checkpoints(self.save_dir, self.config.keep_last)

    def newest(self) -> str:
        """The checkpoint a user can fall back on, for error messages."""
        return self.last_saved or "none written by this run"

    def _save_fault(self, step: int) -> Any:
        """Test-only: the fault injector's kill between writing and renaming, at its chosen step."""
        return faults.kill_self if faults.save_fault_step(self.runtime.rank) == step else None


def _model_name(saved_config: dict[str, Any]) -> str | None:
    """The model a checkpoint's config built (its --model, or the default of its --mode)."""
    try:
        return TrainConfig.from_dict(saved_config).model_name
    except UsageError:  # a config this version cannot parse: compare what was written
        return saved_config.get("model")
