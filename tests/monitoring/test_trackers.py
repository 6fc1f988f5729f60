"""--logger csv,mlflow,wandb (multigpu/monitoring/trackers.py): under 2-process ddp, across a --resume auto, MLflow's file
store and W&B's offline run, read back with their own tools, and metrics.csv hold exactly TensorBoard's scalars
(trainer.log's too) at the same steps, from rank 0 alone, in one run each; a library that is missing is one line
naming the extra; a tracker that fails mid-run is one warning and the run goes on."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import main_multi_gpu
from conftest import TINY, blobs, config_for, read_scalars, run_ranks, tiny_model
from train_multi_gpu import MultiGPUTrainer

Scalars = dict[str, list[tuple[int, float]]]


class LogRank:
    """trainer.log's scalars: this rank's number each step (their mean over 2 ranks is 0.5)."""

    def on_step_end(self, trainer: MultiGPUTrainer) -> None:
        trainer.log({"custom/rank": float(trainer.runtime.rank)})


def _train(rank: int, world_size: int, save_dir: Path, epochs: int) -> None:
    config = config_for(save_dir, world_size, save_dir=str(save_dir), logger="tensorboard,csv,mlflow,wandb",
                        epochs=epochs, log_every=2, resume="auto" if epochs > 1 else None)
    with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config, callbacks=[LogRank()]) as trainer:
        trainer.fit()


def csv_scalars(path: Path) -> Scalars:
    found: Scalars = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            found.setdefault(row["name"], []).append((int(row["step"]), float(row["value"])))
    return found


def mlflow_scalars(store: Path) -> tuple[list[str], Scalars]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"file:{store}")
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
        records = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json",
                                  str(run_file)], capture_output=True, text=True, timeout=60, check=True).stdout
        for record in map(json.loads, records.splitlines()):
            if record["type"] == "run":
                ids.append(record["run"]["run_id"])
            if record["type"] == "history":
                step = record["history"]["step"]["num"]
                for name, value in record["history"]["item"].items():
                    if not name.startswith("_"):
                        found.setdefault(name, []).append((int(step), float(value)))
    return ids, found


def assert_same(ours: Scalars, tensorboard: Scalars) -> None:
    assert sorted(ours) == sorted(tensorboard)
    for name, points in tensorboard.items():  # TensorBoard keeps float32
        assert len(ours[name]) == len(points), name
        for (step, value), (their_step, their_value) in zip(sorted(ours[name]), sorted(points)):
            assert step == their_step and math.isclose(value, their_value, rel_tol=1e-6, abs_tol=1e-6), name


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
    wandb_command = shutil.which("wandb", path=str(Path(sys.executable).parent))
    if wandb_command is None or subprocess.run([wandb_command, "leet", "inspect", "--help"], capture_output=True,
                                               timeout=60).returncode != 0:
        pytest.skip("no `wandb leet inspect` beside this Python (wandb 0.31 reads its offline runs with it)")
    save_dir = tmp_path_factory.mktemp("tracked") / "run"
    with pytest.MonkeyPatch.context() as env:  # the spawned ranks inherit it
        env.setenv("WANDB_MODE", "offline")
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT"):
            env.delenv(name, raising=False)
        for epochs in (1, 2):  # one epoch, then --resume auto to the second
            run_ranks(_train, 2, save_dir.parent, save_dir, epochs)
    return save_dir


@pytest.mark.slow
def test_every_tracker_holds_tensorboards_scalars_in_one_run_across_a_resume(tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own yes to reading a file store
    tensorboard = read_scalars(tracked / "tb")
    assert [value for _, value in tensorboard["custom/rank"]] == [0.5] * 4  # trainer.log, averaged over the ranks
    assert {step for step, _ in tensorboard["val/loss"]} == {4, 8}  # both legs
    assert_same(csv_scalars(tracked / "metrics.csv"), tensorboard)
    run_ids, mlflow = mlflow_scalars(tracked / "mlruns")
    assert len(run_ids) == 1  # rank 0's, continued by the resume
    assert_same(mlflow, tensorboard)
    run_ids, wandb = wandb_scalars(tracked / "wandb")
    assert len(run_ids) == 2 and len(set(run_ids)) == 1  # one offline file per leg, of one run
    assert_same(wandb, {name: points for name, points in tensorboard.items() if not name.startswith("hparam/")})


def test_a_missing_library_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # its import fails, as where it is not installed
    args = [*TINY, "--mode", "flatten", "--epochs", "1", "--save-dir", str(tmp_path / "run")]
    assert main_multi_gpu.main([*args, "--logger", "tensorboard,wandb"]) == 2
    assert capsys.readouterr().err == ("error: --logger wandb needs the wandb library, which is not installed: pip "
                                       "install '.[wandb]' (or leave wandb out of --logger)\n")
    assert main_multi_gpu.main([*args, "--logger", "tensorboard,comet"]) == 2
    assert capsys.readouterr().err == ("error: --logger takes a comma list of tensorboard, csv, mlflow, wandb; got "
                                       "'comet' in 'tensorboard,comet'\n")


class BreakCsv:
    """Puts a folder where metrics.csv is, after step 3: the next write fails as a full or lost disk would."""

    def on_step_end(self, trainer: MultiGPUTrainer) -> None:
        if trainer.progress.global_step == 3:
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
    assert warnings == [f"warning: --logger csv failed mid-run ([Errno 21] Is a directory: "
                        f"'{tmp_path / 'ckpt' / 'metrics.csv'}'); it logs nothing more in this run, training goes on"]
    assert [step for step, _ in read_scalars(tmp_path / "ckpt" / "tb")["train/loss"]] == list(range(1, 17))
