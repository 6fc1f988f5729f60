"""--lora-r: LoRA adapters (peft's `LoraConfig` and `get_peft_model`) on any model, the base frozen.

LoRA (Hu et al. 2021) trains a low-rank change `scale * B @ A` beside each chosen linear layer and freezes
every weight of the base: the optimizer then holds state for the adapters alone, and a checkpoint needs them
alone (multigpu/checkpoints/stateful.py keeps the trainable parameters; the base is the one `--model-path`
names, checked against its fingerprint on resume). The adapters are peft's own, applied by `get_peft_model`,
so a `PeftModel` a user made themselves is trained the same way, and the exports are peft's formats
(docs/language-models.md, "LoRA and QLoRA").

`all-linear` (the default of --lora-targets) names every linear layer but the output head, as peft's own
`all-linear` does for transformers models, for any model: the head is the model's output embeddings where it
says (`get_output_embeddings`), else its last linear layer. A head initialised afresh (a sequence classifier's)
trains whole, as peft's task type SEQ_CLS makes it.

--qlora's base is 4-bit before it gets here (models/hf.py loads it so); here its bitsandbytes layers are only
kept off the CPU's inference packing, which bitsandbytes applies on an evaluation forward and never undoes
(the next training step then fails inside bitsandbytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

ALL_LINEAR = "all-linear"
# The layers LoRA adapts: torch's, transformers' GPT-2 style Conv1D (a transposed linear layer) and bitsandbytes'
# quantized linear layers, by class name so that neither library is imported to look.
LINEAR_CLASSES = ("Linear", "Conv1D", "Linear4bit", "Linear8bitLt", "Float8Linear")
# Elements read from each frozen tensor for the base's fingerprint: enough to tell two bases apart, cheap on a
# 70B model (a strided sample, not a hash of every byte).
FINGERPRINT_SAMPLES = 257


def import_peft(what: str = "--lora-r") -> Any:
    """The `peft` library, quiet, or UsageError saying what needs it and what to install."""
    quiet_quantization_libraries()
    try:
        return importlib.import_module("peft")
    except ImportError:
        raise UsageError(
            f"{what} needs the peft library, which is not installed: pip install '.[lora]'"
        ) from None


def quiet_quantization_libraries() -> None:
    """Before peft or a 4-bit load imports bitsandbytes and torchao: the first logs that an optional CPU kernel
    package is missing, the second registers enums that torch 2.14 logs a deprecation for, on every rank, and
    neither is anything the user can act on (bitsandbytes' own CPU path computes the same)."""
    for name in ("bitsandbytes.backends.cpu.ops", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def is_adapted(model: nn.Module) -> bool:
    """Whether `model` is a peft `PeftModel` (checked by class, so nothing is imported for a plain module)."""
    return any(cls.__name__ == "PeftModel" for cls in type(model).__mro__)


def base_of(model: nn.Module) -> nn.Module:
    """The model a `PeftModel` adapts (its adapters injected in place); any other module itself."""
    return model.get_base_model() if is_adapted(model) else model  # type: ignore[operator]


def add_adapters(model: nn.Module, config: TrainConfig) -> nn.Module:
    """`model` with LoRA adapters of --lora-r's rank on --lora-targets' layers, the rest frozen: a PeftModel.
    Unchanged without --lora-r, and a PeftModel of the user's own is trained as it is."""
    if is_adapted(model):
        if config.lora_r:
            raise UsageError(
                "the model is a PeftModel already, with adapters of its own: leave out --lora-r (its adapters "
                "train as they are), or pass the base model"
            )
        return model
    if not config.lora_r:
        return model
    if config.qlora and not any(is_four_bit(module) for module in model.modules()):
        raise UsageError(
            f"--qlora trains adapters on a 4-bit base, and this {type(model).__name__}'s linear layers are not "
            f"4-bit: load it with transformers' BitsAndBytesConfig(load_in_4bit=True), as --model hf --qlora does"
        )
    peft = import_peft()
    lora_config = peft.LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_scale_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=target_names(model, config.lora_targets),
        task_type=_task_type(model),
    )
    # The adapters' first values (A's random start) follow --seed alone: every rank and every rerun start
    # alike, whatever the caller drew before (FSDP does not broadcast them as DDP would).
    with torch.random.fork_rng(devices=[]), peft_quiet():
        torch.manual_seed(config.seed)
        adapted = peft.get_peft_model(model, lora_config)
    return adapted


def target_names(model: nn.Module, targets: str) -> list[str]:
    """The module names --lora-targets gives: every linear layer but the head for all-linear, else the names
    given, each of which must name a layer (peft matches a name or a dotted suffix of one)."""
    if targets.strip() == ALL_LINEAR:
        head = output_head(model)
        names = [name for name, module in _linear_layers(model) if module is not head]
        if not names:
            raise UsageError(
                f"--lora-targets all-linear: {type(model).__name__} has no linear layer besides its output "
                f"head to adapt; name the layers with --lora-targets"
            )
        return names
    wanted = [name.strip() for name in targets.split(",") if name.strip()]
    present = [name for name, _ in model.named_modules() if name]
    unknown = [want for want in wanted if not any(_matches(name, want) for name in present)]
    if unknown:
        layers = sorted({name.rsplit(".", 1)[-1] for name, _ in _linear_layers(model)})
        raise UsageError(
            f"--lora-targets {targets}: the model has no module named {', '.join(unknown)}; its linear layers "
            f"are named {', '.join(layers[:8]) or 'nothing'} (or give all-linear)"
        )
    return wanted


def _matches(name: str, wanted: str) -> bool:
    """peft's rule: a target names a module by its full name or a dotted suffix of it."""
    return name == wanted or name.endswith("." + wanted)


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module) for name, module in model.named_modules() if type(module).__name__ in LINEAR_CLASSES
    ]


