"""A LoRA run's checkpoint where users load it: its adapters merged into the base, or as a PEFT adapter folder.

A LoRA checkpoint holds the adapters alone (multigpu/parallel/lora.py); both exports rebuild the run's model
first: the base loaded from the folder the checkpoint recorded (4-bit for --qlora, as the run loaded it), checked
against the recorded fingerprint (another base is refused in one line), the adapters added as the run added them
and the checkpoint's loaded into them. Then

- `adapter`: peft's own `save_pretrained`, a folder of `adapter_config.json` and `adapter_model.safetensors`
  that `PeftModel.from_pretrained(base, folder)` loads;
- `hf` and `safetensors`: peft's `merge_and_unload`, the adapters folded into the base's weights (W + scale B A),
  a model that transformers loads without peft. A 4-bit base is first dequantized into a full-precision copy of
  its model (bitsandbytes' own dequantization, the weights its 4-bit forward computes with), so the merged model
  computes what the trained one did; transformers' `dequantize()` is not used: for GPT-2's Conv1D layers its
  model's logits differ from the 4-bit model's (0.28 on a tiny GPT-2, where this copy's differ by 0).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from multigpu.config import TrainConfig
from multigpu.data.hf import import_transformers
from multigpu.errors import UsageError
from multigpu.models.hf import four_bit
from multigpu.parallel import lora

ADAPTER = "adapter"  # the export format of a PEFT adapter folder


def is_adapter_checkpoint(state: dict[str, Any]) -> bool:
    """Whether a checkpoint holds a LoRA run's adapters (and not the whole model)."""
    return "adapters" in state


def adapted_model(state: dict[str, Any], source: str) -> Any:
    """The run's PeftModel on the CPU as it was when checkpoint `source` (its `state`) was saved."""
    record = state["adapters"]
    config = TrainConfig.from_dict(state["config"])
    if not record["base"]:
        raise UsageError(
            f"checkpoint {source} holds LoRA adapters of a base that was not loaded from a folder (--model-path), "
            f"so there is no base to rebuild the model from: train from a model folder to export it"
        )
    transformers = import_transformers("exporting a LoRA checkpoint")
    info = state["model_info"]["hf"]
    model_class = getattr(importlib.import_module(info["module"]), info["class"])
    settings = {key: value for key, value in info["config"].items() if key != "quantization_config"}
    base = model_class.from_pretrained(
        record["base"],
        config=model_class.config_class.from_dict(settings),
        dtype=torch.float32,
        **four_bit(transformers, config),
    )
    adapted = lora.add_adapters(base, config)
    lora.keep_off_cpu_inference_packing(adapted)
    found = lora.base_fingerprint(adapted)
    if found != record["fingerprint"]:
        raise UsageError(
            f"the base at {record['base']} is not the one checkpoint {source} was trained on (fingerprint {found}, "
            f"the checkpoint's {record['fingerprint']}): put the run's base model back there"
        )
    lora.load_trainable_part(adapted, state["model"])
    return adapted


def merged_model(state: dict[str, Any], source: str) -> Any:
    """The run's model with its adapters folded into the base's weights: a plain transformers model in fp32."""
    adapted = adapted_model(state, source)
    config = TrainConfig.from_dict(state["config"])
    if config.qlora:
        trained = lora.trainable_part(adapted, adapted.state_dict())
        plain = dataclasses.replace(
            config, qlora=False
        )  # the same adapters, on the base's full-precision copy
        adapted = lora.add_adapters(dequantized(lora.base_of(adapted), config), plain)
        lora.load_trainable_part(adapted, trained)
    with lora.peft_quiet():
        return adapted.merge_and_unload()


def dequantized(model: Any, config: TrainConfig) -> Any:
    """A full-precision copy of the 4-bit `model` (its adapters' base): each 4-bit weight as bitsandbytes
    dequantizes it for its forward, in the layout of the model class's own layer (GPT-2's Conv1D transposed)."""
    from peft.utils.integrations import dequantize_bnb_weight

    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    copy = type(model)(type(model.config).from_dict(settings))  # every weight replaced below
    state = {}
    for name, module in model.named_modules():
        if lora.is_four_bit(module):
            name = name.replace(".base_layer", "")  # the layer an adapter wraps, by the base's own name
            weight = dequantize_bnb_weight(module.weight).to(torch.float32)
            layer = copy.get_submodule(name)
            state[f"{name}.weight"] = weight.t() if type(layer).__name__ == "Conv1D" else weight
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().to(torch.float32)
    wanted = copy.state_dict().keys()
    plain = {
        key.replace(".base_layer", ""): value.to(torch.float32) if value.is_floating_point() else value
        for key, value in model.state_dict().items()
        if key.replace(".base_layer", "") in wanted and key.replace(".base_layer", "") not in state
    }
    copy.load_state_dict({**plain, **state}, strict=True)
    return copy
