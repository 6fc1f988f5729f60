"""--logger csv,mlflow,wandb (multigpu/monitoring/trackers.py): under 2-process ddp, across a SIGKILL past the
last checkpoint and a --resume auto, MLflow's database store and W&B's offline run, read back with their own
clients, and metrics.csv hold exactly TensorBoard's scalars (trainer.log's too), one point per step, from rank 0
alone, in one run each; a library that is missing is one line naming the extra; a tracker that fails mid-run is
one warning and the run goes on."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import main_multi_gpu
from conftest import (
    REPO,
    TINY,
    assert_one_line,
    blobs,
    cli_command,
    config_for,
    contents,
    free_port,
    read_scalars,
    run_cli_ranks,
    run_on_small_file_system,
    tiny_model,
)
from multigpu.monitoring.tracker_probe import PROBE_SECONDS
from multigpu.resilience.faults import FAULT_ENV
from train_multi_gpu import MultiGPUTrainer

Scalars = dict[str, list[tuple[int, float]]]

# 2 ranks of ddp, 64 samples (4 steps an epoch), every tracker, trainer.log's scalars (each rank's number: their
# mean over 2 ranks is 0.5), logged every 2 steps; a checkpoint at each epoch's end. Where a fault is injected,
# rank 0 waits at step 7 long enough for W&B to have written step 6 (it writes its file every second).
TRACKED_RUN = """
import os, sys, time
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
from conftest import blobs, config_for, tiny_model
from multigpu.launch.runner import main_guarded
from multigpu.monitoring.trackers import WANDB_FLUSH_SECONDS
from multigpu.resilience.faults import FAULT_ENV
from train_multi_gpu import MultiGPUTrainer

class LogRank:
    def on_step_end(self, trainer):
        trainer.log({{"custom/rank": float(trainer.runtime.rank)}})
        if trainer.progress.global_step == 7 and os.environ.get(FAULT_ENV):
            time.sleep(2.5 * WANDB_FLUSH_SECONDS)

def train(argv):
    save_dir = Path(argv[0])
    config = config_for(save_dir, 2, save_dir=str(save_dir), logger="tensorboard,csv,mlflow,wandb", epochs=2,
                        log_every=2, resume="auto")
    with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config, callbacks=[LogRank()]) as trainer:
        trainer.fit()
sys.exit(main_guarded(train, sys.argv[1:]))
"""


def csv_scalars(path: Path) -> Scalars:
    found: Scalars = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            found.setdefault(row["name"], []).append((int(row["step"]), float(row["value"])))
    return found


def mlflow_scalars(store: Path) -> tuple[list[str], Scalars]:
    """Every run's metric histories, read by MLflow's own client from the database as it is."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = client.search_runs(["0"])
    found: Scalars = {}
    for run in runs:
        for name in run.data.metrics:
            found[name] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
    return [run.info.run_id for run in runs], found


