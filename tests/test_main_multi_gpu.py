"""The command line end to end: real torchrun/gloo processes, real checkpoints and TensorBoard event files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import main_multi_gpu
from conftest import TINY, assert_ok, event_files, read_scalars, run_cli

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One 2-process DDP run of the default model on the default data, shared by the tests below."""
    save_dir = tmp_path_factory.mktemp("ddp")
    result = run_cli(
        [
            "--multi-gpu",
            "ddp",
            "--epochs",
            "3",
            "--train-size",
            "2048",
            "--val-size",
            "500",
            "--batch-size",
            "32",
            "--log-every",
            "8",
            "--no-progress",
            "--dist-timeout",
            "60",
            "--save-dir",
            str(save_dir),
        ],
        nproc=2,
    )
    assert_ok(result)
    return save_dir, result


@pytest.mark.slow
def test_ddp_run_learns_the_default_data(ddp_run):
    save_dir, result = ddp_run
    scalars = read_scalars(save_dir / "tb")
    losses = [value for _, value in sorted(scalars["train/loss"])]
    assert losses[-1] < losses[0] / 5
    val_acc = [value for _, value in sorted(scalars["val/acc"])]
    assert len(val_acc) == 3 and val_acc[-1] > 0.9
    assert re.search(r"done: best val acc 0\.9\d+, 3 epochs, wall time [\d.]+s, \d+ samples/s", result.stdout)


def test_ddp_run_prints_its_plan_once_from_rank_0(ddp_run):
    _, result = ddp_run
    out = result.stdout
    assert out.count("mode ddp: 2 processes, backend gloo") == 1
    assert out.count("batch 32 per device x 2 devices x 1 accumulation = 64 effective") == 1
    assert out.count("done:") == 1
    assert "Traceback" not in result.stderr


def test_ddp_run_writes_one_event_file_and_rank0_checkpoints(ddp_run):
    save_dir, _ = ddp_run
    assert len(event_files(save_dir)) == 1
    assert sorted(p.name for p in save_dir.iterdir()) == [
        ".run.lock",
        "best.pt",
        "last.pt",
        "tb",
    ]  # no temp files
    state = torch.load(save_dir / "last.pt", map_location="cpu", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "scaler", "epoch", "config", "metrics"):
        assert key in state
    assert not any(name.startswith("module.") for name in state["model"])
    assert state["epoch"] == 3 and state["config"]["batch_size"] == 32 and state["world_size"] == 2
    assert state["metrics"]["val_acc"] > 0.9
    scalars = read_scalars(save_dir / "tb")
    for tag in ("train/loss", "train/lr", "train/samples_per_sec", "val/loss", "val/acc"):
        assert tag in scalars, tag


@pytest.mark.slow
def test_resume_continues_from_a_checkpoint(ddp_run, tmp_path):
    save_dir, _ = ddp_run
    result = run_cli(
        [
            "--epochs",
            "4",
            "--train-size",
            "2048",
            "--val-size",
            "500",
            "--batch-size",
            "32",
            "--no-progress",
            "--save-dir",
            str(tmp_path),
            "--resume",
            str(save_dir / "last.pt"),
        ]
    )
    assert_ok(result)
    assert "resumed from" in result.stdout
    assert result.stdout.count("epoch 4/4: val loss") == 1 and "epoch 3/4" not in result.stdout
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 4


