"""A multi-layer perceptron: the default model of --mode flatten."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


class MLP(nn.Module):
    """Flatten -> Linear/ReLU x2 -> Linear. No BatchNorm or dropout, so 1 and N devices train identically."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
