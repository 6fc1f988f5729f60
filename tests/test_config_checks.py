"""Flags that do nothing: one warning line each when the user gave them, none when they mean something or were
not given (multigpu/config_checks.py)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

import main_multi_gpu
from conftest import REPO
from multigpu.config import TrainConfig, parse_config
from multigpu.config_checks import RunFacts, ignored_flags
from multigpu.launch import launch_rules
from multigpu.launch.answers import TRAINING, Settings

NO_CONVOLUTIONS = RunFacts(convolutions=False)
HF_TEXT = ["--dataset", "hf", "--data-files", "t.jsonl", "--text-column", "text", "--model-path", "m"]

# name: (flags that do nothing, the warning, the same flag where it does something)
UNUSED = {
    "lr-gamma under cosine": (
        ["--lr-gamma", "0.5"],
        "--lr-gamma 0.5 has no effect: it shapes --lr-schedule step, and this run's schedule is cosine",
        ["--lr-gamma", "0.5", "--lr-schedule", "step"],
    ),
    "lr-step-epochs under constant": (
        ["--lr-step-epochs", "2", "--lr-schedule", "constant"],
        "--lr-step-epochs 2.0 has no effect: it shapes --lr-schedule step, and this "
        "run's schedule is constant",
        ["--lr-step-epochs", "2", "--lr-schedule", "step"],
    ),
    "momentum with adamw": (
        ["--momentum", "0.5"],
        "--momentum 0.5 has no effect: it is SGD's momentum, and --optimizer adamw has none",
        ["--momentum", "0.5", "--optimizer", "sgd"],
    ),
    "lr-base-batch without scaling": (
        ["--lr-base-batch", "256"],
        "--lr-base-batch 256 has no effect: --lr-scaling none uses --lr as given",
        ["--lr-base-batch", "256", "--lr-scaling", "linear"],
    ),
    "keep-last without step checkpoints": (
        ["--keep-last", "5"],
        "--keep-last 5 has no effect: it counts step "
        "checkpoints, and without --save-every-steps there are none",
        ["--keep-last", "5", "--save-every-steps", "100"],
    ),
    "train-size with a real data set": (
        ["--train-size", "100", "--dataset", "mnist"],
        "--train-size 100 has no "
        "effect: it sizes the synthetic and fake data sets, and --dataset mnist has "
        "its own",
        ["--train-size", "100", "--dataset", "fake"],
    ),
    "num-classes with an image folder": (
        ["--num-classes", "3", "--dataset", "imagefolder"],
        "--num-classes 3 has no effect",
        ["--num-classes", "3"],
    ),
    "image-shape with cifar10": (
        ["--image-shape", "3,64,64", "--dataset", "cifar10"],
        "--image-shape 3,64,64 has no effect: --dataset cifar10 has images of its own shape",
        ["--image-shape", "3,64,64", "--dataset", "imagefolder"],
    ),
    "data-dir with synthetic data": (
        ["--data-dir", "/data"],
        "--data-dir /data has no effect: --dataset synthetic is generated in memory",
        ["--data-dir", "/data", "--dataset", "mnist"],
    ),
    "download with synthetic data": (
        ["--download"],
        "--download has no effect: --dataset synthetic is generated",
        ["--download", "--dataset", "cifar10"],
    ),
    "download with an image folder": (
        ["--download", "--dataset", "imagefolder"],
        "--download has no effect: an image folder is read as it is",
        ["--download", "--dataset", "mnist"],
    ),
    "n-layer with a model other than gpt": (
        ["--n-layer", "4"],
        "--n-layer 4 has no effect: it sizes --model gpt, and this run's model is cnn",
        ["--n-layer", "4", "--dataset", "text", "--data-file", "t.txt"],
    ),
    "image-shape with a text": (
        ["--image-shape", "3,8,8", "--dataset", "text", "--data-file", "t.txt"],
        "--image-shape 3,8,8 has no effect: --dataset text gives windows of characters",
        ["--image-shape", "3,8,8"],
    ),
    "data-dir with a text": (
        ["--data-dir", "/data", "--dataset", "text", "--data-file", "t.txt"],
        "--data-dir /data has no effect: --dataset text reads --data-file as it is",
        ["--data-dir", "/data", "--dataset", "mnist"],
    ),
    "block-size with an image model": (
        ["--block-size", "32"],
        "--block-size 32 has no effect: it sizes --model gpt and --model hf, and this run's model is cnn",
        [*HF_TEXT, "--block-size", "32"],
    ),
    "image-shape with a text column": (
        [*HF_TEXT, "--image-shape", "3,8,8"],
        "--image-shape 3,8,8 has no effect: --model hf's text gives tokens",
        ["--image-shape", "3,8,8"],
    ),
    "pad-to-batch with a classifier": (
        [*HF_TEXT, "--pad-to-batch", "--num-classes", "2"],
        "--pad-to-batch has no effect: a classifier's texts are always padded",
        [*HF_TEXT, "--pad-to-batch"],
    ),
    "fsdp-blocks under ddp": (
        ["--fsdp-blocks", "Block", "--multi-gpu", "ddp"],
        "--fsdp-blocks Block has no effect: it shapes --multi-gpu fsdp, and this run is --multi-gpu ddp",
        ["--fsdp-blocks", "Block", "--multi-gpu", "fsdp"],
    ),
    "dp-replicate under ddp": (
        ["--dp-replicate", "2", "--multi-gpu", "ddp"],
        "--dp-replicate 2 has no effect: it shapes --multi-gpu fsdp, and this run is --multi-gpu ddp",
        ["--dp-replicate", "2", "--multi-gpu", "fsdp"],
    ),
    "fsdp-accumulate without accumulation": (
        ["--fsdp-accumulate", "sharded", "--multi-gpu", "fsdp"],
        "--fsdp-accumulate sharded has no effect: it says how the inner "
        "micro-steps of --grad-accum-steps keep their gradients",
        ["--fsdp-accumulate", "sharded", "--multi-gpu", "fsdp", "--grad-accum-steps", "2"],
    ),
    "early-stop-min-delta without early stopping": (
        ["--early-stop-min-delta", "0.01"],
        "--early-stop-min-delta 0.01 "
        "has no effect: it is the least improvement --early-stop-patience "
        "counts, and that is off",
        ["--early-stop-min-delta", "0.01", "--early-stop-patience", "3"],
    ),
}


@pytest.mark.parametrize("name", UNUSED)
def test_a_given_flag_that_does_nothing_gets_one_warning_and_none_where_it_means_something(name):
    unused, expected, meaningful = UNUSED[name]
    config = parse_config(unused)
    warnings = ignored_flags(config, config.given, RunFacts())
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {expected}"), warnings
    config = parse_config(meaningful)
    assert ignored_flags(config, config.given, RunFacts()) == []


def test_channels_last_with_a_model_without_convolutions_is_a_warning():
    config = parse_config(["--channels-last", "--mode", "flatten"])
    assert ignored_flags(config, config.given, NO_CONVOLUTIONS) == [
        "warning: --channels-last has no effect: the model has no convolutions (no 4-D weights), so there is nothing "
        "to store channels-last"
    ]
    assert ignored_flags(config, config.given, RunFacts(convolutions=True)) == []


def test_max_steps_beyond_what_the_epochs_train_is_a_warning():
    """--epochs 2 of 8 steps end the run at 16: --max-steps 20 never ends it, --max-steps 16 or 12 does."""
    config = parse_config(["--max-steps", "20", "--epochs", "2"])
    assert ignored_flags(config, config.given, RunFacts(steps_per_epoch=8)) == [
        "warning: --max-steps 20 has no effect: --epochs 2 of 8 steps end the run first, at 16 steps; raise --epochs "
        "to train 20 steps"
    ]
    for steps in ("16", "12"):
        config = parse_config(["--max-steps", steps, "--epochs", "2"])
        assert ignored_flags(config, config.given, RunFacts(steps_per_epoch=8)) == []


def test_a_flag_given_its_default_value_is_still_a_given_flag():
    config = parse_config(["--lr-gamma", "0.1"])  # 0.1 is the default: the user still asked for it
    assert [line.split(":")[1] for line in ignored_flags(config, config.given, RunFacts())] == [
        " --lr-gamma 0.1 has no effect"
    ]


def test_defaults_and_flags_asking_for_nothing_never_warn():
    for config in (parse_config([]), TrainConfig(), parse_config(["--no-download", "--no-channels-last"])):
        assert ignored_flags(config, config.fields_given, NO_CONVOLUTIONS) == []


def test_in_python_a_field_counts_as_given_when_it_differs_from_its_default():
    config = TrainConfig(momentum=0.5, keep_last=3)  # keep_last's default: not given
    assert config.fields_given == {"momentum"}
    assert [line.split(":")[1] for line in ignored_flags(config, config.fields_given, RunFacts())] == [
        " --momentum 0.5 has no effect"
    ]


def test_a_users_optimizer_or_schedule_owns_momentum_and_the_decay():
    config = TrainConfig(momentum=0.5, lr_gamma=0.5)
    assert (
        ignored_flags(config, config.fields_given, RunFacts(builtin_optimizer=False, builtin_schedule=False))
        == []
    )


def test_the_test_harness_flags_are_not_the_users(monkeypatch):
    monkeypatch.setenv("MULTIGPU_TEST_ARGS", "--train-size 64")
    config = parse_config(["--dataset", "mnist"])
    assert config.train_size == 64 and config.given == {"dataset"}
    assert ignored_flags(config, config.given, RunFacts()) == []


def test_the_launchers_command_with_every_default_answer_gets_no_warning(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # What `launch_multi_gpu.sh --yes` does: every question answered with its default, then the plan.
    defaults = {
        key.removeprefix("default-").replace("-", "_"): value
        for key, value in launch_rules.check(Settings())
        if key.startswith("default-")
    }
    answers: dict[str, Any] = {
        name: value for name, value in defaults.items() if name in TRAINING and value != "None"
    }
    records = dict(launch_rules.plan(Settings(**answers)))
    argv = shlex.split(records["command"])
    trainer_args = argv[argv.index(str(REPO / "main_multi_gpu.py")) + 1 :]
    assert "--lr-scaling" in trainer_args  # the launcher gives its answers explicitly, defaults included
    config = parse_config(trainer_args)
    assert config.given is not None  # parse_config notes the flags given
    assert ignored_flags(config, config.given, RunFacts()) == []


def test_the_run_prints_each_warning_once_before_training(tmp_path: Path, capsys: pytest.CaptureFixture):
    code = main_multi_gpu.main(
        [
            "--train-size",
            "32",
            "--val-size",
            "16",
            "--batch-size",
            "16",
            "--epochs",
            "1",
            "--no-progress",
            "--save-dir",
            str(tmp_path / "ckpt"),
            "--keep-last",
            "2",
            "--mode",
            "flatten",
            "--channels-last",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert [line.split(":")[1] for line in warnings] == [
        " --keep-last 2 has no effect",
        " --channels-last has no effect",
    ]
    assert lines.index(warnings[-1]) < next(i for i, line in enumerate(lines) if line.startswith("step "))
