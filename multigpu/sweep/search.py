"""--search optuna: a sweep whose points an Optuna study draws from --space instead of a grid's, each trial run on
the device slots as a grid point is (its seeds, its run folders DIR/trial-<n>/seed-<k>/, logs and retries), and
stopped early by the pruner (the runs report every epoch: multigpu/sweep/pruning.py).

The driver asks the study for a trial when a slot is free, so each draw knows every trial that ended before it,
and tells the study how a trial ended once all its runs have: complete, with the mean over its seeds of each run's
best --monitor value; pruned; or failed. A killed driver's rerun resumes its own shard's running trials under their
numbers (their runs continue from their checkpoints) and asks for new ones until the study holds --trials trials.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from multigpu.config import TrainConfig, flag, parse_config
from multigpu.errors import UsageError
from multigpu.loop.metrics import Monitor
from multigpu.sweep.options import SweepOptions
from multigpu.sweep.plan import (
    Experiment,
    default_sweep_dir,
    experiments_of,
    fingerprint_of,
    refuse_per_experiment_flags,
)
from multigpu.sweep.search_summary import STATES
from multigpu.sweep.space import Dimension, parse_space
from multigpu.sweep.study import (
    ERROR_ATTR,
    SHARD_ATTR,
    STUDY_FILE,
    TrialLink,
    make_pruner,
    make_sampler,
    open_study,
    storage,
    trial_point,
    trial_seed,
)

DEFAULT_OBJECTIVE = "val_loss"  # without --monitor-metric: the runs' best.pt follows the search's objective
# Drivers sharing the study count its trials and ask for one under DIR/.ask.lock (Optuna's link lock), one at a time.
ASK_LOCK = ".ask"


@dataclass
class SearchPlan:
    """What a search runs: the runs' training flags, the space, the seeds of every trial, and its objective."""

    sweep_dir: str
    base: TrainConfig
    train_argv: list[str]  # every run's training flags, --monitor included
    space: list[Dimension]
    seeds: list[int]
    objective: str  # the --monitor metric
    lower_is_better: bool
    max_epochs: int  # the most a trial may train (--space may draw --epochs)
    fingerprint: dict[str, Any]

    @property
    def journal(self) -> str:
        return os.path.join(self.sweep_dir, STUDY_FILE)

    def flags(self, params: dict[str, Any]) -> list[str]:
        """The training flags of a trial's drawn settings, checked together by the training flags' rules."""
        flags = [
            text
            for dimension in self.space
            for text in dimension.flags(params[dimension.name], self.train_argv)
        ]
        parse_config([*self.train_argv, *flags])  # each value was checked alone; together too
        return flags

    def runs(self, number: int, flags: Sequence[str], prune: str, quorum: int) -> list[Experiment]:
        """Trial `number`'s runs, one per seed, each reporting its epochs to the trial."""
        link = TrialLink(
            self.journal, number, tuple(self.seeds), self.objective, prune, self.max_epochs, quorum
        )
        return experiments_of(
            self.sweep_dir, trial_point(number), [*self.train_argv, *flags], self.seeds, link
        )


def build_search_plan(options: SweepOptions, train_argv: Sequence[str]) -> SearchPlan:
    """Check the training flags and the space (nothing is written yet)."""
    train_argv = list(train_argv)
    refuse_per_experiment_flags(train_argv)
    base = parse_config(train_argv)
    if base.monitor is None:
        train_argv += [f"--{flag('monitor')}", DEFAULT_OBJECTIVE]
        base = parse_config(train_argv)
    assert base.monitor is not None  # given, or set just above
    space = parse_space(options.space, train_argv)
    epochs = [max(dimension.values) for dimension in space if dimension.name == "epochs"]
    search = {
        "space": [dimension.text for dimension in space],
        "sampler": options.sampler,
        "prune": options.prune,
        "search_seed": options.search_seed,
        "seeds": list(options.seeds),
    }
    fingerprint = fingerprint_of(base, options, {}, search=search)
    sweep_dir = os.path.abspath(options.sweep_dir or default_sweep_dir(fingerprint))
    return SearchPlan(
        sweep_dir,
        base,
        train_argv,
        space,
        list(options.seeds),
        base.monitor,
        Monitor(base.monitor, base.monitor_mode).lower_is_better(),
        max(epochs or [base.epochs]),
        fingerprint,
    )


