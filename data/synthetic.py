"""A built-in data set that needs no download: deterministic, any size and shape, learnable."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """Noisy copies of one smooth random prototype image per class.

    Sample i is a pure function of (seed, split, i), generated on the fly, so the
    set costs no memory, is identical in every process and run, and any
    `size` and image shape work. A small CNN or MLP reaches >90% accuracy on it
    in one or two epochs.
    """

    NOISE = 3.0
    fixed_samples = (
        True  # sample i never changes: --data-on-device may read the set once (data/device_data.py)
    )

    def __init__(
        self,
        size: int,
        image_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        seed: int = 0,
        split: str = "train",
    ):
        self.size, self.image_shape, self.num_classes = size, tuple(image_shape), num_classes
        self.seed = seed * 7919 + (0 if split == "train" else 1)
        channels, height, width = self.image_shape
        generator = torch.Generator().manual_seed(seed)  # prototypes are shared by train and val
        coarse = torch.randn(
            num_classes, channels, max(1, height // 4), max(1, width // 4), generator=generator
        )
        # Smooth prototypes: convolutions can learn them, yet the classes overlap under the noise.
        self.prototypes = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(self.num_classes, (), generator=generator))
        noise = torch.randn(self.image_shape, generator=generator)
        return self.prototypes[label] + self.NOISE * noise, label
