"""TrainConfig is the one source of the CLI flags, the checkpoint's config and the hparams."""

from __future__ import annotations

import dataclasses
import re

import pytest

from multigpu.config import RANGES, TrainConfig, build_parser, field_kind, flag, parse_config, to_argv
from multigpu.errors import UsageError


def test_every_field_is_a_flag_and_every_flag_a_field():
    parser = build_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    for field in dataclasses.fields(TrainConfig):
        assert f"--{flag(field.name)}" in flags, field.name
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    own = {a.dest for a in parser._actions if a.dest not in ("help", "local_rank")}
    assert own == fields


def test_defaults_of_the_cli_are_the_dataclass_defaults():
    assert parse_config([]) == TrainConfig()


def test_to_argv_round_trips_through_the_parser():
    config = TrainConfig(
        batch_size=16,
        grad_accum_steps=4,
        lr=3e-4,
        lr_scaling="sqrt",
        progress=False,
        multi_gpu="ddp",
        warmup_epochs=0.5,
        log_dir="runs/x",
    )
    assert parse_config(to_argv(config)) == config
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_old_launchers_local_rank_flag_is_tolerated():
    assert parse_config(["--local-rank", "3"]) == TrainConfig()
    assert parse_config(["--local_rank=1"]) == TrainConfig()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"lr": -1.0}, "--lr must not be negative"),
        ({"warmup_epochs": -0.5}, "--warmup-epochs must not be negative"),
        ({"image_shape": "3x32x32"}, "--image-shape must be C,H,W"),
        ({"lr_schedule": "linear"}, "--lr-schedule must be one of cosine, step, constant"),
        (
            {"batch_size": "big"},
            r"TrainConfig batch_size \(--batch-size\) must be an int or 'auto', got 'big' \(str\)",
        ),
        ({"batch_size": 6.5}, r"must be an int or 'auto', got 6.5 \(float\)"),
        ({"compile": 1}, r"TrainConfig compile \(--compile\) must be a bool, got 1 \(int\)"),
        (
            {"warmup_steps": 10, "warmup_epochs": 0.5},
            "--warmup-steps 10 and --warmup-epochs 0.5 both set the warm-up: give one of them",
        ),
        ({"packing": "greedy"}, "--packing must be one of auto, documents, stream"),
        (
            {"dataset": "hf", "data_files": "t.jsonl", "model_path": "m", "prompt_column": "p"},
            "--prompt-column needs --completion-column",
        ),
        ({"chat_template": "t.jinja"}, "--chat-template renders the conversations of --messages-column"),
    ],
)
def test_invalid_values_are_usage_errors_naming_the_flag(values, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**values)


def test_none_means_not_set_for_every_field():
    """TrainConfig(max_steps=None) is a caller's "not set": every field given None is its default (or None where
    None is a value of its own), as the command line without the flag gives."""
    for f in dataclasses.fields(TrainConfig):
        config = TrainConfig(**{f.name: None})
        assert getattr(config, f.name) == f.default, f.name
        assert config == TrainConfig(), f.name
    assert TrainConfig(max_steps=None, epochs=2).planned_steps(10) == 20  # no step limit: every epoch


def test_batch_size_is_a_number_or_auto_in_the_dataclass_and_on_the_command_line():
    assert TrainConfig(batch_size=64).batch_size == 64 and TrainConfig(batch_size="auto").batch_size == "auto"
    assert parse_config(["--batch-size", "auto"]).batch_size == "auto"
    assert parse_config(["--batch-size", "48"]).batch_size == 48
    assert to_argv(TrainConfig(batch_size="auto")) == ["--batch-size", "auto"]
    with pytest.raises(
        UsageError,
        match=r"^argument --batch-size: must be a whole number or auto, got 'lots' "
        r"\(see --help\)$",
    ):
        parse_config(["--batch-size", "lots"])


def test_default_model_follows_the_mode_and_the_text_data_set():
    assert TrainConfig().model_name == "cnn"
    assert TrainConfig(mode="flatten").model_name == "mlp"
    assert TrainConfig(mode="flatten", model="mlp").model_name == "mlp"
    assert TrainConfig(dataset="text", data_file="tiny.txt").model_name == "gpt"
    assert (
        TrainConfig(dataset="hf", data_files="t.jsonl", text_column="text", model_path="m").model_name == "hf"
    )
    assert TrainConfig(save_dir="out").tensorboard_dir == "out/tb"