@pytest.mark.slow
def test_single_device_and_dp_fallback_train_alike_and_another_seed_does_not(tmp_path):
    """Same seed (the default, 0), same data, same device: the dp fallback trains exactly what single-device mode
    trains, in a process of its own (so the same seed gives identical weights run after run); seed 1 does not."""
    flags = ["--mode", "flatten", "--epochs", "2", *TINY]
    single = run_cli(["--multi-gpu", "none", *flags, "--save-dir", str(tmp_path / "single")])
    assert_ok(single)
    assert "mode none: one device, cpu" in single.stdout
    dp = run_cli(["--multi-gpu", "dp", *flags, "--save-dir", str(tmp_path / "dp")])
    assert_ok(dp)
    assert "--multi-gpu dp needs 2 or more GPUs, found 0: training on the single device cpu" in dp.stdout
    assert_ok(run_cli([*flags, "--seed", "1", "--save-dir", str(tmp_path / "seed-1")]))
    weights = {
        name: torch.load(tmp_path / name / "last.pt", weights_only=True)["model"]
        for name in ("single", "dp", "seed-1")
    }
    assert all(torch.equal(weights["single"][key], weights["dp"][key]) for key in weights["single"])
    assert not all(torch.equal(weights["single"][key], weights["seed-1"][key]) for key in weights["single"])


@pytest.mark.slow
def test_ddp_with_accumulation_and_lr_scaling_reports_the_effective_batch(tmp_path):
    result = run_cli(
        [
            "--multi-gpu",
            "ddp",
            "--mode",
            "flatten",
            "--epochs",
            "1",
            *TINY,
            "--grad-accum-steps",
            "2",
            "--lr",
            "0.001",
            "--lr-scaling",
            "sqrt",
            "--save-dir",
            str(tmp_path),
        ],
        nproc=2,
    )
    assert_ok(result)
    assert "batch 32 per device x 2 devices x 2 accumulation = 128 effective" in result.stdout
    assert "lr 0.002 = 0.001 x sqrt(128/32) (--lr-scaling sqrt)" in result.stdout
    # 512 samples / 2 ranks / 32 per micro-batch = 8 micro-batches = 4 optimizer steps
    assert torch.load(tmp_path / "last.pt", weights_only=True)["global_step"] == 4


BAD_INPUT = {
    "ddp without torchrun": (["--multi-gpu", "ddp"], "torchrun --nproc_per_node=2"),
    "unknown GPU id": (["--multi-gpu", "dp", "--gpu-ids", "0,5"], "--gpu-ids 0,5"),
    "zero batch": (["--batch-size", "0"], "--batch-size must be at least 1"),
    "not a number": (["--lr", "fast"], "argument --lr: invalid float value"),
    "unknown choice": (["--amp", "fp8"], "--amp"),
    "bad image shape": (["--image-shape", "3,32"], "--image-shape must be C,H,W"),
    "flatten with cnn": (["--mode", "flatten", "--model", "cnn"], "--model cnn needs image samples"),
    "missing data set": (["--dataset", "cifar10", "--data-dir", "/nonexistent/data"], "--download"),
}


IN_A_PROCESS = "ddp without torchrun"  # its hint quotes the script's own command line


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    """One case as a process of its own, the others through the same entry point in this process (a Python
    start each saved): the exit status is what main() returns."""
    args, expected = BAD_INPUT[case]
    argv = [*args, "--save-dir", str(tmp_path / "ckpt")]
    if case == IN_A_PROCESS:
        result = run_cli(argv)
        code, stderr = result.returncode, result.stderr
    else:
        monkeypatch.chdir(tmp_path)  # default folders stay in the test's directory
        code, stderr = main_multi_gpu.main(argv), capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0]
    assert not (tmp_path / "ckpt" / "last.pt").exists()


@pytest.mark.slow
def test_mnist_reaches_97_percent_in_one_epoch_under_ddp(mnist_root, tmp_path):
    result = run_cli(
        [
            "--multi-gpu",
            "ddp",
            "--dataset",
            "mnist",
            "--data-dir",
            str(mnist_root),
            "--download",
            "--model",
            "cnn",
            "--epochs",
            "1",
            "--batch-size",
            "32",
            "--lr",
            "2e-3",
            "--no-progress",
            "--log-every",
            "200",
            "--dist-timeout",
            "60",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ],
        nproc=2,
    )
    assert_ok(result)
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert state["metrics"]["val_acc"] >= 0.97, result.stdout
    assert "(10000 samples)" in result.stdout  # the whole test set, each image once
