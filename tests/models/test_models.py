"""The model registry builds every model for the shapes the data sets produce; --model gpt trains on a text."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import main_multi_gpu
from conftest import DIST_TIMEOUT, TINY_GPT, run_cli, tiny_text
from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.models import GPT, MODELS, TEXT_MODELS, TransformerBlock, build_model

IMAGE_MODELS = sorted(set(MODELS) - set(TEXT_MODELS))


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_every_model_maps_images_to_class_scores(name, shape):
    model = build_model(name, shape, 7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, *shape)).shape == (2, 7)


def test_mlp_takes_flattened_samples_and_image_models_refuse_them():
    assert build_model("mlp", (784,), 10)(torch.randn(3, 784)).shape == (3, 10)
    with pytest.raises(UsageError, match="--mode flatten use --model mlp"):
        build_model("resnet18", (784,), 10)


def tiny_gpt(vocabulary: int = 11) -> GPT:
    config = TrainConfig(
        dataset="text", data_file="unused.txt", n_layer=2, n_embd=32, n_head=2, block_size=16
    )
    torch.manual_seed(0)
    return build_model("gpt", (config.block_size,), vocabulary, config)


def test_gpt_gives_logits_per_position_from_blocks_in_a_module_list_with_tied_weights():
    model = tiny_gpt()
    idx = torch.randint(11, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 11) and loss is None
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert all(isinstance(block, TransformerBlock) for block in model.blocks)
    assert model.lm_head.weight is model.token_embedding.weight
    assert model.position_embedding.weight.shape == (16, 32)


def test_gpt_loss_is_the_cross_entropy_over_every_position():
    model = tiny_gpt()
    idx, targets = torch.randint(11, (3, 16)), torch.randint(11, (3, 16))
    logits, loss = model(idx, targets)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(48, 11), targets.reshape(48)))


def test_gpt_attention_is_causal():
    model = tiny_gpt().eval()
    idx = torch.randint(11, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 11  # only positions 10 and later differ
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]
    assert torch.equal(before[0, :10], after[0, :10]) and not torch.equal(before[0, 10:], after[0, 10:])


def test_gpt_heads_must_divide_the_embedding():
    with pytest.raises(UsageError, match="--n-embd 30 must be a multiple of --n-head 4"):
        GPT(11, 16, n_layer=1, n_head=4, n_embd=30)


def test_gpt_trains_on_a_text_file_in_process_and_lowers_the_val_loss(tmp_path):
    text = tiny_text(tmp_path / "tiny.txt")
    vocabulary = len(set(text.read_text()))
    summaries = []
    code = main_multi_gpu.main(
        [
            *TINY_GPT,
            "--data-file",
            str(text),
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--lr",
            "1e-2",
            "--no-progress",
            "--save-dir",
            str(tmp_path / "run"),
        ],
        on_summary=summaries.append,
    )
    assert code == 0
    # Untrained, the logits are near zero: the loss is that of a uniform guess, ln(vocabulary).
    assert summaries[0]["val_loss"] < math.log(vocabulary) - 0.5, (summaries[0], math.log(vocabulary))
    assert summaries[0]["monitor"] == "val_loss"


@pytest.mark.slow
def test_gpt_trains_under_ddp_on_two_processes(tmp_path):
    text = tiny_text(tmp_path / "tiny.txt")
    result = run_cli(
        [
            *TINY_GPT,
            "--data-file",
            str(text),
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--lr",
            "1e-2",
            "--no-progress",
            "--dist-timeout",
            str(DIST_TIMEOUT),
            "--save-dir",
            str(tmp_path / "run"),
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mode ddp" in result.stdout, result.stdout
    best = float(re.search(r"done: best val loss ([\d.]+)", result.stdout).group(1))
    assert best < math.log(len(set(text.read_text()))) - 0.5, result.stdout
