"""Experiment trackers beside TensorBoard (--logger csv,mlflow,wandb): rank 0's Reporter hands each of them
the scalars it writes to TensorBoard, at the same steps, at the same sync points (no host sync of their own).

- csv: `metrics.csv` in the save-dir, one `step,name,value` row per scalar; no dependency.
- mlflow (pip install '.[mlflow]'): MLflow's database store, `sqlite:///<save-dir>/mlflow.db` (which
  MLflow's own client and `mlflow ui` open as they are), unless MLFLOW_TRACKING_URI names another;
  MLFLOW_EXPERIMENT_NAME picks the experiment.
- wandb (pip install '.[wandb]'): a run under `<save-dir>/wandb` unless WANDB_DIR; WANDB_MODE=offline,
  WANDB_PROJECT and the other WANDB_ variables apply as wandb reads them.

The config goes to each once, as its parameters, when its run is created. Each
run's id is kept in the checkpoint ("trackers"), so `--resume auto` continues
the same run. A resumed run logs no step twice: TensorBoard and metrics.csv drop
the steps past the checkpoint that a killed run logged, and MLflow and W&B, which
cannot drop a point, get only the steps after the last one their run holds (noted
in `<save-dir>/.trackers-logged.json` before the scalars that make it held are
logged). A tracker that cannot be reached or written at the start is refused in
one line within seconds (tracker_probe.py); one that fails mid-run (network,
disk) is said in one line and left off; training goes on (MULTI_GPU_GUIDE.md,
"Experiment trackers").
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import logging
import os
from collections.abc import Iterator
from typing import Any, Callable, Protocol

from multigpu import safe_files
from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.monitoring import tracker_probe

CSV_FILE = "metrics.csv"
CSV_HEADER = ["step", "name", "value"]
MLFLOW_DB = "mlflow.db"  # MLflow's database store in the save-dir, unless MLFLOW_TRACKING_URI names another
LOGGED_FILE = ".trackers-logged.json"  # {tracker: {"run": id, "step": the last step its run holds}}
# --logger name -> (the module it imports, the pyproject extra that installs it)
LIBRARIES = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
DATABASE_LIBRARIES = ("sqlalchemy", "alembic")  # what MLflow's database store needs beyond mlflow-skinny
DEFAULT_PROJECT = "multigpu-trainer"  # W&B's project (and MLflow's run tag) when the environment names none
# MLflow's loggers, quieted while a tracker is called (mlflow.store.db.utils sets a level of its own: its lines on
# creating the database's tables say nothing to the user).
QUIETED_LOGGERS = ("mlflow", "mlflow.store.db.utils")
WANDB_FLUSH_SECONDS = 1.0  # how often W&B writes its run's file (x_transaction_log_flush_interval)


def check_installed(config: TrainConfig) -> None:
    """UsageError (one line) naming the extra to install for a --logger whose library is missing. Cheap (no
    import), so every rank reaches the same verdict at start."""
    for name in config.loggers:
        module, extra = LIBRARIES.get(name, (None, None))
        wanted = [module, *(DATABASE_LIBRARIES if name == "mlflow" and _database_store() else ())]
        missing = [library for library in wanted if library is not None and not _importable(library)]
        if missing:
            raise UsageError(
                f"--logger {name} needs the {' and '.join(missing)} librar"
                f"{'ies, which are' if len(missing) > 1 else 'y, which is'} not installed: "
                f"pip install '.[{extra}]' (or leave {name} out of --logger)"
            )


def mlflow_uri(config: TrainConfig) -> str:
    """MLFLOW_TRACKING_URI, else MLflow's database store in the save-dir, which its client and `mlflow ui` read
    as they are (its file store they open only when MLFLOW_ALLOW_FILE_STORE says yes, since MLflow 3.7)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath(
        os.path.join(config.save_dir or ".", MLFLOW_DB)
    )