def output_head(model: nn.Module) -> nn.Module | None:
    """The layer that makes the model's outputs: its output embeddings where it names them (a transformers
    language model's lm_head), else its last linear layer."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        return head
    layers = _linear_layers(model)
    return layers[-1][1] if layers else None


def _task_type(model: nn.Module) -> str | None:
    """peft's task type for a transformers model whose head it knows: a causal LM's (its PeftModel then takes
    the LM's keywords, and its adapter folder says so), a sequence classifier's (whose fresh head trains
    whole); None for any other model."""
    names = [cls.__name__ for cls in type(model).__mro__]
    if any(name.endswith("ForCausalLM") or name.endswith("LMHeadModel") for name in names):
        return "CAUSAL_LM"
    if any(name.endswith("ForSequenceClassification") for name in names):
        return "SEQ_CLS"
    return None


@contextlib.contextmanager
def peft_quiet() -> Iterator[None]:
    """peft's warnings kept back."""
    # peft warns where it adapts GPT-2's Conv1D (it then sets fan_in_fan_out itself, as it must) and where a
    # model's config lacks fields it looks for: nothing a user can act on, on every rank.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def is_four_bit(module: nn.Module) -> bool:
    """Whether `module` is bitsandbytes' 4-bit linear layer (peft's adapter around one has the same name)."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def keep_off_cpu_inference_packing(model: nn.Module) -> int:
    """Turn off bitsandbytes' CPU inference packing on every 4-bit layer (see the module's docstring); how many
    layers are 4-bit."""
    count = 0
    layer: Any
    for layer in model.modules():
        if is_four_bit(layer):
            layer.support_avx512bf16_for_cpu = False  # bitsandbytes reads it at each forward
            count += 1
    return count


# ---------------------------------------------------------------- the part of the state a checkpoint keeps
def trainable_part(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The entries of `model`'s state dict `state` that a LoRA checkpoint keeps: the trainable parameters (the
    adapters) and the buffers; not the frozen base, nor the 4-bit base's quantization constants."""
    kept = {_state_name(name) for name, param in model.named_parameters() if param.requires_grad}
    kept |= {_state_name(name) for name, _ in model.named_buffers()}
    return {name: value for name, value in state.items() if name in kept}