def wandb_scalars(folder: Path) -> tuple[list[str], Scalars]:
    """Every offline run file's history, read by W&B's own reader (`wandb leet inspect --json`)."""
    ids: list[str] = []
    found: Scalars = {}
    for run_file in sorted(folder.glob("offline-run-*/run-*.wandb")):
        records = subprocess.run(
            [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_file)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for record in map(json.loads, records.splitlines()):
            if record["type"] == "run":
                ids.append(record["run"]["run_id"])
            if record["type"] == "history":
                step = record["history"]["step"]["num"]
                for name, value in record["history"]["item"].items():
                    if not name.startswith("_"):
                        found.setdefault(name, []).append((int(step), float(value)))
    return ids, found


def assert_same(ours: Scalars, tensorboard: Scalars, killed_runs_steps: tuple[int, ...] = ()) -> None:
    """The same names, each with one point per step, at TensorBoard's steps and values; at `killed_runs_steps` the
    value the killed run logged stands (its samples/s differ from the resumed run's, which TensorBoard shows)."""
    assert sorted(ours) == sorted(tensorboard)
    for name, points in tensorboard.items():  # TensorBoard keeps float32
        assert len(ours[name]) == len({step for step, _ in ours[name]}) == len(points), (
            name,
            sorted(ours[name]),
        )
        for (step, value), (their_step, their_value) in zip(sorted(ours[name]), sorted(points)):
            assert step == their_step, name
            assert step in killed_runs_steps or math.isclose(
                value, their_value, rel_tol=1e-6, abs_tol=1e-6
            ), name


def tensorboard_scalars(log_dir: Path) -> Scalars:
    """The folder's scalars as TensorBoard shows them: its event files read in order, a resume's purge applied."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save-dir of TRACKED_RUN: rank 0 SIGKILLed after step 7, step 6's scalars logged, past the checkpoint of
    step 4; then --resume auto to the end, training steps 5 to 8 again."""
    for library in ("mlflow", "sqlalchemy", "alembic", "wandb"):
        pytest.importorskip(library, reason="the [mlflow] and [wandb] extras are not installed")
    wandb_command = shutil.which("wandb", path=str(Path(sys.executable).parent))
    if (
        wandb_command is None
        or subprocess.run(
            [wandb_command, "leet", "inspect", "--help"], capture_output=True, timeout=60
        ).returncode
        != 0
    ):
        pytest.skip("no `wandb leet inspect` beside this Python (wandb 0.31 reads its offline runs with it)")
    folder = tmp_path_factory.mktemp("tracked")
    script = folder / "run.py"
    script.write_text(TRACKED_RUN.format(repo=str(REPO), tests=str(REPO / "tests")))
    save_dir = folder / "run"
    with pytest.MonkeyPatch.context() as env:  # the ranks inherit it
        env.setenv("WANDB_MODE", "offline")
        for name in (
            "MLFLOW_TRACKING_URI",
            "MLFLOW_EXPERIMENT_NAME",
            "MLFLOW_ALLOW_FILE_STORE",
            "WANDB_DIR",
            "WANDB_RUN_ID",
            "WANDB_PROJECT",
        ):
            env.delenv(name, raising=False)
        killed = run_cli_ranks([str(save_dir)], 2, env={FAULT_ENV: "0:7"}, script=script)
        resumed = run_cli_ranks([str(save_dir)], 2, script=script)
    assert killed[0].returncode == -signal.SIGKILL, killed[0].stderr
    assert [rank.returncode for rank in resumed] == [0, 0], resumed[0].stderr
    assert "resumed from " in resumed[0].stdout and "step 4" in resumed[0].stdout
    return save_dir


@pytest.mark.slow
def test_every_tracker_holds_tensorboards_scalars_once_per_step_in_one_run_across_a_kill_and_resume(tracked):
    tensorboard = tensorboard_scalars(tracked / "tb")
    assert [step for step, _ in tensorboard["train/loss"]] == [2, 4, 6, 8]  # step 6 logged by both runs
    assert [value for _, value in tensorboard["custom/rank"]] == [
        0.5
    ] * 4  # trainer.log, averaged over the ranks
    assert {step for step, _ in tensorboard["val/loss"]} == {4, 8}  # both legs
    assert_same(csv_scalars(tracked / "metrics.csv"), tensorboard)
    run_ids, mlflow = mlflow_scalars(tracked / "mlflow.db")  # no MLFLOW_ALLOW_FILE_STORE needed
    assert len(run_ids) == 1  # rank 0's, continued by the resume
    assert_same(
        mlflow, tensorboard, killed_runs_steps=(6,)
    )  # MLflow and W&B cannot drop a point: theirs stands
    run_ids, wandb = wandb_scalars(tracked / "wandb")
    assert len(run_ids) == 2 and len(set(run_ids)) == 1  # one offline file per leg, of one run
    assert_same(
        wandb,
        {name: points for name, points in tensorboard.items() if not name.startswith("hparam/")},
        killed_runs_steps=(6,),
    )
    assert dict(mlflow["train/loss"])[6] == pytest.approx(
        dict(tensorboard["train/loss"])[6], rel=1e-6
    )  # the same step


def test_a_missing_library_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # its import fails, as where it is not installed
    args = [*TINY, "--mode", "flatten", "--epochs", "1", "--save-dir", str(tmp_path / "run")]
    assert main_multi_gpu.main([*args, "--logger", "tensorboard,wandb"]) == 2
    assert capsys.readouterr().err == (
        "error: --logger wandb needs the wandb library, which is not installed: pip "
        "install '.[wandb]' (or leave wandb out of --logger)\n"
    )
    monkeypatch.setitem(
        sys.modules, "sqlalchemy", None
    )  # MLflow's database store needs it beyond mlflow-skinny
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main_multi_gpu.main([*args, "--logger", "mlflow"]) == 2
    assert capsys.readouterr().err.startswith("error: --logger mlflow needs the ")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "alembic", None)
    assert main_multi_gpu.main([*args, "--logger", "mlflow"]) == 2
    assert capsys.readouterr().err == (
        "error: --logger mlflow needs the mlflow and sqlalchemy and alembic libraries, "
        "which are not installed: pip install '.[mlflow]' (or leave mlflow out of "
        "--logger)\n"
    )
    assert main_multi_gpu.main([*args, "--logger", "tensorboard,comet"]) == 2
    assert capsys.readouterr().err == (
        "error: --logger takes a comma list of tensorboard, csv, mlflow, wandb; got "
        "'comet' in 'tensorboard,comet'\n"
    )


