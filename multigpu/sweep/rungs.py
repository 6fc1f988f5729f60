"""--prune asha: asynchronous successive halving whose first rung waits for the trials that started together.

Rungs are at epochs 1, 4, 16, ... (min_resource x reduction_factor^k: Optuna's defaults, a factor of 4). At a rung
a trial goes on only if its value there is among the best 1/4 of the values every trial of the study had at that
epoch (the best one while fewer than 8 have reached it): Optuna's SuccessiveHalvingPruner's rule.

What differs from Optuna's SuccessiveHalvingPruner is who a trial is compared with at the first rung. Optuna's
compares it with the trials that were judged there before it, so the first trial of a search to reach epoch 1 goes
on with nothing to be compared with, however bad it is (asynchronous successive halving promotes it). Optuna's own
`bootstrap_count` does not wait for company: it prunes the first B trials of every rung whatever their values (the
first trial promoted to epoch 4 too). Here the trials that run at once (the sweep's slots, over every driver) form
the first wave: a trial at the first rung waits until `quorum` trials have reported there, so that the wave is judged
together and its bad trials stop at epoch 1. It waits only while a trial that can still come is on its way (one
running that has not reached the rung, or one not yet drawn while the study holds fewer than `quorum`), and for a
bounded time (`patience`): so a slot is never held for long, the quorum is never more trials than --trials, and
later trials, which find the quorum met, never wait. Later rungs decide at once, as Optuna's do.

Decisions are made once per trial and rung: the run that reports the trial's value at an epoch asks the pruner
(multigpu/sweep/pruning.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import optuna
from optuna.study import StudyDirection
from optuna.trial import TrialState

POLL_SECONDS = 0.2  # how often a waiting trial reads the journal again
# Seconds a trial may always wait at the first rung: its company's start may lag by that much.
MIN_PATIENCE = 30.0


class SuccessiveHalving(optuna.pruners.BasePruner):
    """Optuna's successive-halving rule, every trial that reached a rung's epoch being compared there."""

    def __init__(self, min_resource: int = 1, reduction_factor: int = 4):
        self.min_resource = min_resource
        self.reduction_factor = reduction_factor

    @property
    def first_rung(self) -> int:
        """The epoch of the first rung, where a trial waits for the trials that started with it."""
        return self.min_resource

    def is_rung(self, epoch: int) -> bool:
        """Whether `epoch` is a rung's: min_resource x reduction_factor^k."""
        rung = self.min_resource
        while rung < epoch:
            rung *= self.reduction_factor
        return rung == epoch

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        """Prune at a rung unless the trial's value there is among the best 1/reduction_factor (at least the
        best one) of every trial's value at that epoch; a NaN is pruned at once."""
        epoch = trial.last_step
        if epoch is None or not self.is_rung(epoch):
            return False
        value = trial.intermediate_values[epoch]
        if math.isnan(value):
            return True
        there = sorted(at_epoch(study.get_trials(deepcopy=False), epoch).values())
        if study.direction == StudyDirection.MAXIMIZE:
            there.reverse()
        # Optuna's rule (SuccessiveHalvingPruner): the best len // factor go on, and the best one while there
        # are fewer than `factor` (Optuna cannot pause a trial to promote it later, as the paper's ASHA does).
        cut = there[max(len(there) // self.reduction_factor, 1) - 1]
        worse = value > cut if study.direction == StudyDirection.MINIMIZE else value < cut
        return worse


def at_epoch(trials: list[optuna.trial.FrozenTrial], epoch: int) -> dict[int, float]:
    """{trial number: its value at `epoch`} of the trials that reported one (not a NaN)."""
    return {
        trial.number: trial.intermediate_values[epoch]
        for trial in trials
        if epoch in trial.intermediate_values and not math.isnan(trial.intermediate_values[epoch])
    }


def patience(elapsed: float, watchdog_seconds: float, dist_timeout: float) -> float:
    """How long a trial may wait at the first rung: as long as it took to get there (at least MIN_PATIENCE), and
    never half as long as the hang watchdog (0: off) or a collective of its other ranks may wait."""
    limits = [limit / 2 for limit in (watchdog_seconds, dist_timeout) if limit > 0]
    return min([max(elapsed, MIN_PATIENCE), *limits])


def wait_for_company(
    study: optuna.Study,
    number: int,
    epoch: int,
    quorum: int,
    seconds: float,
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Wait until `quorum` trials of the study have a value at `epoch` (trial `number`'s included), while another
    can still come, for at most `seconds`, and not once `stopped()` (Ctrl-C: the run saves and stops at once)."""
    deadline = time.monotonic() + seconds
    while (
        time.monotonic() < deadline
        and not stopped()
        and _coming(study.get_trials(deepcopy=False), number, epoch, quorum)
    ):
        time.sleep(
            POLL_SECONDS
        )  # the others report from other processes (other machines): read the journal again


def _coming(trials: list[optuna.trial.FrozenTrial], number: int, epoch: int, quorum: int) -> bool:
    """Whether fewer than `quorum` trials are at `epoch` and one that can still get there is running or not yet
    drawn (the study holds fewer than `quorum` trials: another slot or driver is about to draw one)."""
    if len(at_epoch(trials, epoch)) >= quorum:
        return False
    on_the_way = [
        trial
        for trial in trials
        if trial.number != number
        and trial.state == TrialState.RUNNING
        and epoch not in trial.intermediate_values
    ]
    return bool(on_the_way) or len(trials) < quorum
