"""--prune asha's rungs (multigpu/sweep/rungs.py) on real Optuna studies in real journal files: who goes on at a
rung, and how long a trial waits at the first one for the trials that started with it."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

optuna = pytest.importorskip("optuna", reason="the [search] extra (optuna) is not installed")

from multigpu.sweep import rungs  # noqa: E402  (it imports Optuna)
from multigpu.sweep.study import open_study, storage  # noqa: E402


def study_of(tmp_path: Path, lower_is_better: bool = True) -> Any:  # an optuna.Study
    """The study as a driver opens it; another process opening the same file sees what this one writes."""
    return open_study(
        storage(str(tmp_path / "study.journal")),
        lower_is_better,
        optuna.samplers.RandomSampler(seed=0),
        rungs.SuccessiveHalving(),
    )


def test_a_rung_compares_every_trial_that_reached_it_whoever_got_there_first(tmp_path):
    study = study_of(tmp_path)
    bad, good = study.ask(), study.ask()
    bad.report(2.0, 1)  # the bad trial of the first wave reports first ...
    good.report(0.05, 1)
    assert bad.should_prune() and not good.should_prune()  # ... and stops: the good one goes on
    # Optuna's own successive halving judges a trial against those judged before it: asked first, the bad trial
    # would go on (the measured search's trial 0 trained all 6 epochs so), hence the wave's wait at the first rung.
    assert not optuna.pruners.SuccessiveHalvingPruner(min_resource=1).prune(study, study.trials[0])
    later = [study.ask() for _ in range(6)]  # 8 at epoch 1: the best 8 // 4 = 2 go on
    for trial, value in zip(later, [0.01, 0.5, 0.02, 0.9, 0.3, 0.04]):
        trial.report(value, 1)
    assert [trial.should_prune() for trial in later] == [False, True, False, True, True, True]
    assert [rungs.SuccessiveHalving().is_rung(epoch) for epoch in range(1, 17)] == [
        epoch in (1, 4, 16) for epoch in range(1, 17)
    ]  # rungs at 1, 4, 16: between them nobody is pruned
    later[0].report(5.0, 2)
    assert not later[0].should_prune()
    later[2].report(math.nan, 4)
    assert later[2].should_prune()  # a NaN stops at its rung


def test_higher_is_better_keeps_the_highest(tmp_path):
    study = study_of(tmp_path, lower_is_better=False)  # --monitor val_acc
    low, high = study.ask(), study.ask()
    low.report(0.2, 1)
    high.report(0.9, 1)
    assert low.should_prune() and not high.should_prune()


def test_the_first_rung_waits_for_company_only_while_some_can_come_and_not_for_long(tmp_path):
    study = study_of(tmp_path)
    first, second = study.ask(), study.ask()
    first.report(1.0, 1)
    started = time.monotonic()
    rungs.wait_for_company(
        study, first.number, 1, quorum=3, seconds=0.5
    )  # the second runs, a third is to come
    assert 0.5 <= time.monotonic() - started < 5  # it waited, as long as it may
    started = time.monotonic()
    rungs.wait_for_company(study, first.number, 1, quorum=3, seconds=120.0, stopped=lambda: True)
    assert time.monotonic() - started < 30  # Ctrl-C (the trainer's stop request) ends the wait
    # The second, running, reports from another process: the first hears it through the journal and goes on.
    waiter = threading.Thread(
        target=rungs.wait_for_company, args=(study_of(tmp_path), first.number, 1, 2, 120.0)
    )
    waiter.start()
    second.report(0.5, 1)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    # None on the way (the others ended without reaching the rung): a quorum that cannot be met is not waited for.
    study.tell(second.number, state=optuna.trial.TrialState.FAIL)
    third = study.ask()
    study.tell(third.number, state=optuna.trial.TrialState.FAIL)
    started = time.monotonic()
    rungs.wait_for_company(study, first.number, 1, quorum=3, seconds=120.0)
    assert time.monotonic() - started < 30
    # How long it may wait: as long as it took to get there (at least 30 s), within the hang watchdog's and the
    # collectives' limits, halved (0: off).
    assert rungs.patience(12.0, 300.0, 1800.0) == rungs.MIN_PATIENCE
    assert rungs.patience(400.0, 300.0, 1800.0) == 150.0
    assert rungs.patience(400.0, 0.0, 100.0) == 50.0
