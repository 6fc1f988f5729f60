"""The sweep's summary: per grid point, mean +- std and a 95% confidence interval over its seeds.

DIR/summary.csv (full precision, one column per statistic) and DIR/summary.md (a table to read) are
written from the merged results of every shard. The interval is mean +- t(0.975, n-1) * std / sqrt(n)
(Student's t, sample std with n-1): a 95% interval for the mean over seeds of that grid point. With few
seeds it is wide (t is 12.7 for two), and is clipped to the values the metric can take (accuracy in [0, 1],
losses and errors not below 0); the table says where it was.
"""

from __future__ import annotations

import csv
import io
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from multigpu.sweep.plan import Plan
from multigpu.sweep.records import write_text_atomic

# t(0.975, df) for df = 1..30, to 4 decimals (any statistics table); above 30 the Cornish-Fisher
# expansion below is within 1e-4 of it (tests/sweep/test_sweep_summary.py integrates the density to check).
T_975 = (
    12.7062,
    4.3027,
    3.1824,
    2.7764,
    2.5706,
    2.4469,
    2.3646,
    2.3060,
    2.2622,
    2.2281,
    2.2010,
    2.1788,
    2.1604,
    2.1448,
    2.1314,
    2.1199,
    2.1098,
    2.1009,
    2.0930,
    2.0860,
    2.0796,
    2.0739,
    2.0687,
    2.0639,
    2.0595,
    2.0555,
    2.0518,
    2.0484,
    2.0452,
    2.0423,
)
Z_975 = 1.959963984540054


def t_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (the factor of a 95% interval)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / df ** (power + 1) for power, term in enumerate(terms))


@dataclass(frozen=True)
class Stats:
    """mean, std and the 95% interval of n values (std and interval need n >= 2)."""

    n: int
    mean: float | None
    std: float | None
    low: float | None
    high: float | None
    clipped: bool = False  # the interval reached past the metric's range (few seeds) and was cut at its ends


def describe(values: Sequence[float]) -> Stats:
    values = [float(value) for value in values]
    if not values:
        return Stats(0, None, None, None, None)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Stats(1, mean, None, None, None)
    std = statistics.stdev(values)
    half = t_975(len(values) - 1) * std / math.sqrt(len(values))
    return Stats(len(values), mean, std, mean - half, mean + half)


def did_not_learn(record: dict[str, Any]) -> str | None:
    """Why a finished run did not learn, as its trainer said (its summary's `did_not_learn`: the loss did not fall
    or diverged, or the last validation accuracy stayed at chance for its number of classes, multigpu/monitoring/plan.py
    chance_accuracy); None when it learned, failed, or is from a trainer that did not say."""
    return record["metrics"].get("did_not_learn") if record.get("status") == "ok" else None


def monitored(metrics: dict[str, Any]) -> tuple[str, float | None]:
    """The monitored metric's name and best value in a run's summary (older trainers: best val accuracy)."""
    name = metrics.get("monitor", "val_acc")
    return name, metrics.get("best", metrics.get("best_val_acc"))


@dataclass
class PointSummary:
    """One grid point's row."""

    point: str
    values: dict[str, Any]  # the grid values
    runs: int
    done: int
    failed: int
    not_learned: int  # of the done ones: ended at chance, or their loss did not fall (did_not_learn)
    metrics: dict[str, Stats]  # "best <monitor>", then the last val_* metrics
    wall_time: Stats


def summarize(plan: Plan, records: dict[str, dict[str, Any]]) -> list[PointSummary]:
    """One row per grid point of `plan`, from the latest record of each of its experiments."""
    rows = []
    for point, values in plan.points:
        experiments = [e for e in plan.experiments if e.point == point]
        finished = [records[e.name] for e in experiments if e.name in records]
        ok = [record for record in finished if record["status"] == "ok"]
        rows.append(
            PointSummary(
                point,
                values,
                len(experiments),
                len(ok),
                len(finished) - len(ok),
                sum(did_not_learn(record) is not None for record in ok),
                _metric_stats([record["metrics"] for record in ok]),
                describe([record["wall_time"] for record in ok]),
            )
        )
    return rows


