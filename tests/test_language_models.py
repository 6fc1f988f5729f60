"""docs/language-models.md, run: the command line fine-tunes a transformers model folder on JSONL text (one CPU
process, and 2 under torchrun), its per-token validation loss falls, and --export-on-end hf writes a folder that
AutoModelForCausalLM and AutoTokenizer load and generate from; bad input is one line and exit 2."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import main_multi_gpu
import predict_multi_gpu
from conftest import assert_ok, assert_one_line, run_cli

EPOCHS = 3


def _fine_tune(tiny_lm: Path, save_dir: Path, nproc: int | None = None) -> list[float]:
    """The CLI's run on the tiny model folder (packed windows of 32 tokens); its validation losses, epoch by
    epoch."""
    args = [
        "--dataset",
        "hf",
        "--data-files",
        str(tiny_lm / "train.jsonl"),
        "--val-files",
        str(tiny_lm / "val.jsonl"),
        "--text-column",
        "text",
        "--model",
        "hf",
        "--model-path",
        str(tiny_lm / "model"),
        "--block-size",
        "32",
        "--packing",
        "stream",
        "--batch-size",
        "16",
        "--epochs",
        str(EPOCHS),
        "--lr",
        "3e-3",
        "--export-on-end",
        "hf",
        "--no-progress",
        "--save-dir",
        str(save_dir),
        *(["--multi-gpu", "ddp"] if nproc else []),
    ]
    result = run_cli(args, nproc=nproc)
    assert_ok(result)
    assert f"exported the trained weights of {save_dir / 'best.pt'}" in result.stdout, result.stdout
    assert (
        "its tokenizer pads with its end-of-text token <|endoftext|> (it had no padding token)"
        in result.stdout
    )
    return [float(loss) for loss in re.findall(r"^epoch \d+/\d+: val loss ([\d.]+)", result.stdout, re.M)]


def _loads_and_generates(folder: Path) -> list[int]:
    """The exported folder, loaded as a user does with no further step: 8 new tokens after a prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("the quick fox", return_tensors="pt")
    generated = model.generate(
        **prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    decoded = tokenizer.decode(generated[0])
    assert isinstance(decoded, str)  # one sequence's text
    assert generated.shape[1] > prompt["input_ids"].shape[1] and decoded.startswith("the quick")
    return generated[0].tolist()


def _loss_per_token(folder: Path, tiny_lm: Path) -> float:
    """The exported model's mean loss over every predicted token of the validation windows, computed here."""
    from transformers import AutoModelForCausalLM

    from multigpu.config import parse_config
    from multigpu.data import build_datasets

    config = parse_config(
        [
            "--dataset",
            "hf",
            "--data-files",
            str(tiny_lm / "val.jsonl"),
            "--text-column",
            "text",
            "--model-path",
            str(tiny_lm / "model"),
            "--block-size",
            "32",
            "--packing",
            "stream",
            "--val-files",
            str(tiny_lm / "val.jsonl"),
        ]
    )
    val = build_datasets(config).val  # as the run cut it: the last window padded, its padding -100
    windows = {name: torch.stack([val[i][name] for i in range(len(val))]) for name in val[0]}
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(folder)(
            input_ids=windows["input_ids"], attention_mask=windows["attention_mask"]
        ).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), windows["labels"][:, 1:].reshape(-1)
    ).item()


def test_a_model_folder_fine_tunes_on_jsonl_and_its_export_generates(tiny_lm, tmp_path):
    losses = _fine_tune(tiny_lm, tmp_path / "run")
    assert (
        len(losses) == EPOCHS and losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5
    ), losses
    exported = tmp_path / "run" / "best-hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in exported.iterdir()
    }
    _loads_and_generates(exported)
    from transformers import AutoTokenizer

    padded = AutoTokenizer.from_pretrained(exported)(["the fox", "the quick brown fox"], padding=True)
    assert padded["attention_mask"][0][-1] == 0  # the shorter text padded: the export has a padding token
    # The loss the run printed is the mean over tokens: the exported (best) weights give it again here.
    assert _loss_per_token(exported, tiny_lm) == pytest.approx(min(losses), abs=2e-4)


def test_its_checkpoint_is_loaded_as_a_transformers_model_not_predicted(tiny_lm, tmp_path, capsys):
    assert (
        main_multi_gpu.main(
            [
                "--dataset",
                "hf",
                "--data-files",
                str(tiny_lm / "val.jsonl"),
                "--text-column",
                "text",
                "--model-path",
                str(tiny_lm / "model"),
                "--epochs",
                "1",
                "--no-progress",
                "--save-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    code = predict_multi_gpu.main(
        ["--checkpoint", str(tmp_path / "run" / "last.pt"), "--output", str(tmp_path / "p.pt")]
    )
    assert_one_line(
        code,
        capsys.readouterr().err,
        "--model hf's checkpoints are not predicted here: load the model as a transformers model",
    )


@pytest.mark.slow
def test_the_same_under_torchrun_on_two_processes(tiny_lm, tmp_path):
    losses = _fine_tune(tiny_lm, tmp_path / "run", nproc=2)
    assert len(losses) == EPOCHS and losses == sorted(losses, reverse=True), losses
    _loads_and_generates(tmp_path / "run" / "best-hf")


def _not_a_model(tiny_lm: Path, tmp: Path) -> list[str]:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "README.md").write_text("a folder of notes\n")
    return ["--model-path", str(tmp / "notes"), "--tokenizer", str(tiny_lm / "model")]


def _smaller_vocabulary(tiny_lm: Path, tmp: Path) -> list[str]:
    shutil.copytree(tiny_lm / "model", tmp / "model")
    config = json.loads((tmp / "model" / "config.json").read_text())
    (tmp / "model" / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    return ["--model-path", str(tmp / "model")]


BAD = {
    "not a transformers model": (_not_a_model, "is not a transformers model: it holds no config.json"),
    "no such text column": (
        lambda tiny_lm, tmp: ["--model-path", str(tiny_lm / "model"), "--text-column", "body"],
        "--text-column body: the files' columns are text, label; name the column that holds "
        "each sample's text",
    ),
    "a tokenizer larger than the vocabulary": (
        _smaller_vocabulary,
        "the tokenizer has 150 tokens, more than the model's vocabulary of 100",
    ),
    "a block size above the context": (
        lambda tiny_lm, tmp: ["--model-path", str(tiny_lm / "model"), "--block-size", "128"],
        "--block-size 128 is above the model's context of 64 positions",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_exit_2(tiny_lm, tmp_path, capsys, name):
    flags, expected = BAD[name]
    code = main_multi_gpu.main(
        [
            "--dataset",
            "hf",
            "--data-files",
            str(tiny_lm / "train.jsonl"),
            "--text-column",
            "text",
            "--model",
            "hf",
            "--no-progress",
            "--save-dir",
            str(tmp_path / "run"),
            *flags(tiny_lm, tmp_path),
        ]
    )
    assert_one_line(code, capsys.readouterr().err, expected)
