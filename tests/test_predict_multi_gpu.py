"""predict_multi_gpu.py end to end: a real training run's best.pt predicted under 2-process DDP (torchrun) to
CSV and .pt, in dataset order, with the accuracy training recorded; unlabeled images; bad input in one line."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

import main_multi_gpu
import predict_multi_gpu
from conftest import REPO, TINY, TINY_GPT, assert_ok, guide_commands, image_folder, run_cli, tiny_text
from multigpu.checkpoints import checkpoint
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


@pytest.mark.slow
def test_the_guides_commands_predict_in_dataset_order_with_the_accuracy_training_recorded(trained, tmp_path):
    """The prediction page's commands as written (2-process DDP to .csv and .pt, then a folder of unlabeled images)."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    shutil.copy(trained, tmp_path / "runs" / "demo" / "best.pt")
    image_folder(tmp_path / "photos", {"batch1": ["cat", "dog"], "batch0": ["x"]}, per_class=2)
    commands = guide_commands("predict_multi_gpu.py", page="docs/prediction.md")
    assert [(nproc, args[args.index("--output") + 1]) for nproc, args in commands] == [
        (2, "runs/demo/predictions.csv"),
        (2, "runs/demo/outputs.pt"),
        (None, "runs/demo/photos.csv"),
    ]
    results = [run_cli(args, nproc=nproc, cwd=tmp_path, script=SCRIPT) for nproc, args in commands]
    for result in results:
        assert_ok(result)
    assert "mode ddp: 2 processes" in results[0].stdout

    state = checkpoint.load(str(trained))
    metric_lines = [
        line for line in results[0].stdout.splitlines() if line.startswith("val set (100 samples)")
    ]
    assert len(metric_lines) == 1 and metric_lines[0].endswith(
        "the same as training recorded in this checkpoint"
    )
    rows = read_csv(tmp_path / "runs" / "demo" / "predictions.csv")
    assert [int(row["index"]) for row in rows] == list(range(100))  # one row per sample, in dataset order
    labels = validation_labels(state)
    assert [int(row["label"]) for row in rows] == labels
    accuracy = sum(int(row["predicted"]) == label for row, label in zip(rows, labels)) / len(rows)
    assert accuracy == state["metrics"]["val_acc"] == state["best_value"]
    assert 0.2 < accuracy < 1  # one epoch: neither chance nor perfect, so the equality says something
    assert all(
        row["top1"] == row["predicted"]
        and float(row["top1_probability"]) >= float(row["top2_probability"]) >= float(row["top3_probability"])
        for row in rows
    )

    outputs = torch.load(tmp_path / "runs" / "demo" / "outputs.pt", weights_only=True)
    assert outputs.shape == (100, 10) and outputs.dtype == torch.float32
    assert outputs.argmax(1).tolist() == [int(row["predicted"]) for row in rows]

    photos = read_csv(tmp_path / "runs" / "demo" / "photos.csv")
    assert list(photos[0]) == ["index", "file", "predicted", "probability"]  # no labels: no label column
    assert [row["file"] for row in photos] == [
        "batch0/x/0.png",
        "batch0/x/1.png",
        "batch1/cat/0.png",
        "batch1/cat/1.png",
        "batch1/dog/0.png",
        "batch1/dog/1.png",
    ]
    assert "set (" not in results[2].stdout  # and no metrics
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.tmp"))


def test_the_training_split_in_other_batches_gives_the_models_outputs_in_order(trained, tmp_path, capsys):
    assert (
        predict_multi_gpu.main(
            [
                "--checkpoint",
                str(trained),
                "--split",
                "train",
                "--batch-size",
                "7",
                "--output",
                str(tmp_path / "train.pt"),
            ]
        )
        == 0
    )
    assert "train set (512 samples): loss" in capsys.readouterr().out
    state = checkpoint.load(str(trained))
    model = build_model("mlp", (784,), 10)
    model.load_state_dict(state["model"])
    train = build_datasets(TrainConfig.from_dict(state["config"])).train
    with torch.no_grad():
        expected = model(torch.stack([train[index][0] for index in range(len(train))]))
    torch.testing.assert_close(torch.load(tmp_path / "train.pt", weights_only=True), expected)


