"""Model registry (`--model`): build a model for a data set's input shape and class count."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from .cnn import SmallCNN
from .mlp import MLP
from .resnet import resnet

MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "mlp": lambda shape, classes: MLP(shape, classes),
    "cnn": lambda shape, classes: SmallCNN(shape, classes),
    "resnet18": lambda shape, classes: resnet("resnet18", shape, classes),
    "resnet50": lambda shape, classes: resnet("resnet50", shape, classes),
}

# Height and width below which a model's layers leave nothing (the others take any size).
MIN_IMAGE_SIZE = {"cnn": SmallCNN.MIN_SIZE}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model `name` for samples of `input_shape` (CxHxW, or (D,) when flattened) and `num_classes`."""
    from multigpu.errors import UsageError

    if name != "mlp" and len(input_shape) != 3:
        raise UsageError(f"--model {name} needs image samples (--mode image); with --mode flatten use --model mlp")
    smallest = MIN_IMAGE_SIZE.get(name, 1)
    if min(input_shape[1:], default=smallest) < smallest:
        raise UsageError(f"--model {name} needs images of at least {smallest}x{smallest} pixels, got "
                         f"{'x'.join(map(str, input_shape[1:]))} (--image-shape {','.join(map(str, input_shape))})")
    return MODELS[name](input_shape, num_classes)
