"""--search optuna end to end: real Optuna studies in real journal files, real runs, a SIGKILLed sweep resumed."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    RUN_TIMEOUT,
    TINY_SWEEP_RUN,
    assert_ok,
    assert_one_line,
    cli_env,
    contents,
    read_hparams,
    read_results,
    read_scalars,
    reference_sweep,
    run_sweep,
)

optuna = pytest.importorskip("optuna", reason="the [search] extra (optuna) is not installed")

# 3 trials of 2 seeds on one slot, so that every draw and every pruning decision repeats: a trial's value at an
# epoch is reported once both its runs reached it (seed 1's run, seed 0's having ended), and ASHA's first rung is
# epoch 1.
STUDY = ["--search", "optuna", "--trials", "3", "--space", "lr=log(1e-3,1)", "--prune", "asha"]
SEARCH = [*STUDY, "--num-seeds", "2", "--workers", "1"]
RUN = [*TINY_SWEEP_RUN, "--epochs", "2"]


def search_args(sweep_dir: Path) -> list[str]:
    return ["--sweep-dir", str(sweep_dir), *SEARCH, "--", *RUN]


def load_study(sweep_dir: Path):
    """The study as Optuna itself reads it from the sweep's journal."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return optuna.load_study(
        study_name=None, storage=JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal")))
    )


def decisions(sweep_dir: Path) -> list[tuple]:
    """Every trial's settings, state, value and values at each epoch end: what a repeated search must repeat."""
    return [
        (trial.number, trial.state.name, trial.params, trial.value, trial.intermediate_values)
        for trial in load_study(sweep_dir).trials
    ]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """An uninterrupted search, the reference for the tests below."""
    return reference_sweep(tmp_path_factory, search_args)


@pytest.mark.slow
def test_a_search_prunes_trials_and_shows_them(searched):
    sweep_dir, result = searched
    study = load_study(sweep_dir)
    states = [trial.state.name for trial in study.trials]
    assert len(states) == 3 and "PRUNED" in states and "COMPLETE" in states, states
    results = read_results(sweep_dir)
    assert sorted(results) == [f"trial-{n}/seed-{s}" for n in range(3) for s in range(2)]
    for trial in study.trials:
        runs = [results[f"trial-{trial.number}/seed-{seed}"] for seed in range(2)]
        assert all(run["status"] in ("ok", "pruned") for run in runs)  # pruned is never failed
        if trial.state.name == "COMPLETE":  # the mean over the seeds of each run's best val_loss
            assert trial.value == pytest.approx(sum(run["metrics"]["best"] for run in runs) / 2, abs=1e-12)
            assert list(trial.intermediate_values) == [1, 2]
        else:  # seed 1's run, reporting the trial's first mean, heard the pruner and stopped after epoch 1
            assert runs[1]["status"] == "pruned" and runs[1]["metrics"]["epochs"] == 1
            assert "pruned by the search (asha) after epoch 1" in runs[1]["metrics"]["pruned"]
            last = torch.load(sweep_dir / f"trial-{trial.number}/seed-1/last.pt", weights_only=True)
            assert (last["epoch"], last["evaluated"]) == (1, True)  # it stopped after that epoch's checkpoint
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(row["trial"], row["state"]) for row in rows] == [
        (str(t.number), STATE[t.state.name]) for t in study.trials
    ]
    best = study.best_trial
    assert (
        f"best: trial {best.number}, val_loss {best.value:.4f} (mean over 2 seeds); train it with: python "
        f"main_multi_gpu.py "
        in result.stdout
        and f"--lr {best.params['lr']!r}" in result.stdout
    )
    assert "search done: 3 trials ended" in result.stdout
    # TensorBoard's HParams: one session per trial with its settings, its value as a scalar
    sessions = read_hparams(sweep_dir / "hparams")
    assert sessions == {
        f"trial-{t.number}": {"lr": t.params["lr"], "state": STATE[t.state.name]} for t in study.trials
    }
    scalars = read_scalars(sweep_dir / "hparams")
    assert sorted(value for _, value in scalars["val_loss"]) == pytest.approx(
        sorted(t.value for t in study.trials), rel=1e-6
    )  # TensorBoard's float32
    plots = [
        sweep_dir / f"{name}.png"
        for name in ("optimization_history", "param_importances", "intermediate_values")
    ]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots: matplotlib is not installed" in result.stdout and not any(p.exists() for p in plots)
    else:
        assert all(p.read_bytes().startswith(b"\x89PNG") for p in plots), result.stdout


