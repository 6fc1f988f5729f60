"""A small convolutional net: the default model of --mode image."""

from __future__ import annotations

import torch
import torch.nn as nn


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head; works for any CxHxW input of at least MIN_SIZE x MIN_SIZE.

    Adaptive pooling makes the head independent of the image size.
    """

    MIN_SIZE = 2  # height and width: the first max-pool halves them, and 1 // 2 is nothing left

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32):
        super().__init__()
        channels = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
