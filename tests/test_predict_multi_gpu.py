"""predict_multi_gpu.py end to end: a real training run's best.pt predicted under 2-process DDP (torchrun) to
CSV and .pt, in dataset order, with the accuracy training recorded; unlabeled images; bad input in one line."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

import predict_multi_gpu
from conftest import REPO, TINY, assert_ok, guide_commands, image_folder, run_cli
from multigpu import checkpoint
from multigpu.config import TrainConfig
from multigpu.data import build_datasets
from multigpu.models import build_model

SCRIPT = REPO / "predict_multi_gpu.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """best.pt of one real epoch (an MLP on 100 synthetic validation samples), trained as the guide's Prediction
    section says, with fewer samples."""
    save_dir = tmp_path_factory.mktemp("trained") / "runs" / "demo"
    assert_ok(run_cli([*TINY, "--epochs", "1", "--mode", "flatten", "--save-dir", str(save_dir)]))
    return save_dir / "best.pt"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def validation_labels(state: dict) -> list[int]:
    val = build_datasets(TrainConfig.from_dict(state["config"])).val
    return [int(val[index][1]) for index in range(len(val))]


def test_the_guides_commands_predict_in_dataset_order_with_the_accuracy_training_recorded(trained, tmp_path):
    """The guide's commands as written (2-process DDP to .csv and .pt, then a folder of unlabeled images)."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    shutil.copy(trained, tmp_path / "runs" / "demo" / "best.pt")
    image_folder(tmp_path / "photos", {"batch1": ["cat", "dog"], "batch0": ["x"]}, per_class=2)
    commands = guide_commands("predict_multi_gpu.py")
    assert [(nproc, args[args.index("--output") + 1]) for nproc, args in commands] == [
        (2, "predictions.csv"), (2, "outputs.pt"), (None, "photos.csv")]
    results = [run_cli(args, nproc=nproc, cwd=tmp_path, script=SCRIPT) for nproc, args in commands]
    for result in results:
        assert_ok(result)
    assert "mode ddp: 2 processes" in results[0].stdout

    state = checkpoint.load(str(trained))
    metric_lines = [line for line in results[0].stdout.splitlines() if line.startswith("val set (100 samples)")]
    assert len(metric_lines) == 1 and metric_lines[0].endswith("the same as training recorded in this checkpoint")
    rows = read_csv(tmp_path / "predictions.csv")
    assert [int(row["index"]) for row in rows] == list(range(100))  # one row per sample, in dataset order
    labels = validation_labels(state)
    assert [int(row["label"]) for row in rows] == labels
    accuracy = sum(int(row["predicted"]) == label for row, label in zip(rows, labels)) / len(rows)
    assert accuracy == state["metrics"]["val_acc"] == state["best_value"]
    assert 0.2 < accuracy < 1  # one epoch: neither chance nor perfect, so the equality says something
    assert all(row["top1"] == row["predicted"] and float(row["top1_probability"]) >= float(row["top2_probability"])
               >= float(row["top3_probability"]) for row in rows)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
    assert outputs.shape == (100, 10) and outputs.dtype == torch.float32
    assert outputs.argmax(1).tolist() == [int(row["predicted"]) for row in rows]

    photos = read_csv(tmp_path / "photos.csv")
    assert list(photos[0]) == ["index", "file", "predicted", "probability"]  # no labels: no label column
    assert [row["file"] for row in photos] == ["batch0/x/0.png", "batch0/x/1.png", "batch1/cat/0.png",
                                               "batch1/cat/1.png", "batch1/dog/0.png", "batch1/dog/1.png"]
    assert "set (" not in results[2].stdout  # and no metrics
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.tmp"))


def test_the_training_split_in_other_batches_gives_the_models_outputs_in_order(trained, tmp_path, capsys):
    assert predict_multi_gpu.main(["--checkpoint", str(trained), "--split", "train", "--batch-size", "7",
                                   "--output", str(tmp_path / "train.pt")]) == 0
    assert "train set (512 samples): loss" in capsys.readouterr().out
    state = checkpoint.load(str(trained))
    model = build_model("mlp", (784,), 10)
    model.load_state_dict(state["model"])
    train = build_datasets(TrainConfig.from_dict(state["config"])).train
    with torch.no_grad():
        expected = model(torch.stack([train[index][0] for index in range(len(train))]))
    torch.testing.assert_close(torch.load(tmp_path / "train.pt", weights_only=True), expected)


BAD_INPUT = {
    "missing checkpoint": (["--checkpoint", "{tmp}/nope.pt"], "checkpoint {tmp}/nope.pt does not exist"),
    "truncated checkpoint": (["--checkpoint", "{tmp}/cut.pt"], "checkpoint {tmp}/cut.pt refused: truncated or corrupt"),
    "text as checkpoint": (["--checkpoint", "{tmp}/old.csv"], "refused: not a checkpoint (it holds text"),
    "mismatched model": (["--num-classes", "3"], "does not fit --model mlp for 784 inputs and 3 classes: size mismatch"),
    "missing data": (["--dataset", "mnist", "--data-dir", "{tmp}/none"], "--dataset mnist: files not found"),
    "missing image folder": (["--imagefolder", "{tmp}/none"], "--imagefolder {tmp}/none is not a folder"),
    "unknown output kind": (["--output", "{tmp}/p.txt"], "--output {tmp}/p.txt: the file name must end in .csv or .pt"),
    "too many top classes": (["--topk", "11"], "--topk 11 is more than the model's 10 classes"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2_and_an_earlier_output_is_kept(case, trained, tmp_path, capsys):
    (tmp_path / "cut.pt").write_bytes(trained.read_bytes()[: trained.stat().st_size // 2])
    shutil.copy(trained, tmp_path / "best.pt")
    (tmp_path / "old.csv").write_text("an earlier output\n")
    args, message = BAD_INPUT[case]
    args = [arg.format(tmp=tmp_path) for arg in args]
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(tmp_path / "best.pt"), *args]
    if "--output" not in args:
        args += ["--output", str(tmp_path / "old.csv")]
    assert predict_multi_gpu.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(tmp=tmp_path) in err, err
    assert (tmp_path / "old.csv").read_text() == "an earlier output\n"
    assert not list(tmp_path.glob("*.partial"))
