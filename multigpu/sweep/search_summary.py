"""A search's summary: one row per trial of the study (its number, state, value, the epochs its runs trained, its
settings, their wall time), the best trial and the command that trains it, in DIR/summary.md and DIR/summary.csv.

A trial's value is the study's: the mean over its seeds of each run's best --monitor value for a complete trial,
the value it was last reported at for a pruned one. The rows come from the journal (every shard's trials) and the
runs' results (their epochs and wall times).
"""

from __future__ import annotations

import csv
import io
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from multigpu.sweep.records import write_text_atomic
from multigpu.sweep.space import Dimension
from multigpu.sweep.study import ERROR_ATTR, trial_point

STATES = {
    "COMPLETE": "complete",
    "PRUNED": "pruned",
    "FAIL": "failed",
    "RUNNING": "running",
    "WAITING": "waiting",
}


@dataclass(frozen=True)
class TrialRow:
    """One trial's line."""

    number: int
    state: str  # complete, pruned, failed, running (a driver still runs it, or was stopped), waiting
    value: float | None
    epochs: int | None  # trained by its runs together; None before any ended
    params: dict[str, Any]
    wall_time: float | None  # of its runs together
    error: str | None = None  # a failed trial's: the first of its runs' errors


def trial_rows(
    trials: Sequence[Any], results: dict[str, dict[str, Any]], seeds: Sequence[int]
) -> list[TrialRow]:
    """The rows of the study's `trials` (Optuna's FrozenTrials), with their runs' `results`."""
    rows = []
    for trial in sorted(trials, key=lambda trial: trial.number):
        runs = [
            results[name]
            for name in (f"{trial_point(trial.number)}/seed-{seed}" for seed in seeds)
            if name in results
        ]
        ended = [run for run in runs if run["status"] in ("ok", "pruned")]
        errors = [run["error"] for run in runs if run["status"] == "failed"] + [
            trial.user_attrs.get(ERROR_ATTR)
        ]
        rows.append(
            TrialRow(
                trial.number,
                STATES.get(trial.state.name, trial.state.name.lower()),
                trial.value,
                sum(run["metrics"].get("epochs", 0) for run in ended) if ended else None,
                dict(trial.params),
                sum(run["wall_time"] for run in runs) if runs else None,
                next(filter(None, errors), None),
            )
        )
    return rows


def best(rows: Sequence[TrialRow], lower_is_better: bool) -> TrialRow | None:
    """The complete trial of the best value (the first of equals), None before one completed."""
    complete = [row for row in rows if row.state == "complete" and row.value is not None]
    if not complete:
        return None
    return (min if lower_is_better else max)(complete, key=_value)


def _value(row: TrialRow) -> float:
    assert row.value is not None  # a complete trial's
    return row.value


def command(train_argv: Sequence[str], flags: Sequence[str], seeds: Sequence[int]) -> str:
    """The command line that trains a trial's settings as its first run did (its --seed, unless the default)."""
    seed = ["--seed", str(seeds[0])] if seeds[0] != 0 else []
    return shlex.join(["python", "main_multi_gpu.py", *train_argv, *flags, *seed])


def to_markdown(rows: Sequence[TrialRow], objective: str, names: Sequence[str]) -> str:
    header = ["trial", "state", objective, "epochs trained", *names, "wall time (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            str(row.number),
            row.state,
            _number(row.value, ".4f"),
            _number(row.epochs, "d"),
            *[_number(row.params.get(name), ".4g") for name in names],
            _number(row.wall_time, ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[TrialRow], names: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["trial", "state", "value", "epochs_trained", *names, "wall_time"])
    for row in rows:
        writer.writerow(
            [
                row.number,
                row.state,
                _full(row.value),
                _full(row.epochs),
                *[_full(row.params.get(name)) for name in names],
                _full(row.wall_time),
            ]
        )
    return out.getvalue()


def write(sweep_dir: str, rows: Sequence[TrialRow], objective: str, space: Sequence[Dimension]) -> str:
    """Write summary.csv and summary.md into the sweep dir (atomically); return the markdown."""
    names = [dimension.name for dimension in space]
    markdown = to_markdown(rows, objective, names)
    write_text_atomic(os.path.join(sweep_dir, "summary.csv"), to_csv(rows, names))
    write_text_atomic(os.path.join(sweep_dir, "summary.md"), markdown)
    return markdown


def _number(value: Any, spec: str) -> str:
    if value is None:
        return "—"
    return (
        format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
    )


def _full(value: Any) -> Any:
    return "" if value is None else repr(value) if isinstance(value, float) else value