STATE = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


@pytest.mark.slow
def test_a_killed_search_resumes_its_trial_and_repeats_the_study(searched, tmp_path):
    """The whole sweep is SIGKILLed once trial 1's first run has saved its step-2 checkpoint; the same command then
    runs no trial twice, resumes trial 1 under its number, and ends with the reference's study: the same draws,
    values and pruning decisions (so a seeded search repeats exactly)."""
    reference, _ = searched
    args = search_args(tmp_path)
    first = run_sweep(args, env={"MULTIGPU_SWEEP_FAULT_INJECT": "trial-1/seed-0@0:2@sweep"})
    assert first.returncode == -9, first.stderr
    killed = load_study(tmp_path)  # Optuna reads the journal of a killed sweep
    assert [trial.state.name for trial in killed.trials][1:] == ["RUNNING"]
    finished = read_results(tmp_path)
    assert sorted(finished) == ["trial-0/seed-0", "trial-0/seed-1"]
    mtimes = {name: (tmp_path / name / "last.pt").stat().st_mtime_ns for name in finished}

    second = run_sweep(args)
    assert_ok(second)
    assert "1 trial(s) ended before, 2 run(s) to resume (1 continue from their checkpoints)" in second.stdout
    read_results(tmp_path)  # asserts one line per run: none ran twice
    assert {name: (tmp_path / name / "last.pt").stat().st_mtime_ns for name in finished} == mtimes
    log = (tmp_path / "trial-1/seed-0/train.log").read_text()
    assert "resumed from" in log.split("attempt 1")[-1] and "step-000000002.pt" in log
    assert decisions(tmp_path) == decisions(reference)


def test_bad_search_input_is_one_line_and_changes_nothing(tmp_path, capsys, monkeypatch):
    from multigpu.sweep.cli import main

    (tmp_path / "results.jsonl").write_text("kept\n")  # a sweep dir with something in it
    before = contents(tmp_path)
    search = ["--sweep-dir", str(tmp_path), "--search", "optuna", "--trials", "2"]
    cases = {
        "lr=log(1e-4)": "log() takes two numbers, LO and HI",
        "lr=exp(1,2)": "exp is not a way to sample; give log, uniform, int or choice",
        "lr=log(1e-4,1e-1": "expected KEY=log(LO,HI), uniform(LO,HI), int(LO,HI) or choice(A,B,...)",
        "weight_decy=uniform(0,0.1)": "weight_decy is not a training setting (did you mean weight_decay?)",
        "lr=uniform(0.1,0.1)": "the range is empty; LO must be below HI",
        "batch_size=int(0,4)": "--batch-size must be at least 1, got 0",  # the training flag's own rule
        "epochs=uniform(1,3)": "--epochs takes whole numbers; give int(LO,HI) or log(LO,HI)",
    }
    for space, expected in cases.items():
        assert main([*search, "--space", space, "--", *RUN]) == 2
        assert_one_line(2, capsys.readouterr().err, f"--space {space}: {expected}")
    for argv, expected in [
        (["--trials", "0"], "--trials must be at least 1, got 0"),
        (["--grid", "lr=0.1,0.2"], "give --grid (every point of a grid) or --search optuna"),
    ]:
        assert main([*search[:-2], *argv, "--space", "lr=log(1e-4,1e-1)", "--", *RUN]) == 2
        assert_one_line(2, capsys.readouterr().err, expected)
    monkeypatch.setitem(sys.modules, "optuna", None)  # as where Optuna is not installed
    assert main([*search, "--space", "lr=log(1e-4,1e-1)", "--", *RUN]) == 2
    assert_one_line(2, capsys.readouterr().err, "pip install '.[search]'")
    assert contents(tmp_path) == before