def _metric_stats(summaries: list[dict[str, Any]]) -> dict[str, Stats]:
    columns: dict[str, list[float]] = {}
    for metrics in summaries:
        name, best = monitored(metrics)
        if best is not None:
            columns.setdefault(f"best {name}", []).append(best)
    for name in sorted({key for metrics in summaries for key in metrics if key.startswith("val_")}):
        columns[name] = [
            metrics[name] for metrics in summaries if isinstance(metrics.get(name), (int, float))
        ]
    return {name: within_range(describe(values), name) for name, values in columns.items()}


def metric_range(name: str) -> tuple[float, float]:
    """The values a metric can take: accuracies in [0, 1], losses and errors from 0 up, others any."""
    if "acc" in name:
        return 0.0, 1.0
    if any(word in name for word in ("loss", "mse", "mae")):
        return 0.0, math.inf
    return -math.inf, math.inf


def within_range(stats: Stats, name: str) -> Stats:
    """The interval cut to the metric's range: an accuracy interval of [-0.4993, 1.9160] says only "few seeds"."""
    low, high = metric_range(name)
    if stats.low is None or stats.high is None or (low <= stats.low and stats.high <= high):  # None together
        return stats
    return replace(stats, low=max(low, stats.low), high=min(high, stats.high), clipped=True)


def metric_names(rows: list[PointSummary]) -> list[str]:
    """Every metric column, the monitored best first, in a stable order."""
    names: list[str] = []
    for row in rows:
        names += [name for name in row.metrics if name not in names]
    return sorted(names, key=lambda name: (not name.startswith("best "), name))


def to_csv(rows: list[PointSummary], grid_fields: list[str]) -> str:
    names = metric_names(rows)
    header = ["point", *grid_fields, "runs", "done", "failed", "did_not_learn"]
    for name in names:
        key = name.replace(" ", "_")
        header += [f"{key}_mean", f"{key}_std", f"{key}_ci95_low", f"{key}_ci95_high"]
    header.append("wall_time_mean")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        cells: list[Any] = [
            row.point,
            *[row.values[field] for field in grid_fields],
            row.runs,
            row.done,
            row.failed,
            row.not_learned,
        ]
        for name in names:
            stats = row.metrics.get(name, describe([]))
            cells += [_blank(stats.mean), _blank(stats.std), _blank(stats.low), _blank(stats.high)]
        cells.append(_blank(row.wall_time.mean))
        writer.writerow(cells)
    return out.getvalue()


def to_markdown(rows: list[PointSummary]) -> str:
    names = metric_names(rows)
    first_name = [f"{names[0]} (mean ± std)", "95% CI"] if names else []
    header = [
        "grid point",
        "done",
        "failed",
        "did not learn",
        *first_name,
        *[f"{name} (mean ± std)" for name in names[1:]],
        "wall time (s)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        stats = [row.metrics.get(name, describe([])) for name in names]
        first = [_mean_std(stats[0]), _interval(stats[0])] if stats else []
        cells = [
            row.point or "(no grid)",
            f"{row.done}/{row.runs}",
            str(row.failed),
            str(row.not_learned),
            *first,
            *[_mean_std(s) for s in stats[1:]],
            _mean_std(row.wall_time, digits=1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(sweep_dir: str, rows: list[PointSummary], grid_fields: list[str]) -> str:
    """Write summary.csv and summary.md into the sweep dir (atomically); return the markdown."""
    markdown = to_markdown(rows)
    write_text_atomic(os.path.join(sweep_dir, "summary.csv"), to_csv(rows, grid_fields))
    write_text_atomic(os.path.join(sweep_dir, "summary.md"), markdown)
    return markdown


def _blank(value: float | None) -> Any:
    return "" if value is None else repr(value)


def _mean_std(stats: Stats, digits: int = 4) -> str:
    if stats.mean is None:
        return "—"
    if stats.std is None:
        return f"{stats.mean:.{digits}f}"
    return f"{stats.mean:.{digits}f} ± {stats.std:.{digits}f}"


def _interval(stats: Stats) -> str:
    if stats.low is None:
        return "—"
    return f"[{stats.low:.4f}, {stats.high:.4f}]" + (
        f" (clipped: {stats.n} seeds are too few)" if stats.clipped else ""
    )
