"""Experiment trackers beside TensorBoard (--logger csv,mlflow,wandb): rank 0's Reporter hands each of them
the scalars it writes to TensorBoard, at the same steps, at the same sync points (no host sync of their own).

- csv: `metrics.csv` in the save-dir, one `step,name,value` row per scalar; no dependency.
- mlflow (pip install '.[mlflow]'): a local file store, `<save-dir>/mlruns`, unless
  MLFLOW_TRACKING_URI names another; MLFLOW_EXPERIMENT_NAME picks the experiment.
- wandb (pip install '.[wandb]'): a run under `<save-dir>/wandb` unless WANDB_DIR; WANDB_MODE=offline,
  WANDB_PROJECT and the other WANDB_ variables apply as wandb reads them.

The config goes to each once, as its parameters, when its run is created. Each
run's id is kept in the checkpoint ("trackers"), so `--resume auto` continues
the same run. A tracker that fails mid-run (network, disk) is said in one line
and left off; training goes on (MULTI_GPU_GUIDE.md, "Experiment trackers").
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
from typing import Any, Callable, Optional

from multigpu import safe_files
from multigpu.config import TrainConfig
from multigpu.errors import UsageError

CSV_FILE = "metrics.csv"
CSV_HEADER = ["step", "name", "value"]
# --logger name -> (the module it imports, the pyproject extra that installs it)
LIBRARIES = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
DEFAULT_PROJECT = "multigpu-trainer"  # W&B's project (and MLflow's run tag) when the environment names none


def check_installed(config: TrainConfig) -> None:
    """UsageError (one line) naming the extra to install for a --logger whose library is missing. Cheap (no
    import), so every rank reaches the same verdict at start."""
    for name in config.loggers:
        module, extra = LIBRARIES.get(name, (None, None))
        if module is not None and not _importable(module):
            raise UsageError(f"--logger {name} needs the {module} library, which is not installed: "
                             f"pip install '.[{extra}]' (or leave {name} out of --logger)")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules holds None for it: its import is blocked
        return False


class CsvTracker:
    """metrics.csv: a row per scalar, appended at each sync point; a resumed run first drops the rows of steps
    it will log again, as TensorBoard's purge_step does."""

    name = "csv"

    def __init__(self, config: TrainConfig, run_id: Optional[str], purge_step: Optional[int]):
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
            csv.writer(file, lineterminator="\n").writerows([step, name, repr(float(value))]
                                                            for name, value in values.items())

    def summary(self, metrics: dict[str, float]) -> None:
        self.scalars(metrics, 0)  # where TensorBoard's hparams plugin puts them

    def close(self) -> None:
        """Nothing held open."""


class MlflowTracker:
    """An MLflow run: the config as its parameters, the scalars as metrics at their steps."""

    name = "mlflow"

    def __init__(self, config: TrainConfig, run_id: Optional[str], purge_step: Optional[int]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the file store under the save-dir; MLflow asks for an explicit yes to it since 3.7
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file:" + os.path.abspath(os.path.join(config.save_dir or ".", "mlruns"))
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        run = self.client.create_run(self._experiment(), run_name=_run_name(config),
                                     tags={"mlflow.source.name": DEFAULT_PROJECT})
        self.run_id = run.info.run_id
        params = [Param(key, "" if value is None else str(value)) for key, value in config.to_dict().items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def scalars(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, float(value), now, step)
                                                    for name, value in values.items()])

    def summary(self, metrics: dict[str, float]) -> None:
        self.scalars(metrics, 0)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A Weights & Biases run: the config once, the scalars at their steps, the final metrics as its summary."""

    name = "wandb"

    def __init__(self, config: TrainConfig, run_id: Optional[str], purge_step: Optional[int]):
        import wandb

        settings = {key: value for key, value in (("console", "off"), ("silent", True))
                    if f"WANDB_{key.upper()}" not in os.environ}  # ours: the trainer's console is its own
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                              name=os.environ.get("WANDB_NAME") or _run_name(config),
                              dir=os.environ.get("WANDB_DIR") or config.save_dir,
                              id=run_id or os.environ.get("WANDB_RUN_ID"),
                              resume="allow" if run_id else None,
                              config=None if run_id else config.to_dict(), settings=wandb.Settings(**settings))
        self.run_id = self.run.id

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def summary(self, metrics: dict[str, float]) -> None:
        self.run.summary.update(metrics)

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"csv": CsvTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}


def _run_name(config: TrainConfig) -> str:
    """The run's name in a tracker: its save-dir's folder name (run-3, or the --save-dir given)."""
    return os.path.basename(os.path.normpath(os.path.abspath(config.save_dir or ".")))


class Trackers:
    """Rank 0's trackers (none elsewhere), opened at their first scalars so a resume has set their run ids;
    their ids are checkpoint state (DCP's Stateful protocol: state_dict/load_state_dict)."""

    def __init__(self, config: TrainConfig, enabled: bool, say: Callable[[str], None]):
        check_installed(config)
        self.config, self.say = config, say
        self.names = [name for name in config.loggers if name in TRACKERS] if enabled else []
        self.open: Optional[dict[str, Any]] = None
        self.ids: dict[str, str] = {}  # each tracker's run, from the checkpoint a resume loaded

    def state_dict(self) -> dict[str, str]:
        return dict(self.ids)

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.ids = dict(state)

    def start(self, purge_step: Optional[int]) -> None:
        """Open each tracker's run (a resumed run's own, by its id in the checkpoint)."""
        if self.open is not None:
            return
        self.open = {}
        for name in self.names:
            resumed = self.ids.get(name) if purge_step is not None else None
            self._guarded(name, lambda: self._open(name, resumed, purge_step), opening=True)

    def _open(self, name: str, resumed: Optional[str], purge_step: Optional[int]) -> None:
        tracker = TRACKERS[name](self.config, resumed, purge_step)
        self.open[name] = tracker  # type: ignore[index]
        self.ids[name] = tracker.run_id  # kept even if it fails later: a resume continues its run

    def scalars(self, values: dict[str, float], step: int) -> None:
        for name, tracker in list((self.open or {}).items()):
            self._guarded(name, lambda: tracker.scalars(values, step))

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
            call()
        except Exception as error:
            if self.open is not None:
                self.open.pop(name, None)
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            self.say(f"warning: --logger {name} failed {'to start' if opening else 'mid-run'} ({detail}); it logs "
                     f"nothing more in this run, training goes on")