def test_a_gpt_checkpoint_predicts_scores_at_every_position_with_the_loss_training_recorded(tmp_path, capsys):
    text = tiny_text(tmp_path / "tiny.txt")
    assert (
        main_multi_gpu.main(
            [
                *TINY_GPT,
                "--data-file",
                str(text),
                "--epochs",
                "1",
                "--batch-size",
                "16",
                "--no-progress",
                "--save-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    best = str(tmp_path / "run" / "best.pt")
    capsys.readouterr()
    assert predict_multi_gpu.main(["--checkpoint", best, "--output", str(tmp_path / "logits.pt")]) == 0
    metrics = capsys.readouterr().out.splitlines()[-1]  # the model's own loss, as training computed it
    assert metrics.startswith("val set (") and metrics.endswith(
        "the same as training recorded in this checkpoint"
    )
    state = checkpoint.load(best)
    config = TrainConfig.from_dict(state["config"])
    val = build_datasets(config).val
    model = build_model("gpt", (32,), len(set(text.read_text())), config).eval()
    model.load_state_dict(state["model"])
    with torch.no_grad():
        expected = model(torch.stack([val[index][0] for index in range(len(val))]))[0]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt", weights_only=True), expected)
    assert predict_multi_gpu.main(["--checkpoint", best, "--output", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "--model gpt scores every position of a window" in err and "logits.pt" in err
    )
    assert predict_multi_gpu.main(["--checkpoint", best, "--imagefolder", str(tmp_path)]) == 2
    assert (
        "--imagefolder gives images, and the checkpoint's --model gpt reads characters"
        in capsys.readouterr().err
    )


BAD_INPUT = {
    "missing checkpoint": (["--checkpoint", "{tmp}/nope.pt"], "checkpoint {tmp}/nope.pt does not exist"),
    "truncated checkpoint": (
        ["--checkpoint", "{tmp}/cut.pt"],
        "checkpoint {tmp}/cut.pt refused: truncated or corrupt",
    ),
    "text as checkpoint": (
        ["--checkpoint", "{tmp}/old.csv", "--output", "{tmp}/new.csv"],
        "refused: not a checkpoint (it holds text",
    ),
    "mismatched model": (
        ["--num-classes", "3"],
        "does not fit --model mlp for 784 inputs and 3 classes: size mismatch",
    ),
    "missing data": (["--dataset", "mnist", "--data-dir", "{tmp}/none"], "--dataset mnist: files not found"),
    "missing image folder": (["--imagefolder", "{tmp}/none"], "--imagefolder {tmp}/none is not a folder"),
    "unknown output kind": (
        ["--output", "{tmp}/p.txt"],
        "--output {tmp}/p.txt: the file name must end in .csv or .pt",
    ),
    "too many top classes": (["--topk", "11"], "--topk 11 is more than the model's 10 classes"),
}


def test_a_lora_checkpoint_predicts_with_its_adapters_on_the_base_its_run_built(tmp_path, capsys):
    """A LoRA run's checkpoint holds its adapters alone: the base is the built-in GPT its --seed builds again,
    checked against the checkpoint's fingerprint, and the loss is the one training recorded."""
    pytest.importorskip("peft", reason="the [lora] extra (peft) is not installed")
    text = tiny_text(tmp_path / "tiny.txt")
    run = [*TINY_GPT, "--data-file", str(text), "--epochs", "1", "--batch-size", "16", "--no-progress"]
    assert main_multi_gpu.main([*run, "--lora-r", "4", "--save-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    best = str(tmp_path / "run" / "best.pt")
    assert predict_multi_gpu.main(["--checkpoint", best, "--output", str(tmp_path / "logits.pt")]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1].endswith("the same as training recorded in this checkpoint")
    )


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
        args += ["--output", str(tmp_path / "old.csv"), "--overwrite"]  # kept even where it may be replaced
    assert predict_multi_gpu.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(tmp=tmp_path) in err, err
    assert (tmp_path / "old.csv").read_text() == "an earlier output\n"
    assert not list(tmp_path.glob("*.partial"))


# --output that would destroy something: (--output, with --overwrite too?, the line). In {tmp}: S/ a save-dir
# with best.pt (the checkpoint read), old.csv (an earlier output), a folder, and a link to another user's file.
REFUSED_OUTPUTS = {
    "the checkpoint read": (
        "{tmp}/S/best.pt",
        True,
        "--output {tmp}/S/best.pt is the checkpoint being read "
        "(--checkpoint {tmp}/S/best.pt); choose another file",
    ),
    "a checkpoint name": (
        "{tmp}/step-3.pt",
        True,
        "--output {tmp}/step-3.pt: step-3.pt is a save-dir's checkpoint "
        "name (last.pt, best.pt, step-*.pt), refused even with --overwrite",
    ),
    "an existing file": (
        "{tmp}/old.csv",
        False,
        "--output {tmp}/old.csv exists; add --overwrite to replace it",
    ),
    "a folder": ("{tmp}/folder.csv", True, "--output {tmp}/folder.csv is a folder; name a file in it"),
    "a symbolic link": (
        "{tmp}/link.csv",
        True,
        "refusing to write {tmp}/link.csv: it is a symbolic link (to "
        "{tmp}/victim.csv); remove it or choose another path",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_OUTPUTS))
def test_an_output_that_would_destroy_a_file_is_refused_and_every_file_is_byte_identical(
    case, trained, tmp_path, capsys
):
    (tmp_path / "S").mkdir()
    shutil.copy(trained, tmp_path / "S" / "best.pt")
    (tmp_path / "old.csv").write_text("an earlier output\n")
    (tmp_path / "folder.csv").mkdir()
    (tmp_path / "victim.csv").write_text("another user's file\n")
    (tmp_path / "link.csv").symlink_to(tmp_path / "victim.csv")
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    output, with_overwrite, message = REFUSED_OUTPUTS[case]
    args = ["--checkpoint", str(tmp_path / "S" / "best.pt"), "--output", output.format(tmp=tmp_path)]
    assert predict_multi_gpu.main(args + ["--overwrite"] * with_overwrite) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.format(tmp=tmp_path) in err, err
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob("*.tmp"))


def test_overwrite_replaces_an_output_only_when_the_prediction_succeeds(trained, tmp_path, capsys):
    """A prediction that fails half-way (an image whose data is cut short) leaves the old output and no .partial;
    one that succeeds replaces it."""
    photos = image_folder(tmp_path / "photos", {"batch0": ["x"]}, per_class=2)
    image = photos / "batch0" / "x" / "1.png"
    whole = image.read_bytes()
    image.write_bytes(
        whole[: len(whole) // 2]
    )  # its header is intact: found broken only when read, mid-prediction
    for output in (tmp_path / "old.csv", tmp_path / "old.pt"):
        output.write_text("an earlier output\n")
        args = [
            "--checkpoint",
            str(trained),
            "--imagefolder",
            str(photos),
            "--output",
            str(output),
            "--overwrite",
        ]
        with pytest.raises(OSError, match="1.png"):
            predict_multi_gpu.main(args)
        assert output.read_text() == "an earlier output\n"
        assert {path.name for path in tmp_path.iterdir()} == {
            "photos",
            "old.csv",
            output.name,
        }  # no .partial, .tmp
        image.write_bytes(whole)
        assert predict_multi_gpu.main(args) == 0
        assert f"predicted 2 samples, written to {output}" in capsys.readouterr().out
        predictions = read_csv(output) if output.suffix == ".csv" else torch.load(output, weights_only=True)
        assert len(predictions) == 2
        image.write_bytes(whole[: len(whole) // 2])
