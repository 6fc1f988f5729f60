"""Sweeps end to end: real worker processes, real training runs, real files; killed workers and killed sweeps."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import statistics
from pathlib import Path

import pytest
import torch

from conftest import TINY_SWEEP_RUN, assert_ok, guide_text, read_results, reference_sweep, run_sweep

GRID = ["--grid", "lr=1e-3,3e-3"]
RUN = [*TINY_SWEEP_RUN, "--epochs", "2"]
EXPERIMENTS = [f"lr={lr}/seed-{seed}" for lr in ("0.001", "0.003") for seed in range(3)]
# What a run's result must reproduce exactly (wall time and throughput are measured, so they differ).
EXACT = ("val_loss", "val_acc", "best_val_acc", "epochs", "global_step")


def sweep_args(sweep_dir: Path, *extra: str) -> list[str]:
    return ["--sweep-dir", str(sweep_dir), "--num-seeds", "3", *GRID, *extra, "--", *RUN]


def exact_metrics(sweep_dir: Path) -> dict[str, dict[str, float]]:
    return {
        name: {key: record["metrics"][key] for key in EXACT}
        for name, record in read_results(sweep_dir).items()
    }


def assert_same_weights(dir_a: Path, dir_b: Path, experiment: str) -> None:
    a = torch.load(dir_a / experiment / "last.pt", weights_only=True)["model"]
    b = torch.load(dir_b / experiment / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[key], b[key]) for key in a), experiment


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """An uninterrupted 2-worker sweep of 2 grid points x 3 seeds, the reference for the tests below."""
    return reference_sweep(tmp_path_factory, lambda sweep_dir: sweep_args(sweep_dir, "--workers", "2"))


@pytest.mark.slow
def test_two_workers_run_every_experiment_once(two_workers):
    sweep_dir, result = two_workers
    results = read_results(sweep_dir)
    assert sorted(results) == sorted(EXPERIMENTS)
    assert all(record["status"] == "ok" and record["metrics"]["epochs"] == 2 for record in results.values())
    assert {record["slot"] for record in results.values()} == {"cpu0", "cpu1"}  # both workers took runs
    for name in EXPERIMENTS:  # each run wrote what main_multi_gpu.py writes into its own save dir
        assert (sweep_dir / name / "last.pt").exists() and list((sweep_dir / name / "tb").iterdir())
        # a tiny run may end at chance: it is done, and marked as one that did not learn (docs/sweeps.md, "The summary")
        assert len(re.findall(rf"^ok(      |, did not learn  ){re.escape(name)}:", result.stdout, re.M)) == 1
    progress = json.loads((sweep_dir / "progress.json").read_text())
    assert progress["finished_now"] == 6 and progress["to_run"] == 0 and progress["running"] == []
    assert "sweep done: 6 of 6 experiments ok" in result.stdout


@pytest.mark.slow
def test_summary_matches_a_direct_computation(two_workers):
    sweep_dir, result = two_workers
    results = read_results(sweep_dir)
    rows = {row["point"]: row for row in csv.DictReader((sweep_dir / "summary.csv").open())}
    assert sorted(rows) == ["lr=0.001", "lr=0.003"]
    for point, row in rows.items():
        ours = [results[name] for name in EXPERIMENTS if name.startswith(point + "/")]
        for column, values in {
            "best_val_acc": [r["metrics"]["best_val_acc"] for r in ours],
            "val_loss": [r["metrics"]["val_loss"] for r in ours],
            "wall_time": [r["wall_time"] for r in ours],
        }.items():
            assert float(row[f"{column}_mean"]) == pytest.approx(sum(values) / 3, abs=1e-12)
            if column != "wall_time":
                std = (sum((v - sum(values) / 3) ** 2 for v in values) / 2) ** 0.5
                assert float(row[f"{column}_std"]) == pytest.approx(std, abs=1e-12)
                half = 4.3027 * std / 3**0.5  # t(0.975, 2 degrees of freedom)
                top = 1.0 if column == "best_val_acc" else math.inf  # the interval ends where accuracy does
                assert float(row[f"{column}_ci95_high"]) == pytest.approx(
                    min(top, statistics.fmean(values) + half), abs=1e-9
                )
        assert (row["runs"], row["done"], row["failed"]) == ("3", "3", "0")
    table = (sweep_dir / "summary.md").read_text()
    assert table in result.stdout and "| lr=0.003 | 3/3 | 0 |" in table


@pytest.mark.slow
def test_one_worker_gives_identical_results_through_main_multi_gpu(two_workers, tmp_path):
    """The design notes' form (main_multi_gpu.py, underscore spellings) runs the same sweep."""
    reference, _ = two_workers
    result = run_sweep(
        [
            "--sweep_dir",
            str(tmp_path),
            "--num_seeds",
            "3",
            "--checkpoint_interval",
            "5",
            *GRID,
            "--workers",
            "1",
            *RUN,
        ],
        entry="main_multi_gpu.py",
    )
    assert_ok(result)
    assert exact_metrics(tmp_path) == exact_metrics(reference)
    assert {record["slot"] for record in read_results(tmp_path).values()} == {"cpu0"}
    for name in EXPERIMENTS:
        assert_same_weights(tmp_path, reference, name)


