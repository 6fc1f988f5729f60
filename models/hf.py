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

A folder is taken only as what it is (docs/troubleshooting.md, "A model folder that trains the wrong thing"):
weights that do not read (a truncated file) or whose shapes contradict its config.json are one line; a model
that is not causal (an encoder such as BERT, whose every position sees the whole text) is refused under the
causal-LM objective; the weights a folder does not hold, which transformers initialises fresh (a new
classification head), are named on the plan line (models/__init__.py's `fresh_weights_note`).
"""

from __future__ import annotations

import importlib
import pickle
from typing import Any

import torch
import torch.nn as nn

from multigpu.config import TrainConfig
from multigpu.data.hf import import_transformers, last_line
from multigpu.data.hf_text import load_tokenizer, model_config
from multigpu.data.packing import keep_documents_apart, packing_of
from multigpu.errors import UsageError
from multigpu.models import FRESH_WEIGHTS
from multigpu.parallel import lora
from multigpu.precision import resolve_dtype

PROBE_TOKENS = 8  # the causality probe's sequence: two forwards of this many tokens


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
            model = auto.from_config(settings, dtype=torch.float32)
        else:
            model = _from_folder(auto, settings, config, four_bit(transformers, config))
            # Before any forward (the causality probe below is one): bitsandbytes' CPU packing of a 4-bit layer
            # for inference breaks on small layers (multigpu/parallel/lora.py).
            lora.keep_off_cpu_inference_packing(model)
    except ValueError as error:  # no such head for this kind of model
        raise UsageError(
            f"--model hf: transformers has no {auto.__name__} for a {settings.model_type} model "
            f"({last_line(error)[:120]})"
        ) from None
    except (OSError, EOFError, pickle.UnpicklingError) as error:  # no weights, or weights that do not read
        raise _unreadable(config, error) from None
    if not config.text_classification:
        check_causal(model, config)
    return model


def _from_folder(auto: Any, settings: Any, config: TrainConfig, loading_options: dict[str, Any]) -> nn.Module:
    """The folder's model (`loading_options`: --qlora's 4-bit loading), its weights checked against its config;
    the weights it lacks noted (FRESH_WEIGHTS)."""
    from safetensors import SafetensorError

    try:
        # Shapes that differ from the config are reported here (mismatched_keys), not raised as a traceback.
        model, loading = auto.from_pretrained(
            config.model_path,
            config=settings,
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            **loading_options,
        )
    except SafetensorError as error:  # a truncated or damaged model.safetensors
        raise _unreadable(config, error) from None
    except RuntimeError as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        raise _unreadable(config, error) from None  # a damaged pytorch_model.bin, say
    _refuse_mismatched(loading.get("mismatched_keys") or (), config)
    setattr(model, FRESH_WEIGHTS, sorted(loading.get("missing_keys") or ()))
    return model


def _unreadable(config: TrainConfig, error: BaseException) -> UsageError:
    return UsageError(
        f"--model-path {config.model_path}: its weights do not load ({last_line(error)[:200]}); a truncated "
        f"or damaged file? copy the folder again, give a folder that a model's save_pretrained wrote, or "
        f"--model-config {config.model_path} for an untrained model"
    )


def _refuse_mismatched(mismatched: Any, config: TrainConfig) -> None:
    """UsageError naming the first weight whose shape in the folder contradicts the one its config.json builds
    (a vocab_size edited, a classifier saved for another number of classes)."""
    if not mismatched:
        return
    name, saved, built = sorted(mismatched, key=lambda entry: entry[0])[0]
    more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
    raise UsageError(
        f"--model-path {config.model_path}: its weights do not fit its config.json: {name} is "
        f"{_shape(saved)} in the weights, {_shape(built)} as the config builds it{more}; give the config "
        f"these weights were saved with (vocab_size, num_labels ...), or a folder whose files belong together"
    )


def _shape(size: Any) -> str:
    return "x".join(str(int(n)) for n in size)


def check_causal(model: nn.Module, config: TrainConfig) -> None:
    """UsageError naming the model's class where an earlier position's logits change with a later token: the
    model sees the tokens it is asked to predict (an encoder such as BERT), and a causal-LM objective would
    train it to copy them. Two forwards of PROBE_TOKENS tokens, on the model's device, in eval mode."""
    seen = _sees_ahead(model)
    if seen is None:
        return
    position, token = seen
    flag = (
        f"--model-path {config.model_path}" if config.model_path else f"--model-config {config.model_config}"
    )
    raise UsageError(
        f"{flag}: {type(model).__name__} is not a causal language model (position {position}'s logits change "
        f"when token {token} changes: it sees the tokens it is to predict), and --model hf trains a causal "
        f"LM; give a decoder's folder (GPT-2, Llama, Qwen ...), or --num-classes N (or --label-column) to "
        f"train it as a classifier"
    )


def _sees_ahead(model: nn.Module) -> tuple[int, int] | None:
    """(the first position whose logits change, the last token, which was changed), or None for a causal model:
    no earlier position's logits change."""
    settings: Any = model.config  # a transformers model's
    length = min(PROBE_TOKENS, getattr(settings, "max_position_embeddings", None) or PROBE_TOKENS)
    vocabulary = int(settings.vocab_size)
    device = next(model.parameters()).device
    ids = (torch.arange(length, device=device) % vocabulary)[None]
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % vocabulary
    was_training = model.training
    model.eval()  # no dropout: the same input gives the same logits
    try:
        with torch.no_grad():
            before = model(input_ids=ids).logits[0, : length - 1].float()
            after = model(input_ids=changed).logits[0, : length - 1].float()
    finally:
        model.train(was_training)
    differs = (~torch.isclose(before, after, rtol=1e-4, atol=1e-5)).any(-1).nonzero()
    return None if len(differs) == 0 else (int(differs[0]), length - 1)


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
