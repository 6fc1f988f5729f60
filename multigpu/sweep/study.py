"""A search's Optuna study: the journal file in the sweep dir that holds it, its sampler and pruner, and the link a
run follows to its own trial.

    DIR/study.journal     the study (Optuna's JournalStorage on a JournalFileBackend): every trial with its settings,
                          its value at each epoch end, its state; drivers on several machines (shards) share it

Optuna is imported only here and in the modules that drive a study, and only when a search runs: a grid sweep
needs no extra. Open the study yourself with
`optuna.load_study(study_name="search", storage=JournalStorage(JournalFileBackend("DIR/study.journal")))`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from multigpu.errors import UsageError

STUDY_FILE = "study.journal"
STUDY_NAME = "search"
SHARD_ATTR = "sweep shard"  # the driver (--shard I/N) that runs a trial: a rerun of that shard resumes it
ERROR_ATTR = "error"  # a trial failed before its runs started: why (a drawn value the training flags refuse)
PRUNED_ATTR = (
    "pruned after epoch"  # set once by the run that heard the pruner, so the trial's other runs stop too
)
NEEDS_EXTRA = (
    "--search optuna needs Optuna, which is not installed: pip install '.[search]' "
    "(or pip install 'optuna>=4')"
)


def require_optuna() -> None:
    """UsageError naming the extra when Optuna is not installed (checked before anything is written)."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise UsageError(NEEDS_EXTRA) from None


@dataclass(frozen=True)
class TrialLink:
    """What a run of a search needs to report to its trial from any process (a torchrun rank too): plain values,
    so it travels to a worker in a pickle and to a torchrun child as JSON. The run's seed is its own --seed."""

    journal: str  # the study's file
    trial: int  # the trial's number
    seeds: tuple[int, ...]  # every run of the trial: its value at an epoch is their mean
    objective: str  # the --monitor metric reported
    prune: str  # --prune
    max_epochs: int  # the largest number of epochs a trial may train (hyperband's budget)
    quorum: int = (
        1  # the trials that run at once: asha's first rung waits for as many (multigpu/sweep/rungs.py)
    )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrialLink:
        values = json.loads(text)
        return cls(**{**values, "seeds": tuple(values["seeds"])})


def trial_point(number: int) -> str:
    """Trial `number`'s name in the sweep: its runs are DIR/trial-<n>/seed-<k>/, as a grid point's are."""
    return f"trial-{number}"


def storage(journal: str) -> Any:
    """The study's storage: Optuna's journal in one file, its appends locked by a symbolic link (Optuna's
    JournalFileSymlinkLock: creating a link is atomic on NFS of any version, where O_EXCL needs NFSv3 and fcntl
    locks are often broken)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

    return JournalStorage(JournalFileBackend(journal, lock_obj=JournalFileSymlinkLock(journal)))


def make_sampler(name: str, seed: int) -> Any:
    """--sampler: Optuna's TPE (random for its first 10 trials) or random sampler, seeded."""
    import optuna

    return (
        optuna.samplers.RandomSampler(seed=seed)
        if name == "random"
        else optuna.samplers.TPESampler(seed=seed)
    )


def make_pruner(name: str, max_epochs: int) -> Any:
    """--prune: the pruner, its steps being epochs. asha is successive halving from the first epoch on (rungs at
    epochs 1, 4, 16, ...: Optuna's reduction factor 4), its first rung waiting for the trials that started together
    (multigpu/sweep/rungs.py); median and hyperband are Optuna's, hyperband's brackets running up to `max_epochs`."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "asha":
        from multigpu.sweep.rungs import SuccessiveHalving

        return SuccessiveHalving(min_resource=1, reduction_factor=4)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_epochs)
    return optuna.pruners.NopPruner()


def open_study(store: Any, lower_is_better: bool, sampler: Any = None, pruner: Any = None) -> Any:
    """The sweep's study in `store`, created by the first driver (another one starting at once loads it)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what happens, trial by trial
    return optuna.create_study(
        study_name=STUDY_NAME,
        storage=store,
        sampler=sampler,
        pruner=pruner,
        direction="minimize" if lower_is_better else "maximize",
        load_if_exists=True,
    )


def trial_seed(search_seed: int, number: int) -> int:
    """The sampler's seed for trial `number`: a resumed study draws its next trial as an uninterrupted one would,
    and two drivers sharing the study never draw alike."""
    return (
        hash((search_seed, number)) & 0xFFFFFFFF
    )  # the hash of a tuple of ints is the same in every process
