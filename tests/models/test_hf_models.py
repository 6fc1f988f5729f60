"""--model hf (models/hf.py): a local transformers folder fine-tuned as it was saved, or built untrained from its
config, as a causal language model or a sequence classifier; transformers imported only for it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from conftest import PYTHON, REPO, cli_env
from multigpu.config import TrainConfig, parse_config
from multigpu.data.hf import import_transformers
from multigpu.errors import UsageError
from multigpu.models import build_model


def _config(tiny_lm, *flags: str) -> TrainConfig:
    return parse_config(
        ["--dataset", "hf", "--data-files", str(tiny_lm / "train.jsonl"), "--text-column", "text", *flags]
    )


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_model_folder_is_a_float32_causal_lm_holding_its_saved_weights(tiny_lm):
    from transformers import AutoModelForCausalLM

    model = build_model("hf", (32,), 150, _config(tiny_lm, "--model-path", str(tiny_lm / "model")))
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert _same_weights(model, AutoModelForCausalLM.from_pretrained(tiny_lm / "model"))


def test_a_config_builds_an_untrained_model_the_same_for_the_same_seed(tiny_lm):
    from transformers import AutoModelForCausalLM

    config = _config(
        tiny_lm,
        "--model-config",
        str(tiny_lm / "model" / "config.json"),
        "--tokenizer",
        str(tiny_lm / "model"),
        "--seed",
        "1",
    )  # the folder's weights were drawn with seed 0
    built = []
    for _ in range(2):
        torch.manual_seed(config.seed)  # as the runner does on every rank
        built.append(build_model("hf", (32,), 150, config))
    assert _same_weights(*built)
    assert not _same_weights(built[0], AutoModelForCausalLM.from_pretrained(tiny_lm / "model"))


def test_a_classifier_gets_a_head_of_the_data_sets_classes_and_pads_with_the_end_of_text_token(tiny_lm):
    config = _config(tiny_lm, "--model-path", str(tiny_lm / "model"), "--num-classes", "3")
    model = build_model("hf", (32,), 3, config)
    assert type(model).__name__ == "GPT2ForSequenceClassification"
    assert (
        model.config.num_labels == 3 and model.config.pad_token_id == 0
    )  # no padding token: end-of-text's id
    ids = torch.tensor([[5, 6, 7], [5, 6, 0]])
    outputs = model(input_ids=ids, attention_mask=(ids != 0).long(), labels=torch.tensor([0, 2]))
    assert outputs.logits.shape == (2, 3) and outputs.loss.dim() == 0


def test_a_run_of_another_model_never_imports_transformers():
    probe = "import sys; import multigpu.launch.runner; print(sorted({'transformers', 'datasets'} & set(sys.modules)))"
    result = subprocess.run(
        [PYTHON, "-c", probe], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_without_transformers_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # its import fails, as where it is not installed
    with pytest.raises(
        UsageError,
        match=re.escape(
            "--model hf needs the Hugging Face transformers library, which is "
            "not installed: pip install -e '.[hf]'"
        ),
    ):
        import_transformers("--model hf")