class BreakCsv:
    """Puts a folder where metrics.csv is, after step 3: the next write fails as a full or lost disk would."""

    def on_step_end(self, trainer: MultiGPUTrainer) -> None:
        if trainer.progress.global_step == 3:
            assert trainer.config.save_dir is not None  # the run folder, chosen at construction
            path = Path(trainer.config.save_dir) / "metrics.csv"
            path.unlink()
            path.mkdir()


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(tmp_path, capsys):
    config = config_for(tmp_path, 1, logger="tensorboard,csv", epochs=2, log_every=1)
    with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config, callbacks=[BreakCsv()]) as trainer:
        summary = trainer.fit()
    out = capsys.readouterr().out
    assert summary["global_step"] == 16 and (tmp_path / "ckpt" / "last.pt").exists()
    warnings = [line for line in out.splitlines() if "--logger csv" in line]
    assert warnings == [
        f"warning: --logger csv failed mid-run ([Errno 21] Is a directory: "
        f"'{tmp_path / 'ckpt' / 'metrics.csv'}'); it logs nothing more in this run, training goes on"
    ]
    assert [step for step, _ in read_scalars(tmp_path / "ckpt" / "tb")["train/loss"]] == list(range(1, 17))


# ---------------------------------------------------------------- a tracker that is not there (tracker_probe.py)
SMALL = ["--train-size", "64", "--val-size", "32", "--batch-size", "16", "--epochs", "1", "--no-progress"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save-dir of a finished run, which an --overwrite run would set aside."""
    save_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main_multi_gpu.main([*SMALL, "--mode", "flatten", "--save-dir", str(save_dir)]) == 0
    return save_dir


@pytest.fixture
def earlier_run(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run's save-dir, for one test: its files must not move."""
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def test_a_tracking_server_nobody_answers_at_is_refused_in_seconds_before_anything_is_set_aside(
    earlier_run, capsys, monkeypatch
):
    """A real closed port: MLflow's client retried it for minutes, and W&B waits 90 s for its server."""
    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    closed = f"http://127.0.0.1:{free_port()}"
    before = contents(earlier_run)
    run = [*SMALL, "--mode", "flatten", "--save-dir", str(earlier_run), "--overwrite"]
    capsys.readouterr()
    for logger, variable, expected in (
        ("mlflow", "MLFLOW_TRACKING_URI", f"the MLflow tracking server at MLFLOW_TRACKING_URI={closed}"),
        ("wandb", "WANDB_BASE_URL", f"W&B's server {closed}"),
    ):
        monkeypatch.setenv(variable, closed)
        started = time.monotonic()
        code = main_multi_gpu.main([*run, "--logger", f"tensorboard,{logger}"])
        assert time.monotonic() - started < 10 * PROBE_SECONDS
        assert_one_line(
            code, capsys.readouterr().err, f"--logger {logger}: cannot reach {expected} (Connection "
        )
        assert contents(earlier_run) == before and not list(earlier_run.glob(".replaced-*"))


def test_a_read_only_mlflow_store_is_refused_in_seconds_before_anything_is_set_aside(earlier_run, tmp_path):
    """MLflow's SQLite store on a real read-only file system (a tmpfs remounted read-only, in a mount namespace
    of this test's own)."""
    pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
    store = tmp_path / "store.db"
    with contextlib.closing(sqlite3.connect(store)) as db:
        db.execute("CREATE TABLE runs (id)")
        db.commit()
    mount = tmp_path / "store"
    mount.mkdir()
    before = contents(earlier_run)
    command = shlex.join(
        [
            *cli_command([*SMALL, "--mode", "flatten", "--logger", "mlflow"]),
            *("--save-dir", str(earlier_run), "--overwrite"),
        ]
    )
    script = (
        f'cp "$1" {mount}/mlflow.db && mount -o remount,ro {mount} && '
        f"MLFLOW_TRACKING_URI=sqlite:///{mount}/mlflow.db {command}"
    )
    started = time.monotonic()
    refused = run_on_small_file_system("1m", mount, script, str(store))
    took = time.monotonic() - started  # a Python start with torch, and the probe's seconds at most
    assert_one_line(
        refused.returncode,
        refused.stderr,
        f"--logger mlflow: cannot write MLflow's store {mount}/mlflow.db (attempt to write a readonly "
        f"database); give a store this user can write",
    )
    assert took < 60, took
    assert contents(earlier_run) == before and not list(earlier_run.glob(".replaced-*"))
