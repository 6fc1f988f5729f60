"""torchvision ResNets adapted to small images and any class count."""

from __future__ import annotations

import torch.nn as nn


def resnet(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """torchvision's `name` (untrained) for CxHxW inputs.

    For images under 64 px the 7x7 stride-2 stem and max-pool would shrink a
    28x28 image to 7x7 before the first block, so they become a 3x3 stride-1
    conv (the usual CIFAR adaptation).
    """
    import torchvision  # here, not at the top: it costs seconds at start-up and only ResNets need it

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    channels, height, width = input_shape
    if min(height, width) < 64:
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return model
