"""The trainer's side of a search: a callback (multigpu/loop/callbacks.py) that reports each epoch's monitored
metric to the run's Optuna trial and stops the run when the pruner says so.

Rank 0 alone talks to the study, at every epoch end (after the evaluation, before the checkpoint); a pruned run
stops after that epoch's checkpoint, all its ranks together (trainer.stop_training). A trial of several seeds
reports the mean of its runs at an epoch once every run has reached it, and a pruning heard by one of its runs
is written into the trial, so that the others stop at their next epoch end.

The run that reports the trial's value at an epoch asks the pruner, once: not at the run's last epoch (stopping
there would save nothing, and the trial completes), and, with --prune asha at its first rung, only once the
trials that started with it have reported there too (multigpu/sweep/rungs.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from multigpu.sweep.study import PRUNED_ATTR, STUDY_NAME, TrialLink, make_pruner, storage


class TrialReporter:
    """Reports the run's epochs to its trial (`link`); `pruned` says why it stopped, once the pruner stopped it."""

    def __init__(self, link: TrialLink):
        self.link = link
        self.started = time.monotonic()  # how long it took to reach the first rung bounds the wait there
        self.pruned: str | None = None
        self._storage: Any = None
        self._study: Any = None
        self._trial_id: int | None = None

    def on_fit_start(self, trainer: Any) -> None:
        """A run resumed after its trial was pruned (or started after another seed's run was) stops at once."""
        if not trainer.runtime.is_main:
            return
        epoch = self._frozen().user_attrs.get(PRUNED_ATTR)
        if epoch is not None:
            self._stop(
                trainer,
                f"pruned by the search ({self.link.prune}) after epoch {epoch} of trial {self.link.trial}",
            )

    def on_validation_end(self, trainer: Any) -> None:
        """Report this epoch's value; stop when the trial is pruned."""
        progress = trainer.progress
        if not trainer.runtime.is_main or not trainer.metrics or progress.samples_in_epoch:
            return  # not rank 0, no validation, or an evaluation in mid-epoch (--max-steps): no epoch to report
        value = float(trainer.metrics[self.link.objective])
        trial = self._trial()
        mean = self._mean_over_seeds(trial, trainer.config.seed, progress.epoch, value)
        frozen = self._frozen()
        pruned = PRUNED_ATTR in frozen.user_attrs  # by the pruner, as another run of the trial heard
        if not pruned and mean is not None and progress.epoch not in frozen.intermediate_values:
            trial.report(mean, progress.epoch)  # once: not again after a resume
            pruned = progress.epoch < trainer.config.epochs and self._should_prune(
                trial, trainer, progress.epoch
            )
            if pruned:
                trial.set_user_attr(PRUNED_ATTR, progress.epoch)
        if pruned:
            self._stop(
                trainer,
                f"pruned by the search ({self.link.prune}) after epoch {progress.epoch}: "
                f"{self.link.objective} {value:.4g}",
            )

    def _should_prune(self, trial: Any, trainer: Any, epoch: int) -> bool:
        """The pruner's answer at `epoch`; at asha's first rung, once the trials that started with this one are
        there too (or cannot come)."""
        from multigpu.sweep import rungs  # imports Optuna: a grid's torchrun child imports this module too

        pruner = self._study.pruner
        if isinstance(pruner, rungs.SuccessiveHalving) and epoch == pruner.first_rung:
            config = trainer.config
            seconds = rungs.patience(
                time.monotonic() - self.started, config.watchdog_seconds, config.dist_timeout
            )
            stop = getattr(trainer, "stop", None)  # the trainer's StopRequest: SIGINT/SIGTERM ends the wait
            rungs.wait_for_company(
                self._study,
                self.link.trial,
                epoch,
                self.link.quorum,
                seconds,
                stopped=lambda: stop is not None and stop.requested,
            )
        return trial.should_prune()

    def outcome(self) -> dict[str, Any]:
        """What the run's summary gains: why it was pruned, if it was."""
        return {"pruned": self.pruned} if self.pruned else {}

    def _mean_over_seeds(self, trial: Any, seed: int, epoch: int, value: float) -> float | None:
        """The trial's value at `epoch`: this run's alone, or the mean once every seed's run has reported it."""
        if len(self.link.seeds) == 1:
            return value
        trial.set_user_attr(_seed_key(seed, epoch), value)
        reported = self._frozen().user_attrs
        values = [reported.get(_seed_key(other, epoch)) for other in self.link.seeds]
        return None if None in values else statistics.fmean(values)

    def _stop(self, trainer: Any, why: str) -> None:
        self.pruned = why
        trainer.stop_training(why)

    def _trial(self) -> Any:
        """The trial as an Optuna Trial of this process (made anew each time: it caches what it read)."""
        import optuna

        self._connect()
        assert self._trial_id is not None  # found by _connect
        return optuna.trial.Trial(self._study, self._trial_id)

    def _frozen(self) -> Any:
        """The trial as the journal holds it now (other runs of the trial write to it too)."""
        self._connect()
        return self._storage.get_trial(self._trial_id)

    def _connect(self) -> None:
        import optuna

        if self._study is not None:
            return
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._storage = storage(self.link.journal)
        self._study = optuna.load_study(
            study_name=STUDY_NAME,
            storage=self._storage,
            sampler=optuna.samplers.RandomSampler(),  # it samples nothing here
            pruner=make_pruner(self.link.prune, self.link.max_epochs),
        )
        study_id = self._storage.get_study_id_from_name(STUDY_NAME)
        self._trial_id = self._storage.get_trial_id_from_study_id_trial_number(study_id, self.link.trial)


def _seed_key(seed: int, epoch: int) -> str:
    return f"seed {seed} epoch {epoch}"
