"""The summary's statistics: Student's t quantile, mean/std/interval, and the tables."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest

from conftest import assert_ok, run_sweep
from multigpu.sweep.options import parse
from multigpu.sweep.plan import build_plan
from multigpu.sweep.records import append_result, read_results
from multigpu.sweep.scheduler import describe_result
from multigpu.sweep.summary import describe, monitored, summarize, t_975, to_csv, to_markdown, within_range


def student_t_cdf(t: float, df: int, steps: int = 20000) -> float:
    """P(T <= t) by Simpson's rule on the density: an independent check of the table and the expansion."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    h = t / steps
    total = density(0) + density(t) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return 0.5 + total * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 4, 9, 29, 30, 31, 45, 99, 1000])
def test_t_quantile_is_the_97_5_percent_point(df):
    assert student_t_cdf(t_975(df), df) == pytest.approx(0.975, abs=2e-5)


def test_mean_std_and_interval_of_a_few_values():
    values = [0.91, 0.93, 0.88, 0.95]
    stats = describe(values)
    assert stats.mean == pytest.approx(np.mean(values), abs=1e-15)
    assert stats.std == pytest.approx(np.std(values, ddof=1), abs=1e-15)
    half = t_975(3) * np.std(values, ddof=1) / 2
    assert (stats.low, stats.high) == pytest.approx(
        (np.mean(values) - half, np.mean(values) + half), abs=1e-15
    )
    one = describe([0.5])
    assert (one.mean, one.std, one.low) == (0.5, None, None)  # no spread from one seed


def test_an_interval_is_clipped_to_the_metrics_range_and_one_inside_it_is_kept():
    wide = within_range(describe([0.2, 1.0]), "val_acc")  # two seeds: mean 0.6 +- 12.7 x 0.4
    assert (wide.low, wide.high, wide.clipped) == (0.0, 1.0, True)
    assert (
        within_range(describe([-5.0, 3.0]), "val_r2").clipped is False
    )  # a metric of unknown range: as it is
    narrow = describe([0.91, 0.93, 0.88, 0.95])
    assert within_range(narrow, "best val_acc") == narrow


def test_the_monitored_metric_of_the_trainer_summary():
    assert monitored({"best_val_acc": 0.9, "val_acc": 0.8}) == ("val_acc", 0.9)
    assert monitored({"monitor": "val_loss", "best": 0.3, "best_val_acc": 0.9}) == ("val_loss", 0.3)


def record(name: str, status: str, best: float, loss: float, seconds: float) -> dict:
    metrics = (
        {"monitor": "val_loss", "best": best, "val_loss": loss, "val_acc": 0.5} if status == "ok" else {}
    )
    return {"experiment": name, "status": status, "metrics": metrics, "wall_time": seconds}


def test_rows_per_grid_point_in_both_tables():
    options, _ = parse(["--num-seeds", "3", "--grid", "lr=0.1,0.2"], environ={})
    plan = build_plan(options, [])
    results = {
        r["experiment"]: r
        for r in [
            record("lr=0.1/seed-0", "ok", 0.30, 0.31, 10.0),
            record("lr=0.1/seed-1", "ok", 0.20, 0.22, 12.0),
            record("lr=0.1/seed-2", "failed", 0, 0, 1.0),
            record("lr=0.2/seed-0", "ok", 0.25, 0.26, 11.0),
        ]
    }
    rows = summarize(plan, results)
    assert [(row.point, row.runs, row.done, row.failed) for row in rows] == [
        ("lr=0.1", 3, 2, 1),
        ("lr=0.2", 3, 1, 0),
    ]
    table = list(csv.DictReader(io.StringIO(to_csv(rows, ["lr"]))))
    assert table[0]["lr"] == "0.1" and float(table[0]["best_val_loss_mean"]) == pytest.approx(0.25)
    assert float(table[0]["best_val_loss_std"]) == pytest.approx(np.std([0.3, 0.2], ddof=1))
    assert float(table[0]["wall_time_mean"]) == pytest.approx(11.0)
    assert table[1]["best_val_loss_std"] == "" and table[1]["val_acc_mean"] == "0.5"
    markdown = to_markdown(rows).splitlines()
    assert markdown[0].startswith(
        "| grid point | done | failed | did not learn | best val_loss (mean ± std) | 95% CI |"
    )
    half = t_975(1) * np.std([0.3, 0.2], ddof=1) / math.sqrt(2)  # 0.635: two seeds give a wide interval
    assert markdown[2].startswith(
        f"| lr=0.1 | 2/3 | 1 | 0 | 0.2500 ± 0.0707 | [0.0000, {0.25 + half:.4f}] (clipped: "
        f"2 seeds are too few) |"
    )  # a loss is not negative
    assert float(table[0]["best_val_loss_ci95_low"]) == 0.0
    assert markdown[3].startswith("| lr=0.2 | 1/3 | 0 | 0 | 0.2500 | — |")


def test_a_run_that_ended_at_chance_is_ok_but_marked_as_not_learned(tmp_path):
    """The trainer says why a run did not learn (its summary's did_not_learn, multigpu/monitoring/plan.py); the
    sweep's line for the run, its closing line and both tables say it, and the run still counts as done."""
    learned = {"monitor": "val_acc", "best": 0.91, "best_val_acc": 0.91, "val_acc": 0.91, "epochs": 2}
    why = "val acc 0.1470, chance for 10 classes is 0.1000"
    at_chance = {**learned, "best": 0.147, "best_val_acc": 0.147, "val_acc": 0.147, "did_not_learn": why}
    for name in ("lr=0.1/seed-0", "lr=0.1/seed-1", "lr=0.2/seed-0", "lr=0.2/seed-1"):
        append_result(
            str(tmp_path / "results.jsonl"),
            {
                "experiment": name,
                "status": "ok",
                "exit_status": 0,
                "error": None,
                "wall_time": 3.0,
                "attempt": 1,
                "metrics": at_chance if name == "lr=0.1/seed-0" else learned,
                "log": "train.log",
                "finished": 1.0,
            },
        )
    result = run_sweep(
        ["--sweep-dir", str(tmp_path), "--num-seeds", "2", "--grid", "lr=0.1,0.2", "--", "--epochs", "2"]
    )
    assert_ok(result)  # every experiment has its result: nothing runs, the summary is written
    assert "sweep done: 4 of 4 experiments ok (1 did not learn: lr=0.1/seed-0); summary " in result.stdout
    assert "| lr=0.1 | 2/2 | 0 | 1 | 0.5285 ± 0.5395 |" in result.stdout
    assert "| lr=0.2 | 2/2 | 0 | 0 | 0.9100 ± 0.0000 |" in result.stdout
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(row["point"], row["done"], row["did_not_learn"]) for row in rows] == [
        ("lr=0.1", "2", "1"),
        ("lr=0.2", "2", "0"),
    ]
    records = read_results(str(tmp_path))
    assert describe_result(records["lr=0.1/seed-0"]) == (
        f"ok, did not learn  lr=0.1/seed-0: best val_acc 0.1470, val_acc 0.1470, 2 epochs, 3.0s ({why})"
    )
    assert describe_result(records["lr=0.1/seed-1"]).startswith("ok      lr=0.1/seed-1: best val_acc 0.9100")