def _database_store() -> bool:
    """Whether MLflow's runs go to a database (its default here), not to a tracking server."""
    return os.environ.get("MLFLOW_TRACKING_URI", "sqlite:").split(":", 1)[0] not in (
        "http",
        "https",
        "databricks",
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules holds None for it: its import is blocked
        return False


class CsvTracker:
    """metrics.csv: a row per scalar, appended at each sync point; a resumed run first drops the rows of steps
    it will log again, as TensorBoard's purge_step does."""

    name = "csv"
    keeps_every_point = False  # it drops a killed run's steps past the checkpoint itself

    def __init__(self, config: TrainConfig, run_id: str | None, purge_step: int | None):
        self.path = os.path.join(config.save_dir or ".", CSV_FILE)
        self.run_id = run_id or "metrics.csv"
        if purge_step is not None and os.path.exists(self.path):
            with open(self.path, newline="") as file:
                rows = [row for row in csv.reader(file)]
            kept = [row for row in rows[1:] if row and int(row[0]) < purge_step]
            self._rewrite(kept)
        elif not os.path.exists(self.path):
            self._rewrite([])

    def _rewrite(self, rows: list[list[str]]) -> None:
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([CSV_HEADER, *rows])
        safe_files.write_atomically(self.path, text.getvalue())

    def scalars(self, values: dict[str, float], step: int) -> None:
        # Opened at each sync point, not held: a file replaced or removed meanwhile fails here, in one line.
        with safe_files.open_no_follow(self.path, "a", newline="") as file:
            csv.writer(file, lineterminator="\n").writerows(
                [step, name, repr(float(value))] for name, value in values.items()
            )

    def summary(self, metrics: dict[str, float]) -> None:
        self.scalars(metrics, 0)  # where TensorBoard's hparams plugin puts them

    def close(self) -> None:
        """Nothing held open."""


class MlflowTracker:
    """An MLflow run: the config as its parameters, the scalars as metrics at their steps."""

    name = "mlflow"
    keeps_every_point = True  # a metric's points cannot be dropped: a resumed run must not log a step again

    def __init__(self, config: TrainConfig, run_id: str | None, purge_step: int | None):
        from mlflow.tracking import MlflowClient

        uri = mlflow_uri(config)
        tracker_probe.bound_mlflow_requests()  # a server lost mid-run: seconds, then left off
        # Its lines on creating the database's tables, and its error logs, are quieted by Trackers._guarded.
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = run_id if run_id is not None else self._new_run(config)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")

    def _new_run(self, config: TrainConfig) -> str:
        """A run named after the save-dir, the config as its parameters; its id."""
        from mlflow.entities import Param

        run_id = self.client.create_run(
            self._experiment(), run_name=_run_name(config), tags={"mlflow.source.name": DEFAULT_PROJECT}
        ).info.run_id
        params = [Param(key, "" if value is None else str(value)) for key, value in config.to_dict().items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(run_id, params=params[start : start + 100])
        return run_id

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def held_after(self, step: int) -> int:
        """The last step the run holds once `step` is logged: `step` itself (each call is written at once)."""
        return step

    def scalars(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(name, float(value), now, step) for name, value in values.items()]
        )

    def summary(self, metrics: dict[str, float]) -> None:
        self.scalars(metrics, 0)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A Weights & Biases run: the config once, the scalars at their steps, the final metrics as its summary."""

    name = "wandb"
    keeps_every_point = True  # an offline run resumed writes a file of its own: its steps must be new ones

    def __init__(self, config: TrainConfig, run_id: str | None, purge_step: int | None):
        import wandb

        settings: dict[str, Any] = {
            key: value
            for key, value in (("console", "off"), ("silent", True))
            if f"WANDB_{key.upper()}" not in os.environ
        }  # ours: the trainer's console is its own
        # W&B writes its run's file every 15 s by default: a run killed outright lost that much of it, and a
        # resumed run logs only the steps after those it held (Trackers.held). Every second where W&B has it.
        if (
            "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {})
            and "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL" not in os.environ
        ):
            settings["x_transaction_log_flush_interval"] = WANDB_FLUSH_SECONDS
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=os.environ.get("WANDB_NAME") or _run_name(config),
            dir=os.environ.get("WANDB_DIR") or config.save_dir,
            id=run_id or os.environ.get("WANDB_RUN_ID"),
            resume="allow" if run_id else None,
            config=None if run_id else config.to_dict(),
            settings=wandb.Settings(**settings),
        )
        self.run_id = self.run.id
        self.committed, self.pending = 0, 0  # W&B writes a step's row once a later step is logged

    def held_after(self, step: int) -> int:
        """The last step the run holds once `step` is logged: the one logged before it, committed by it."""
        return self.pending if step > self.pending else self.committed

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.committed, self.pending = self.held_after(step), max(step, self.pending)
        self.run.log(dict(values), step=step)

    def summary(self, metrics: dict[str, float]) -> None:
        self.run.summary.update(metrics)

    def close(self) -> None:
        self.run.finish()


class Tracker(Protocol):
    """What every tracker above offers Trackers: its run's id (kept in the checkpoint), scalars, the summary."""

    run_id: str

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def summary(self, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


TRACKERS: dict[str, Callable[[TrainConfig, str | None, int | None], Tracker]] = {
    "csv": CsvTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}


def _run_name(config: TrainConfig) -> str:
    """The run's name in a tracker: its save-dir's folder name (run-3, or the --save-dir given)."""
    return os.path.basename(os.path.normpath(os.path.abspath(config.save_dir or ".")))


@contextlib.contextmanager
def _quiet(logger: str, level: int = logging.WARNING) -> Iterator[None]:
    """`logger`'s lines below `level` left out while the block runs (by default its INFO lines: its warnings
    still shown)."""
    quieted = logging.getLogger(logger)
    previous = quieted.level
    quieted.setLevel(level)
    try:
        yield
    finally:
        quieted.setLevel(previous)


def _read_logged(path: str) -> dict[str, Any]:
    """LOGGED_FILE's record, or an empty one where there is none (or it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


class Trackers:
    """Rank 0's trackers (none elsewhere), opened at their first scalars so a resume has set their run ids;
    their ids are checkpoint state (DCP's Stateful protocol: state_dict/load_state_dict)."""

    def __init__(self, config: TrainConfig, enabled: bool, say: Callable[[str], None]):
        check_installed(config)
        self.config, self.say = config, say
        self.names = [name for name in config.loggers if name in TRACKERS] if enabled else []
        self.open: dict[str, Any] | None = None
        self.ids: dict[str, str] = {}  # each tracker's run, from the checkpoint a resume loaded
        self.logged_path = os.path.join(config.save_dir or ".", LOGGED_FILE)
        self.logged: dict[
            str, Any
        ] = {}  # LOGGED_FILE's record: the last step each run that keeps every point holds
        self.held: dict[
            str, int
        ] = {}  # of a resumed run: the last step it held before this run, not logged again

    def refusal(self) -> str | None:
        """The one line refusing a tracker that cannot be reached or written (tracker_probe: seconds at most),
        or None; None where this rank logs nothing."""
        return tracker_probe.refusal(self.config, mlflow_uri(self.config)) if self.names else None

    def state_dict(self) -> dict[str, str]:
        return dict(self.ids)

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.ids = dict(state)

    def start(self, purge_step: int | None) -> None:
        """Open each tracker's run (a resumed run's own, by its id in the checkpoint)."""
        if self.open is not None:
            return
        self.open = {}
        self.logged = _read_logged(self.logged_path) if self.names else {}
        for name in self.names:
            resumed = self.ids.get(name) if purge_step is not None else None
            self._guarded(name, lambda: self._open(name, resumed, purge_step), opening=True)
            noted = self.logged.get(name, {})
            if (
                resumed is not None and noted.get("run") == resumed
            ):  # the steps a killed run logged past its checkpoint
                self.held[name] = int(noted.get("step", 0))

    def _open(self, name: str, resumed: str | None, purge_step: int | None) -> None:
        tracker = TRACKERS[name](self.config, resumed, purge_step)
        assert self.open is not None  # start() made it
        self.open[name] = tracker
        self.ids[name] = tracker.run_id  # kept even if it fails later: a resume continues its run

    def scalars(self, values: dict[str, float], step: int) -> None:
        """`values` at `step` to every open tracker; to one that keeps every point, only past the last step its
        resumed run already holds."""
        for name, tracker in list((self.open or {}).items()):
            if step > self.held.get(name, 0):
                self._guarded(name, lambda: self._log(name, tracker, values, step))

    def _log(self, name: str, tracker: Any, values: dict[str, float], step: int) -> None:
        """One tracker's scalars; for one that keeps every point, what its run holds once they are logged is noted
        first (a kill in between leaves a step out of it, never one twice)."""
        if tracker.keeps_every_point:
            self._note_held(name, tracker.held_after(step))
        tracker.scalars(values, step)

    def _note_held(self, name: str, step: int) -> None:
        """LOGGED_FILE says that tracker `name`'s run holds `step` (rewritten only where that is news)."""
        noted = self.logged.get(name, {})
        if noted.get("run") == self.ids[name] and step <= noted.get("step", 0):
            return
        self.logged[name] = {"run": self.ids[name], "step": step}
        safe_files.write_atomically(self.logged_path, json.dumps(self.logged, sort_keys=True) + "\n")

    def summary(self, metrics: dict[str, float]) -> None:
        for name, tracker in list((self.open or {}).items()):
            self._guarded(name, lambda: tracker.summary(metrics))

    def close(self) -> None:
        opened, self.open = self.open or {}, None
        for name, tracker in opened.items():
            self._guarded(name, tracker.close)

    def _guarded(self, name: str, call: Callable[[], Any], opening: bool = False) -> None:
        """`call`, or, when it fails, one line and the tracker off for the rest of the run: a tracker never
        stops training (TensorBoard and the checkpoints go on)."""
        try:
            with contextlib.ExitStack() as quieted:
                for (
                    logger
                ) in QUIETED_LOGGERS:  # their INFO lines, error logs and tracebacks: the line below says it
                    quieted.enter_context(_quiet(logger, logging.CRITICAL))
                call()
        except Exception as error:
            if self.open is not None:
                self.open.pop(name, None)
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            self.say(
                f"warning: --logger {name} failed {'to start' if opening else 'mid-run'} ({detail}); it logs "
                f"nothing more in this run, training goes on"
            )
