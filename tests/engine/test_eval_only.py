"""--eval-only (multigpu/engine/eval_only.py): a saved model's per-token validation loss, packed (documents) or
padded, at 1 and 2 processes, is the mean over every predicted token of each text alone computed by hand; the
results go to <save-dir>/eval.json and no checkpoint is written; without weights it is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import main_multi_gpu
from conftest import assert_ok, assert_one_line, run_forked_workers

BLOCK = 64  # longer than every validation text: each is a document whole


def _args(tiny_lm: Path, save_dir: Path, *flags: str) -> list[str]:
    return [
        "--dataset",
        "hf",
        "--data-files",
        str(tiny_lm / "val.jsonl"),
        "--val-files",
        str(tiny_lm / "val.jsonl"),
        "--text-column",
        "text",
        "--model-path",
        str(tiny_lm / "model"),
        "--block-size",
        str(BLOCK),
        "--batch-size",
        "7",
        "--no-progress",
        "--dist-timeout",
        "60",
        "--save-dir",
        str(save_dir),
        "--eval-only",
        *flags,
    ]


@pytest.fixture(scope="module")
def by_hand(tiny_lm: Path) -> dict[str, float]:
    """The model folder's mean loss over every predicted token of each validation text alone: its tokens then the
    end-of-text token as packing makes it ("--packing=documents"), its tokens alone as a padded text
    ("--pad-to-batch")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_lm / "model").eval()
    means = {}
    for layout, end in (("--packing=documents", [tokenizer.eos_token_id]), ("--pad-to-batch", [])):
        total, count = 0.0, 0
        with torch.no_grad():
            for line in (tiny_lm / "val.jsonl").read_text().splitlines():
                ids = torch.tensor(tokenizer(json.loads(line)["text"])["input_ids"] + end)
                assert len(ids) <= BLOCK
                logits = model(input_ids=ids[None]).logits[0, :-1]
                total += torch.nn.functional.cross_entropy(logits.double(), ids[1:], reduction="sum").item()
                count += len(ids) - 1
        means[layout] = total / count
    return means


def _evaluated(save_dir: Path) -> dict:
    written = json.loads((save_dir / "eval.json").read_text())
    assert sorted(path.name for path in save_dir.iterdir() if path.name != "tb") == [
        "eval.json"
    ]  # no checkpoint
    return written


@pytest.mark.parametrize("layout", ["--packing=documents", "--pad-to-batch"])
def test_one_process_gives_the_mean_over_each_text_alone(tiny_lm, tmp_path, by_hand, layout, capsys):
    assert main_multi_gpu.main(_args(tiny_lm, tmp_path / "eval", layout)) == 0  # in this process: no start-up
    written = _evaluated(tmp_path / "eval")
    assert written["val_loss"] == pytest.approx(by_hand[layout], abs=1e-5)
    assert written["val_perplexity"] == pytest.approx(math.exp(by_hand[layout]), rel=1e-5)
    padded = layout == "--pad-to-batch"
    assert (written["samples"] == 80) == padded  # the 80 texts, or fewer windows of them
    assert f"eval of --model-path {tiny_lm / 'model'}: val loss" in capsys.readouterr().out


@pytest.mark.slow  # the quick tier's one-process test checks the same sums
@pytest.mark.parametrize("layout", ["--packing=documents", "--pad-to-batch"])
def test_two_processes_give_the_same(tiny_lm, tmp_path, by_hand, layout):
    ranks = run_forked_workers(
        main_multi_gpu.main, _args(tiny_lm, tmp_path / "eval", layout, "--multi-gpu", "ddp"), 2, tmp_path
    )
    for rank in ranks:
        assert_ok(rank)
    written = _evaluated(tmp_path / "eval")
    assert written["processes"] == 2 and written["val_loss"] == pytest.approx(by_hand[layout], abs=1e-5)


@pytest.mark.slow  # a training run first; the quick tier evaluates a model folder
def test_a_checkpoint_is_evaluated_with_resume_as_its_run_evaluated_it(tiny_lm, tmp_path, capsys):
    train = [
        arg
        for arg in _args(tiny_lm, tmp_path / "run", "--epochs", "1", "--lr", "3e-3")
        if arg != "--eval-only"
    ]
    assert main_multi_gpu.main(train) == 0
    said = float(capsys.readouterr().out.split("val loss ")[1].split(",")[0])
    assert (
        main_multi_gpu.main(_args(tiny_lm, tmp_path / "eval", "--resume", str(tmp_path / "run" / "best.pt")))
        == 0
    )
    assert _evaluated(tmp_path / "eval")["val_loss"] == pytest.approx(said, abs=1e-4)  # printed to 4 places


def test_without_weights_it_is_refused_in_one_line(tiny_lm, tmp_path, capsys):
    code = main_multi_gpu.main(
        ["--dataset", "synthetic", "--eval-only", "--save-dir", str(tmp_path / "eval")]
    )
    assert_one_line(
        code,
        capsys.readouterr().err,
        "--eval-only evaluates saved weights, and this run names none: give --init-from PATH",
    )
    assert not (tmp_path / "eval").exists()
