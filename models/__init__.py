"""Model registry (`--model`): build a model for a data set's input shape and class count."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from multigpu.config import TrainConfig

from .cnn import SmallCNN
from .gpt import GPT, TransformerBlock
from .mlp import MLP
from .resnet import resnet

__all__ = ["MODELS", "TEXT_MODELS", "GPT", "TransformerBlock", "build_model", "fresh_weights_note"]

# name -> builder(input shape, class count, the run's config: the sizes of --model gpt, --model hf's folder)
MODELS: dict[str, Callable[[tuple[int, ...], int, TrainConfig], nn.Module]] = {
    "mlp": lambda shape, classes, config: MLP(shape, classes),
    "cnn": lambda shape, classes, config: SmallCNN(shape, classes),
    "resnet18": lambda shape, classes, config: resnet("resnet18", shape, classes),
    "resnet50": lambda shape, classes, config: resnet("resnet50", shape, classes),
    # A text set's "classes" are its vocabulary and its sample shape (T,) the context length.
    "gpt": lambda shape, classes, config: GPT(
        classes, shape[0], config.n_layer, config.n_head, config.n_embd
    ),
    "hf": lambda shape, classes, config: _transformers_model(classes, config),
}

TEXT_MODELS = (
    "gpt",
    "hf",
)  # models of tokens (--dataset text, --text-column); the others take images or vectors

# The attribute where models/hf.py notes the weights a model folder lacked (their names), for the plan line.
FRESH_WEIGHTS = "weights_not_in_folder"

# Height and width below which a model's layers leave nothing (the others take any size).
MIN_IMAGE_SIZE = {"cnn": SmallCNN.MIN_SIZE}


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, config: TrainConfig | None = None
) -> nn.Module:
    """The model `name` for samples of `input_shape` (CxHxW, (D,) when flattened, (T,) token windows) and
    `num_classes` (a text set's vocabulary size); `config` sizes --model gpt (None: the defaults)."""
    if name not in TEXT_MODELS:
        _check_image_input(name, input_shape)
    return MODELS[name](input_shape, num_classes, config or TrainConfig())


def _transformers_model(classes: int, config: TrainConfig) -> nn.Module:
    """--model hf (models/hf.py), imported only when asked for: the other models' runs never import transformers."""
    from .hf import hf_model

    return hf_model(classes, config)


def fresh_weights_note(model: nn.Module, shown: int = 3) -> str:
    """The plan line's words for the weights a model folder did not hold, which transformers initialised fresh
    (models/hf.py): "; initialised fresh, not in --model-path: score.weight"; empty for every other model."""
    names = list(getattr(model, FRESH_WEIGHTS, ()))
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"; initialised fresh, not in --model-path: {', '.join(names[:shown])}{more}"


def _check_image_input(name: str, input_shape: tuple[int, ...]) -> None:
    """UsageError where an image model gets vectors, or images its layers would shrink to nothing."""
    from multigpu.errors import UsageError

    if name != "mlp" and len(input_shape) != 3:
        raise UsageError(
            f"--model {name} needs image samples (--mode image); with --mode flatten use --model mlp"
        )
    smallest = MIN_IMAGE_SIZE.get(name, 1)
    if min(input_shape[1:], default=smallest) < smallest:
        raise UsageError(
            f"--model {name} needs images of at least {smallest}x{smallest} pixels, got "
            f"{'x'.join(map(str, input_shape[1:]))} (--image-shape {','.join(map(str, input_shape))})"
        )
