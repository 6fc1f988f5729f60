"""What a search shows besides its table: TensorBoard's HParams dashboard of the trials, and Optuna's plots.

    DIR/hparams/                     the study's settings and metrics (TensorBoard's hparams plugin)
    DIR/hparams/trial-<n>/           one session per ended trial: its settings, state, value and epochs trained
    DIR/optimization_history.png     Optuna's own plots, where matplotlib is installed
    DIR/param_importances.png
    DIR/intermediate_values.png

`tensorboard --logdir DIR/hparams` compares the trials in its HParams tab (each run's own curves stay in
DIR/trial-<n>/seed-<k>/tb). Both are rewritten whole at the end of every driver's sweep, under the summary's lock.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

from multigpu import safe_files
from multigpu.monitoring.event_file import EventFile
from multigpu.sweep.search_summary import STATES, TrialRow
from multigpu.sweep.space import Dimension
from multigpu.sweep.study import trial_point

HPARAMS_DIR = "hparams"
PLOTS = (
    "optimization_history",
    "param_importances",
    "intermediate_values",
)  # optuna.visualization's plot_<name>
EPOCHS_TRAINED = "epochs_trained"  # a metric of each session, beside the objective (not the --epochs setting)
ENDED = [STATES[name] for name in ("COMPLETE", "PRUNED", "FAIL")]


def write_hparams(
    sweep_dir: str, space: Sequence[Dimension], objective: str, rows: Sequence[TrialRow]
) -> str:
    """DIR/hparams: the study's settings (with their ranges) and metrics, and a session per ended trial, written
    with TensorBoard's hparams plugin API into a new folder that then replaces the old one. Returns its path."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    settings = {dimension.name: hp.HParam(dimension.name, _domain(hp, dimension)) for dimension in space}
    state = hp.HParam("state", hp.Discrete(ENDED))
    metrics = [
        hp.Metric(objective, display_name=f"{objective} (the trial's value)"),
        hp.Metric(EPOCHS_TRAINED, display_name="epochs trained"),
    ]
    final = os.path.join(sweep_dir, HPARAMS_DIR)
    folder = tempfile.mkdtemp(prefix=f".{HPARAMS_DIR}.", suffix=safe_files.TMP_SUFFIX, dir=sweep_dir)
    _write_events(folder, [hp.hparams_config_pb([*settings.values(), state], metrics)], {})
    for row in rows:
        if row.state not in ENDED:
            continue
        values = {settings[name]: _shown(value) for name, value in row.params.items() if name in settings}
        session = hp.hparams_pb({**values, state: row.state}, trial_id=trial_point(row.number))
        scalars = {
            name: value
            for name, value in ((objective, row.value), (EPOCHS_TRAINED, row.epochs))
            if value is not None
        }
        _write_events(os.path.join(folder, trial_point(row.number)), [session], scalars, step=row.epochs or 0)
    safe_files.replace_folder(folder, final)
    return final


def _domain(hp: Any, dimension: Dimension) -> Any:
    if dimension.kind == "choice":
        return hp.Discrete([_shown(value) for value in dimension.values])
    low, high = dimension.values
    return hp.IntInterval(low, high) if dimension.whole else hp.RealInterval(float(low), float(high))


def _shown(value: Any) -> Any:
    return (
        "" if value is None else value
    )  # TensorBoard's hparams take no None: shown as '', as a run's own are


def _write_events(folder: str, summaries: list[Any], scalars: dict[str, float], step: int = 0) -> None:
    events = EventFile(folder)
    try:
        for summary in summaries:
            events.add_summary(summary, step)
        if scalars:
            events.scalars(scalars, step)
    finally:
        events.close()


def write_plots(sweep_dir: str, study: Any) -> str:
    """Optuna's plots of the study as DIR/<plot>.png (matplotlib's Agg backend: no display needed); returns a line
    saying what was drawn, or why not (matplotlib missing, too few trials for a plot)."""
    try:
        import matplotlib
    except ImportError:
        return "plots: matplotlib is not installed, so none were drawn (pip install matplotlib draws them)"
    if all(trial.value is None for trial in study.get_trials(deepcopy=False)):
        return "plots: none drawn, as no trial has a value yet"
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as plots

    drawn, skipped, notes = [], [], []
    for name in PLOTS:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                axes = getattr(plots, f"plot_{name}")(study)
            except (ValueError, RuntimeError) as error:  # e.g. importances need two complete trials
                skipped.append(f"{name} ({_first_line(error)})")
                continue
        # Optuna's word on a plot (few trials: importances drawn equal) goes into the line, not onto stderr.
        notes += [
            f"{name}: {_first_line(w.message)}"
            for w in said
            if not issubclass(w.category, optuna.exceptions.ExperimentalWarning)
        ]  # said of every such plot
        image = io.BytesIO()
        axes.figure.savefig(image, format="png", dpi=100, bbox_inches="tight")
        plt.close(axes.figure)
        path = os.path.join(sweep_dir, f"{name}.png")
        safe_files.write_atomically(path, image.getvalue())  # never through a link planted in the sweep dir
        drawn.append(path)
    said_line = f"plots: {', '.join(drawn)}" if drawn else "plots: none drawn"
    return (
        said_line
        + "".join(f"; not drawn: {text}" for text in skipped)
        + "".join(f"; {text}" for text in notes)
    )


def _first_line(message: Any) -> str:
    return (str(message).strip().splitlines() or [""])[0]