class Search:
    """One driver's side of the study: the trials of its shard, asked, resumed and told."""

    def __init__(
        self, plan: SearchPlan, options: SweepOptions, results: dict[str, dict[str, Any]], slots: int
    ):
        self.plan, self.options = plan, options
        self.shard = f"{options.shard[0]}/{options.shard[1]}"
        self.quorum = quorum(options, slots, len(plan.seeds))
        self.storage = storage(plan.journal)
        self.study = self._study(options.search_seed)
        self.results = dict(results)  # every run's latest record, this driver's new ones added
        self.trials: dict[int, list[Experiment]] = {}  # the trials this driver runs: their runs

    def _study(self, seed: int) -> Any:
        return open_study(
            self.storage,
            self.plan.lower_is_better,
            make_sampler(self.options.sampler, seed),
            make_pruner(self.options.prune, self.plan.max_epochs),
        )

    def mine(self, states: Sequence[str] | None = None) -> list[Any]:
        """This shard's trials (Optuna's FrozenTrials), of the given state names (RUNNING, FAIL, ...) or all."""
        return [
            trial
            for trial in self.study.get_trials(deepcopy=False)
            if trial.user_attrs.get(SHARD_ATTR) == self.shard
            and (states is None or trial.state.name in states)
        ]

    def resume(self) -> list[Experiment]:
        """The runs of this shard's trials that a killed or stopped driver left running and that have no result yet
        (they continue from their checkpoints); such a trial whose runs all ended is told now."""
        import optuna

        to_run = []
        for frozen in self.mine(["RUNNING"]):
            trial = optuna.trial.Trial(
                self._study(trial_seed(self.options.search_seed, frozen.number)),
                self._trial_id(frozen.number),
            )
            runs = self._start(trial)
            to_run += [run for run in runs if run.name not in self.results]
            if runs and all(run.name in self.results for run in runs):
                self._tell(frozen.number)
        return to_run

    def _trial_id(self, number: int) -> int:
        """The storage's id of trial `number` (Optuna's Trial and the storage's calls take ids)."""
        study_id = self.storage.get_study_id_from_name(self.study.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def more(self) -> list[Experiment]:
        """The runs of the next trial the study draws; none once the study holds --trials trials."""
        while True:
            with _ask_lock(self.plan.sweep_dir):
                number = len(self.study.get_trials(deepcopy=False))
                if number >= self.options.trials:
                    return []
                trial = self._study(trial_seed(self.options.search_seed, number)).ask()
                trial.set_user_attr(SHARD_ATTR, self.shard)
                runs = self._start(trial)
            if runs:
                return runs

    def _start(self, trial: Any) -> list[Experiment]:
        """Draw the trial's settings (a resumed trial's are its stored ones) and list its runs; a drawn value the
        training flags refuse fails the trial before anything runs."""
        params = {dimension.name: dimension.suggest(trial) for dimension in self.plan.space}
        try:
            flags = self.plan.flags(params)
        except UsageError as error:
            trial.set_user_attr(ERROR_ATTR, str(error))
            self.study.tell(trial.number, state=_state("FAIL"))
            return []
        self.trials[trial.number] = self.plan.runs(trial.number, flags, self.options.prune, self.quorum)
        return self.trials[trial.number]

    def recorded(self, record: dict[str, Any]) -> str | None:
        """Hear a run's final outcome; once every run of its trial has one, tell the study and say so."""
        self.results[record["experiment"]] = record
        number = next(
            (n for n, runs in self.trials.items() if record["experiment"] in {r.name for r in runs}), None
        )
        if number is None or any(run.name not in self.results for run in self.trials[number]):
            return None
        return self._tell(number)

    def _tell(self, number: int) -> str:
        """Tell the study how trial `number` ended, and say it in a line with the trial's settings."""
        state, value, error = _ending([self.results[run.name] for run in self.trials.pop(number)])
        if error:
            self.storage.set_trial_user_attr(self._trial_id(number), ERROR_ATTR, error)
        self.study.tell(number, value, state=_state(state))
        trial = self.study.get_trials(deepcopy=False)[number]
        said = "" if trial.value is None else f": {self.plan.objective} {trial.value:.4f}"
        settings = ", ".join(
            f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in trial.params.items()
        )
        return f"trial {number} {STATES[state]}{said} ({settings})"


def quorum(options: SweepOptions, slots: int, seeds: int) -> int:
    """The trials that run at once, over every driver (each assumed to have this one's slots): a trial takes
    one slot per seed, at least one. asha's first rung waits for as many (multigpu/sweep/rungs.py)."""
    return min(options.trials, options.shard[1] * max(1, slots // seeds))


@contextlib.contextmanager
def _ask_lock(sweep_dir: str) -> Iterator[None]:
    """DIR/.ask.lock, held while a driver counts the study's trials and asks for one: a symbolic link, as the
    journal's lock is (it works on NFS, where drivers on several machines share the sweep dir; one left by a
    killed driver is broken after 30 s unchanged, and asking takes well under a second)."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(os.path.join(sweep_dir, ASK_LOCK))
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _ending(outcomes: list[dict[str, Any]]) -> tuple[str, float | None, str | None]:
    """(Optuna's state, the value, why it failed) of a trial whose runs ended with `outcomes`: failed if a run
    failed or a finished run had no --monitor value, pruned if one was pruned, else complete with the mean of
    its runs' best values."""
    statuses = {outcome["status"] for outcome in outcomes}
    bests = [outcome["metrics"].get("best") for outcome in outcomes if outcome["status"] == "ok"]
    if "failed" in statuses:
        return "FAIL", None, None  # the failed run's record says why
    if "pruned" in statuses:
        return "PRUNED", None, None  # Optuna keeps the value it last reported
    if None in bests:
        return "FAIL", None, "a run ended without a --monitor value: give the runs a validation set"
    return "COMPLETE", statistics.fmean(bests), None


def _state(name: str) -> Any:
    from optuna.trial import TrialState

    return TrialState[name]
