"""CIFAR training's augmentation (random crop with padding, random horizontal flip) as one tensor operation.

The same function augments one sample in the loader and a whole batch on the device (data kept there by
--data-on-device, data/device_data.py): one gather per batch picks each image's window of the padded
image, mirrored where it is flipped, so a batch costs a handful of kernels and no host work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset


def crop_flip(
    images: torch.Tensor, padding: int, fill: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Each NxCxHxW image cut at a random offset out of itself padded by `padding` pixels of `fill` (one value per
    channel) on every side, then mirrored left-right with probability 1/2; draws from `generator` (None: torch's
    global generator, as torchvision's transforms in a loader worker)."""
    count, _, height, width = images.shape
    device = images.device
    offsets = torch.randint(0, 2 * padding + 1, (2, count), generator=generator, device=device)
    flipped = torch.randint(0, 2, (count, 1), generator=generator, device=device, dtype=torch.bool)
    rows = offsets[0, :, None] - padding + torch.arange(height, device=device)  # N x H, in the unpadded image
    columns = torch.arange(width, device=device)
    columns = offsets[1, :, None] - padding + torch.where(flipped, width - 1 - columns, columns)  # N x W
    inside = ((rows >= 0) & (rows < height))[:, None, :, None] & ((columns >= 0) & (columns < width))[
        :, None, None, :
    ]
    picked = images[
        torch.arange(count, device=device)[:, None, None, None],
        torch.arange(images.shape[1], device=device)[None, :, None, None],
        rows.clamp(0, height - 1)[:, None, :, None],
        columns.clamp(0, width - 1)[:, None, None, :],
    ]
    return torch.where(inside, picked, fill.to(device=device, dtype=images.dtype).view(1, -1, 1, 1))


class RandomCropFlip(Dataset):
    """`dataset`'s (image, ...) samples with their CxHxW image randomly cropped from a padded copy and flipped.

    `fill`: the padding's value per channel (or one for all), as the image is stored: a normalised image's black
    is -mean/std. Kept on the device, the set is gathered from `dataset` and each batch augmented there from a
    generator seeded per rank and batch (data/device_data.py); in the loader, each sample here.
    """

    def __init__(self, dataset: Dataset, padding: int = 4, fill: float | Sequence[float] = 0.0):
        self.dataset, self.padding = dataset, padding
        self.fill = torch.as_tensor(fill, dtype=torch.float32).reshape(-1)
        self._device_fill = (
            self.fill
        )  # the fill where the batches are, made once: no host-to-device copy per batch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a map-style set: it has __len__

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        image, *rest = self.dataset[index]
        return (crop_flip(image[None], self.padding, self.fill)[0], *rest)

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A batch of this set's images, augmented on their device (the columns gathered from `dataset`)."""
        if (self._device_fill.device, self._device_fill.dtype) != (images.device, images.dtype):
            self._device_fill = self.fill.to(device=images.device, dtype=images.dtype)
        return crop_flip(images, self.padding, self._device_fill, generator)
