"""--model hf: a transformers model, fine-tuned from a local folder (--model-path) or built untrained from a
config (--model-config): a causal language model (AutoModelForCausalLM), or with --num-classes or
--label-column a sequence classifier (AutoModelForSequenceClassification: the folder's body under a new head of
the data set's classes, given the tokenizer's padding token, by which it finds each text's last token).

The weights are float32 whatever the folder holds (--amp trains in lower precision); with --qlora the linear
layers are loaded in 4-bit NF4 instead (bitsandbytes through transformers' BitsAndBytesConfig, double-quantized
as in the QLoRA paper), computing in --amp's dtype, straight onto this process's device: the frozen base of a
LoRA fine-tune (multigpu/parallel/lora.py) in a quarter of bf16's memory. The data set has read the
model's config already, and checked the tokenizer and --block-size against it (data/hf_text.py). Imported only
for --model hf (models/__init__.py), so runs of the other models never import transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn as nn

from multigpu.config import TrainConfig
from multigpu.data.hf import import_transformers, last_line
from multigpu.data.hf_text import load_tokenizer, model_config
from multigpu.data.packing import keep_documents_apart, packing_of
from multigpu.errors import UsageError
from multigpu.parallel import lora
from multigpu.precision import resolve_dtype


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
            if config.qlora:
                raise UsageError(
                    "--qlora loads a trained model folder in 4-bit: give --model-path FOLDER, not --model-config"
                )
            return auto.from_config(settings, dtype=torch.float32)
        return auto.from_pretrained(
            config.model_path, config=settings, dtype=torch.float32, **four_bit(transformers, config)
        )
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


def four_bit(transformers: Any, config: TrainConfig) -> dict[str, Any]:
    """from_pretrained's arguments that load the linear layers in 4-bit NF4 for --qlora (none without it), onto
    this process's device (the one the run set up: bitsandbytes quantizes as it loads there)."""
    if not config.qlora:
        return {}
    lora.quiet_quantization_libraries()
    try:
        importlib.import_module("bitsandbytes")  # transformers imports it to load in 4-bit: it must import
    except ImportError:
        raise UsageError(
            "--qlora needs bitsandbytes, which is not installed: pip install '.[lora]'"
        ) from None
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    compute_dtype = resolve_dtype(config.amp, device, lambda line: None) or torch.float32
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    return {"quantization_config": quantization, "device_map": {"": device}}