HF_TEXT = ["--dataset", "hf", "--data-files", "t.jsonl", "--text-column", "text"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "hf", "--model-path", "m"],
            "--model hf reads text files through --dataset hf --text-column COLUMN, "
            "and this run's data set is synthetic",
        ),
        (
            ["--dataset", "hf", "--data-files", "t.jsonl", "--model", "hf", "--model-path", "m"],
            "--model hf needs --text-column COLUMN",
        ),
        (
            [*HF_TEXT, "--model", "mlp"],
            "--text-column gives tokens, which only --model hf reads, and this run's model is mlp",
        ),
        (
            HF_TEXT,
            "--model hf needs one of --model-path FOLDER (a model to fine-tune) and --model-config FOLDER_OR_JSON "
            "(an untrained model built from a config); neither given",
        ),
        ([*HF_TEXT, "--model-path", "m", "--model-config", "c.json"], "; both given"),
        (
            [*HF_TEXT, "--model-config", "c.json"],
            "--model-config builds an untrained model, which has no tokenizer: add --tokenizer FOLDER",
        ),
        (["--model-path", "m"], "--model-path is for --model hf, and this run's model is cnn"),
        (
            ["--text-column", "text"],
            "--text-column is for --dataset hf, and this run's data set is synthetic",
        ),
    ],
)
def test_model_hf_and_the_text_it_reads_are_given_together(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_config(argv)


def test_a_text_column_trains_a_classifier_when_classes_or_labels_are_named_and_the_model_has_a_tokenizer():
    causal = parse_config([*HF_TEXT, "--model-path", "m"])
    assert not causal.text_classification and causal.tokenizer_path == "m"
    for named in (["--num-classes", "2"], ["--label-column", "label"]):  # the default label column, named
        assert parse_config([*HF_TEXT, "--model-path", "m", *named]).text_classification
    assert parse_config([*HF_TEXT, "--model-config", "c.json", "--tokenizer", "t"]).tokenizer_path == "t"


def test_every_numeric_field_has_a_range():
    numeric = {f.name for f in dataclasses.fields(TrainConfig) if field_kind(f) in ("int", "float")}
    assert numeric == set(RANGES)


def test_ints_are_accepted_for_float_fields_and_stored_as_floats():
    config = TrainConfig(lr=1, dist_timeout=60)
    assert (config.lr, type(config.lr), type(config.dist_timeout)) == (1.0, float, float)


def test_the_hang_timeout_defaults_below_the_dist_timeout_and_0_turns_the_watchdog_off():
    assert TrainConfig().watchdog_seconds == 300  # --dist-timeout 1800
    assert TrainConfig(dist_timeout=60).watchdog_seconds == 30
    assert TrainConfig(hang_timeout=0).watchdog_seconds == 0
    with pytest.raises(UsageError, match="--hang-timeout 60 must be below --dist-timeout 60"):
        TrainConfig(dist_timeout=60, hang_timeout=60)


@pytest.mark.parametrize(
    "replicate, shard, world, nodes, shape",
    [
        (None, None, 4, 1, (1, 4)),  # one node: shard over every process, as fsdp always did
        (None, None, 8, 2, (2, 4)),  # several nodes: shard within a node, replicate across the nodes
        (None, -1, 4, 2, (2, 2)),
        (2, None, 4, 1, (2, 2)),
        (2, -1, 4, 1, (2, 2)),
        (4, -1, 4, 1, (4, 1)),
        (None, 2, 8, 1, (4, 2)),
        (1, None, 8, 2, (1, 8)),
        (None, 3, 6, 1, (2, 3)),
        (None, None, 1, 1, (1, 1)),
        (1, -1, 1, 1, (1, 1)),
    ],
)
def test_the_mesh_is_the_flags_or_the_nodes_by_their_processes(replicate, shard, world, nodes, shape):
    assert TrainConfig(dp_replicate=replicate, dp_shard=shard).mesh_shape(world, nodes) == shape


@pytest.mark.parametrize(
    "replicate, shard, world, message",
    [
        (
            2,
            3,
            4,
            "--dp-replicate 2 x --dp-shard 3 = 6 processes, but this run has 4 processes: make replicate x shard "
            "= 4, or give --dp-shard -1 for the processes left",
        ),
        (
            3,
            None,
            4,
            "--dp-replicate 3 does not divide this run's 4 processes into equal groups: give one of 1, 2, 4",
        ),
        (
            2,
            2,
            1,
            "--dp-replicate 2 --dp-shard 2 needs 4 processes, and this run is one process: start it with torchrun "
            "--nproc_per_node=4",
        ),
        (None, 2, 1, "--dp-shard 2 needs at least 2 processes, and this run is one process"),
    ],
)
def test_a_mesh_the_processes_cannot_fill_is_refused_in_one_line(replicate, shard, world, message):
    with pytest.raises(UsageError) as error:
        TrainConfig(dp_replicate=replicate, dp_shard=shard).mesh_shape(world)
    assert str(error.value).startswith(message)