def load_trainable_part(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a LoRA checkpoint's `state` into `model`, every adapter accounted for (RuntimeError as
    nn.Module.load_state_dict words it otherwise), the frozen base left as it is."""
    expected = trainable_part(model, model.state_dict()).keys()
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise RuntimeError(
            f"Error(s) in loading state_dict:\n\t"
            f"{'Missing' if missing else 'Unexpected'} key(s) in state_dict: {', '.join((missing or unexpected)[:5])}"
        )
    model.load_state_dict(state, strict=False)


def _state_name(name: str) -> str:
    # torch's checkpoint wrapper keeps its module out of state-dict names (--activation-checkpointing).
    return name.replace("_checkpoint_wrapped_module.", "")


# ---------------------------------------------------------------- what a run and its checkpoint say of them
@dataclasses.dataclass(frozen=True)
class Adapters:
    """A LoRA run's adapters as read before sharding: the plan's numbers and the base's fingerprint."""

    rank: int
    layers: int  # the layers adapted
    trainable: int  # parameters that train: the adapters (and a fresh head)
    total: int  # every parameter, a 4-bit weight counted as the weights it holds
    four_bit_layers: int  # --qlora: the base's linear layers held in 4-bit
    fingerprint: str  # of the frozen base (base_fingerprint)
    base: str | None  # the folder the base was loaded from, where it has one

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of them (its "adapters"): a resume checks the base against it."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: the live adapters are what it describes (engine/state.py's check_adapters compares)."""

    def plan_line(self) -> str:
        """`LoRA r 8 on 24 linear layers: 1.2M of 124M parameters train (0.95%)`."""
        share = 100 * self.trainable / max(1, self.total)
        four_bit = (
            f"; the base's {self.four_bit_layers} linear layers in 4-bit NF4" if self.four_bit_layers else ""
        )
        return (
            f"LoRA r {self.rank} on {self.layers} linear layers: {_count(self.trainable)} of {_count(self.total)} "
            f"parameters train ({share:.2f}%){four_bit}"
        )


def adapters_of(model: nn.Module, config: TrainConfig) -> Adapters | None:
    """The facts of `model`'s adapters (None for a model without): read before sharding, while every rank holds
    the whole base."""
    if not is_adapted(model):
        return None
    four_bit = keep_off_cpu_inference_packing(model)
    layers: list[Any] = [module for module in model.modules() if getattr(module, "lora_A", None)]
    ranks = sorted({rank for module in layers for rank in module.r.values()})
    return Adapters(
        rank=ranks[0] if len(ranks) == 1 else config.lora_r,
        layers=len(layers),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        total=parameter_count(model),
        four_bit_layers=four_bit,
        fingerprint=base_fingerprint(model),
        base=base_folder(model, config),
    )


def parameter_count(model: nn.Module) -> int:
    """The weights `model` holds, a 4-bit parameter counted by the weights it packs (two in a byte: its
    quant_state knows its shape), not by its bytes."""
    count = 0
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        count += int(torch.Size(state.shape).numel()) if state is not None else param.numel()
    return count


def _count(number: int) -> str:
    """A parameter count as people say it: 1.2M, 124M, 7.0B."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if number >= size:
            value = number / size
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(number)


def base_folder(model: nn.Module, config: TrainConfig) -> str | None:
    """Where the base was loaded from: --model-path, or the folder a transformers model says it came from."""
    if config.model_path:
        return os.path.abspath(config.model_path)
    named = getattr(getattr(base_of(model), "config", None), "_name_or_path", None)
    return os.path.abspath(named) if isinstance(named, str) and os.path.isdir(named) else None


def base_fingerprint(model: nn.Module) -> str:
    """A fingerprint of the frozen base: every frozen parameter's name (as the base names it, without peft's
    `base_layer`), shape, type and a strided sample of its values. Another base model, or the same with other
    weights, gives another fingerprint; the same base loaded again gives the same on any machine."""
    digest = hashlib.sha256()
    frozen = sorted(
        (name.replace(".base_layer", ""), param)
        for name, param in model.named_parameters()
        if not param.requires_grad
    )
    for name, param in frozen:
        values = param.detach().reshape(-1)
        count = min(values.numel(), FINGERPRINT_SAMPLES)
        # Evenly spread, first and last included, in integers: a float32 linspace rounds past the end of a
        # tensor of 38.6M values (GPT-2's embedding).
        picks = torch.arange(count, device=values.device) * (values.numel() - 1) // max(1, count - 1)
        sample = values[picks].contiguous().cpu()
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
