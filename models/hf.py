"""--model hf: a transformers model, fine-tuned from a local folder (--model-path) or built untrained from a
config (--model-config): a causal language model (AutoModelForCausalLM), or with --num-classes or
--label-column a sequence classifier (AutoModelForSequenceClassification: the folder's body under a new head of
the data set's classes, given the tokenizer's padding token, by which it finds each text's last token).

The weights are float32 whatever the folder holds (--amp trains in lower precision). The data set has read the
model's config already, and checked the tokenizer and --block-size against it (data/hf_text.py). Imported only
for --model hf (models/__init__.py), so runs of the other models never import transformers.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from multigpu.config import TrainConfig
from multigpu.data.hf import import_transformers, last_line
from multigpu.data.hf_text import load_tokenizer, model_config
from multigpu.data.packing import keep_documents_apart, packing_of
from multigpu.errors import UsageError


def hf_model(num_classes: int, config: TrainConfig) -> nn.Module:
    """--model hf for `num_classes` classes (a classifier's; a language model keeps its own vocabulary); a causal
    language model fed packed documents (--packing documents, data/packing.py) keeps each document to itself."""
    model = _loaded(num_classes, config)
    packed = not config.text_classification and not config.pad_to_batch
    if packed and packing_of(config, model_config(config)) == "documents":
        keep_documents_apart(model)
    return model


def _loaded(num_classes: int, config: TrainConfig) -> nn.Module:
    """The model of --model-path's folder, or built from --model-config."""
    transformers = import_transformers("--model hf")
    settings = model_config(config)
    auto = transformers.AutoModelForCausalLM
    if config.text_classification:
        auto = transformers.AutoModelForSequenceClassification
        settings.num_labels = num_classes
        settings.pad_token_id = load_tokenizer(config).pad_token_id
    try:
        if config.model_path is None:
            return auto.from_config(settings, dtype=torch.float32)
        return auto.from_pretrained(config.model_path, config=settings, dtype=torch.float32)
    except ValueError as error:  # no such head for this kind of model
        raise UsageError(
            f"--model hf: transformers has no {auto.__name__} for a {settings.model_type} model "
            f"({last_line(error)[:120]})"
        ) from None
    except OSError as error:  # a config without weights, or weights that do not read
        raise UsageError(
            f"--model-path {config.model_path}: its weights do not load ({last_line(error)[:200]}); "
            f"give a folder that a model's save_pretrained wrote, or --model-config "
            f"{config.model_path} for an untrained model"
        ) from None