@pytest.mark.slow
def test_a_trial_of_several_processes_reports_from_its_rank_0(tmp_path):
    """--gpus-per-run 2: each run of the trial is a DDP job under torchrun (gloo on the CPU), whose rank 0 reports."""
    result = run_sweep(
        [
            "--sweep-dir",
            str(tmp_path),
            "--search",
            "optuna",
            "--trials",
            "1",
            "--space",
            "lr=log(1e-3,1e-1)",
            "--prune",
            "median",
            "--gpus-per-run",
            "2",
            "--workers",
            "1",
            "--",
            *RUN,
            "--dist-timeout",
            "60",
        ]
    )
    assert_ok(result)
    (trial,) = load_study(tmp_path).trials
    assert trial.state.name == "COMPLETE" and list(trial.intermediate_values) == [1, 2]
    assert trial.value == read_results(tmp_path)["trial-0/seed-0"]["metrics"]["best"]
    assert "mode ddp: 2 processes, backend gloo" in (tmp_path / "trial-0/seed-0/train.log").read_text()


@pytest.mark.slow
def test_the_array_tasks_of_a_search_drive_one_study(tmp_path, capsys):
    """--slurm --search writes a job array whose tasks are drivers of the one study; its two tasks started together,
    the way SLURM starts them (the script, with the task's id), as two processes on one journal file: the study
    holds exactly --trials trials, each run once, and the first rung judged the first wave (a trial of each task,
    started together) together: the worse at epoch 1 stopped there whichever got there first."""
    from multigpu.sweep.cli import main

    argv = ["--sweep-dir", str(tmp_path), *STUDY, "--slurm", "--shards", "2", "--workers", "1", "--", *RUN]
    assert main(argv) == 0  # in this process: writing the script starts no run
    script = tmp_path / "sweep.sbatch"
    assert f"wrote {script}: 3 trials in 2 array tasks" in capsys.readouterr().out
    assert not (tmp_path / "study.journal").exists()  # the tasks start the study
    command = script.read_text().splitlines()[-1]
    assert "--search optuna --trials 3 --space 'lr=log(1e-3,1)' --sampler tpe --prune asha" in command
    assert '--shard "${SLURM_ARRAY_TASK_ID}/2"' in command
    tasks = [
        subprocess.Popen(
            ["bash", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env({"CUDA_VISIBLE_DEVICES": "", "SLURM_ARRAY_TASK_ID": str(task)}),
        )
        for task in range(2)
    ]
    outputs = [task.communicate(timeout=RUN_TIMEOUT)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    study = load_study(tmp_path)
    assert [trial.number for trial in study.trials] == [0, 1, 2]
    assert all(trial.state.name in ("COMPLETE", "PRUNED") for trial in study.trials)
    ran = {
        index: [json.loads(line)["experiment"] for line in path.read_text().splitlines()]
        for index, path in enumerate(sorted(tmp_path.glob("results.shard-*-of-2.jsonl")))
    }
    assert sorted(ran[0] + ran[1]) == [f"trial-{n}/seed-0" for n in range(3)]  # each trial once, by one task
    for index in range(2):
        assert {
            f"trial-{t.number}/seed-0" for t in study.trials if t.user_attrs["sweep shard"] == f"{index}/2"
        } == set(ran[index])
    wave = sorted(study.trials[:2], key=lambda trial: trial.intermediate_values[1])
    assert [(t.state.name, list(t.intermediate_values)) for t in wave] == [
        ("COMPLETE", [1, 2]),
        ("PRUNED", [1]),
    ]
    assert {t.user_attrs["sweep shard"] for t in wave} == {"0/2", "1/2"}


def test_the_objective_is_the_runs_monitor_and_main_multi_gpu_takes_the_search_flags(tmp_path):
    """val_loss (lower is better) unless --monitor names another: --monitor val_acc searches for the highest; the
    design notes' form, main_multi_gpu.py with the sweep flags mixed in, reads the search's flags too."""
    from multigpu.sweep.options import parse, requested
    from multigpu.sweep.search import build_search_plan

    argv = ["--sweep-dir", str(tmp_path), *STUDY, "--epochs", "2", "--monitor", "val_acc"]
    assert requested(argv)
    options, train_argv = parse(argv, mixed=True)
    assert (options.search, options.trials, options.space, options.prune) == (
        "optuna",
        3,
        ["lr=log(1e-3,1)"],
        "asha",
    )
    assert train_argv == ["--epochs", "2", "--monitor", "val_acc"]
    plan = build_search_plan(options, train_argv)
    assert (plan.objective, plan.lower_is_better) == ("val_acc", False)
    plan = build_search_plan(options, ["--epochs", "2"])
    assert (plan.objective, plan.lower_is_better) == ("val_loss", True)
    assert plan.train_argv[-2:] == ["--monitor-metric", "val_loss"]  # the runs' best.pt follows the objective
    assert list(tmp_path.iterdir()) == []  # planning writes nothing


# A driver killed while it writes a record: Optuna's own append (through the sweep's storage, holding the journal's
# link lock) SIGKILLs its process once half of the record's bytes are on disk.
KILLED_MID_WRITE = """
import builtins, os, signal, sys
from multigpu.sweep.study import STUDY_NAME, storage

journal = sys.argv[1]
store = storage(journal)
real_open = builtins.open


class KilledMidWrite:
    def __init__(self, file):
        self.file = file

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, data):
        self.file.write(data[: len(data) // 2])
        self.file.flush()
        os.fsync(self.file.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def opened(path, mode="r", *args, **kwargs):
    file = real_open(path, mode, *args, **kwargs)
    return KilledMidWrite(file) if path == journal and "a" in mode else file


builtins.open = opened
study = store.get_study_id_from_name(STUDY_NAME)
store.set_trial_user_attr(store.get_trial_id_from_study_id_trial_number(study, 0), "note", "never written whole")
"""


def damaged_copy(reference: Path, tmp_path: Path) -> Path:
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(reference, sweep_dir, symlinks=True)
    return sweep_dir


def drive(sweep_dir: Path, capsys) -> tuple[int, str, str]:
    """The same search command again, in this process (every trial has ended: nothing is trained)."""
    from multigpu.sweep.cli import main

    code = main(search_args(sweep_dir))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def sha256s(sweep_dir: Path) -> dict[str, str]:
    """Every file's digest but the shard lock's owner record (each driver writes its pid there)."""
    return {
        str(path.relative_to(sweep_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sweep_dir.rglob("*")
        if path.is_file() and not path.is_symlink() and path.name != ".lock"
    }


@pytest.mark.slow
def test_a_record_cut_short_by_a_sigkill_while_writing_is_set_aside_and_the_search_continues(
    searched, tmp_path, capsys
):
    reference, _ = searched
    sweep_dir = damaged_copy(reference, tmp_path)
    journal = sweep_dir / "study.journal"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(journal)], env=cli_env(), timeout=RUN_TIMEOUT
    )
    assert killed.returncode == -9
    damaged = journal.read_bytes()
    assert not damaged.endswith(b"\n") and damaged.startswith((reference / "study.journal").read_bytes())
    assert (sweep_dir / "study.journal.lock").is_symlink()  # the killed writer held the lock
    results = (sweep_dir / "results.jsonl").read_bytes()

    started = time.monotonic()
    code, out, err = drive(sweep_dir, capsys)
    assert code == 0, err
    assert time.monotonic() - started < 25  # the left lock removed, not waited on for Optuna's 30 s
    warnings = [line for line in err.splitlines() if line.strip()]
    assert len(warnings) == 1 and "Traceback" not in err, err
    backups = list(sweep_dir.glob("study.journal.partial-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == damaged
    assert (
        warnings[0].startswith(f"warning: {journal}: its last record was cut short (")
        and str(backups[0]) in err
    )
    assert "removed the lock(s) it left: study.journal.lock" in warnings[0]
    # the partial line, and only it, cut off (then the driver's opening of the study appended a record of its own)
    repaired = journal.read_bytes()
    assert repaired.startswith((reference / "study.journal").read_bytes()) and damaged not in repaired
    assert all(json.loads(line) for line in repaired.splitlines())
    assert (sweep_dir / "results.jsonl").read_bytes() == results  # nothing ran again
    assert "search done: 3 trials ended" in out
    assert decisions(sweep_dir) == decisions(reference)


@pytest.mark.slow
def test_a_journal_cut_by_truncate_is_set_aside_and_its_cut_trial_told_again(searched, tmp_path, capsys):
    """`truncate -s -40`: the last record, the last trial's ending, loses its end; the trial is running again in
    the journal Optuna reads, and the driver tells it again from its runs' results, running nothing."""
    reference, _ = searched
    sweep_dir = damaged_copy(reference, tmp_path)
    journal = sweep_dir / "study.journal"
    subprocess.run(["truncate", "-s", "-40", str(journal)], check=True, timeout=60)
    assert load_study(sweep_dir).trials[-1].state.name == "RUNNING"  # Optuna skips the partial line
    results = (sweep_dir / "results.jsonl").read_bytes()
    code, out, err = drive(sweep_dir, capsys)
    assert code == 0, err
    assert len(err.strip().splitlines()) == 1 and "its last record was cut short (" in err, err
    assert (sweep_dir / "results.jsonl").read_bytes() == results
    assert decisions(sweep_dir) == decisions(reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, expected",
    [
        ("garbage line", "line 5 is not a record Optuna writes (not JSON)"),
        ("bytes overwritten mid-file", "is not a record Optuna writes (not JSON)"),
        ("a record Optuna cannot replay", "is a record Optuna cannot replay (KeyError"),
        (
            "emptied",
            "holds runs of trials its study.journal does not know (trial-0, trial-1, trial-2; a journal of ",
        ),
        (
            "removed",
            "holds runs of trials its study.journal does not know (trial-0, trial-1, trial-2; no journal)",
        ),
    ],
)
def test_a_damaged_journal_or_one_that_does_not_know_the_runs_is_one_line_and_nothing_changes(
    searched, tmp_path, capsys, damage, expected
):
    reference, _ = searched
    sweep_dir = damaged_copy(reference, tmp_path)
    journal = sweep_dir / "study.journal"
    lines = journal.read_bytes().splitlines(keepends=True)
    if damage == "garbage line":
        journal.write_bytes(b"".join([*lines[:4], b"garbage\n", *lines[4:]]))
    elif damage == "bytes overwritten mid-file":
        with open(journal, "r+b") as file:
            file.seek(len(journal.read_bytes()) // 2)
            file.write(b"\xff" * 16)
    elif damage == "a record Optuna cannot replay":
        journal.write_bytes(b"".join([*lines, b'{"op_code": 5, "worker_id": "w"}\n']))
    elif damage == "emptied":
        subprocess.run(["truncate", "-s", "0", str(journal)], check=True, timeout=60)
    else:
        journal.unlink()
    before = sha256s(sweep_dir)
    code, _, err = drive(sweep_dir, capsys)
    assert_one_line(code, err, expected)
    assert "nothing was changed" in err
    assert sha256s(sweep_dir) == before  # nothing appended, rerun or summarized