@pytest.mark.slow
def test_failures_are_isolated_and_a_killed_worker_is_replaced(two_workers, tmp_path):
    """cnn cannot take --mode flatten's vectors (fails at run time); mlp/seed-1's worker is SIGKILLed at step 3."""
    reference, _ = two_workers
    killed = {"MULTIGPU_SWEEP_FAULT_INJECT": "model=mlp/seed-1@0:3"}
    args = [
        "--sweep-dir",
        str(tmp_path),
        "--seeds",
        "0,1",
        "--grid",
        "model=mlp,cnn",
        "--retries",
        "1",
        "--",
        *RUN,
    ]
    result = run_sweep(["--workers", "2", *args], env=killed)
    assert result.returncode == 1, result.stderr
    results = read_results(tmp_path)
    assert {name: r["status"] for name, r in results.items()} == {
        "model=mlp/seed-0": "ok",
        "model=mlp/seed-1": "ok",
        "model=cnn/seed-0": "failed",
        "model=cnn/seed-1": "failed",
    }
    assert "retry   model=mlp/seed-1 (attempt 2 of 2) after: worker died: killed by SIGKILL" in result.stdout
    assert results["model=mlp/seed-1"]["attempt"] == 2
    log = (tmp_path / "model=mlp/seed-1/train.log").read_text()
    assert "resumed from" in log and "step-000000002.pt" in log
    # The retry continued from the killed attempt's checkpoint to exactly the uninterrupted result.
    assert {k: results["model=mlp/seed-1"]["metrics"][k] for k in EXACT} == exact_metrics(reference)[
        "lr=0.001/seed-1"
    ]
    assert results["model=cnn/seed-0"]["exit_status"] == 2 and results["model=cnn/seed-0"]["attempt"] == 1
    error = result.stderr.splitlines()
    assert error[0].startswith("error: 2 of 4 experiments failed")
    assert any(line.startswith("  model=cnn/seed-1: --model cnn needs image samples") for line in error)
    assert "| model=cnn | 0/2 | 2 |" in (tmp_path / "summary.md").read_text()

    again = run_sweep(args)  # failed runs are kept as they are unless asked for
    assert (
        again.returncode == 1
        and "nothing to run" in again.stdout
        and "2 of 4 experiments failed" in again.stderr
    )
    assert read_results(tmp_path) == results
    retried = run_sweep(["--retry-failed", "--workers", "1", *args])
    assert retried.returncode == 1 and retried.stdout.count("FAILED  model=cnn/seed-") == 2
    assert "model=mlp/seed" not in retried.stdout


@pytest.mark.slow
def test_a_killed_sweep_resumes_where_it_stopped(two_workers, tmp_path):
    """The whole sweep is SIGKILLed right after lr=0.003/seed-0 saved its step-2 checkpoint; the same command
    then skips the finished runs, continues the interrupted ones from their checkpoints and ends where an
    uninterrupted sweep ends."""
    reference, _ = two_workers
    args = sweep_args(tmp_path, "--workers", "2")
    first = run_sweep(args, env={"MULTIGPU_SWEEP_FAULT_INJECT": "lr=0.003/seed-0@0:2@sweep"})
    assert first.returncode == -9, first.stderr
    finished = read_results(tmp_path)
    assert len(finished) >= 2 and "lr=0.003/seed-0" not in finished  # it was the 4th of 6 on 2 workers
    mtimes = {name: (tmp_path / name / "last.pt").stat().st_mtime_ns for name in finished}

    second = run_sweep(args)
    assert_ok(second)
    assert f"{len(finished)} done" in second.stdout
    results = read_results(tmp_path)
    assert sorted(results) == sorted(EXPERIMENTS)
    assert {name: (tmp_path / name / "last.pt").stat().st_mtime_ns for name in finished} == mtimes
    for name in finished:
        assert f"{name}:" not in second.stdout  # not run again
    log = (tmp_path / "lr=0.003/seed-0/train.log").read_text()
    assert "resumed from" in log.split("attempt 1")[-1] and "step-000000002.pt" in log
    assert exact_metrics(tmp_path) == exact_metrics(reference)
    for name in EXPERIMENTS:
        assert_same_weights(tmp_path, reference, name)


@pytest.mark.slow
def test_a_changed_base_config_is_refused_on_resume(two_workers):
    sweep_dir, _ = two_workers
    before = (sweep_dir / "results.jsonl").read_bytes()
    result = run_sweep(["--sweep-dir", str(sweep_dir), "--num-seeds", "3", *GRID, "--", *RUN[:-1], "3"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --sweep-dir"), result.stderr
    assert "--epochs 2 (the sweep's) vs 3 (this command's)" in lines[0]
    assert (sweep_dir / "results.jsonl").read_bytes() == before


def guide_sweep_commands() -> list[list[str]]:
    """The sweep commands of the guide's bash blocks (every page; not those marked illustrative, a benchmark of
    minutes), as argv lists after the script name."""
    text = guide_text()
    blocks = re.findall(r"(<!-- illustrative[^\n]*-->\n)?```bash\n(.*?)```", text, re.S)
    return [
        shlex.split(line)[2:]
        for mark, block in blocks
        if not mark
        for line in block.splitlines()
        if line.startswith("python sweep_multi_gpu.py")
    ]


def test_guide_sweep_commands_run_as_written(tmp_path):
    commands = guide_sweep_commands()
    assert len(commands) >= 2
    for argv in commands:
        cut = argv.index("--")
        # One seed, one worker and fewer samples, so the suite stays fast; everything else as written.
        result = run_sweep(
            [
                *argv[:cut],
                "--num-seeds",
                "1",
                "--workers",
                "1",
                "--",
                *argv[cut + 1 :],
                "--train-size",
                "256",
                "--val-size",
                "64",
                "--epochs",
                "1",
                "--no-progress",
            ],
            cwd=tmp_path,
        )
        assert_ok(result)
        expected = (
            "sweep.sbatch: 2 experiments in 2 array tasks"
            if "--slurm" in argv
            else "search done: 4 trials ended"
            if "--search" in argv
            else "sweep done: 2 of 2"
        )
        assert expected in result.stdout
