"""A folder of images without labels, as prediction reads it (predict_multi_gpu.py --imagefolder DIR)."""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch.utils.data import Dataset

from multigpu.errors import UsageError

from .files import check_image_headers


class UnlabeledImages(Dataset):
    """Every image under `root` (sub-folders included), in sorted order of their paths relative to `root`.

    A sample is `(image, -1)`: a pair as the trainer's batches are, with -1 for "no label".
    `files` holds the relative paths, in dataset order. A missing or empty folder, or a file
    that is not a readable image, is a UsageError naming it.
    """

    NO_LABEL = -1

    def __init__(self, root: str, transform: Callable):
        from torchvision.datasets.folder import IMG_EXTENSIONS

        if not os.path.isdir(root):
            raise UsageError(f"--imagefolder {root} is not a folder; give the folder that holds the images")
        self.root, self.transform = root, transform
        self.files = sorted(
            os.path.relpath(os.path.join(folder, name), root)
            for folder, _, names in os.walk(root)
            for name in names
            if name.lower().endswith(IMG_EXTENSIONS)
        )
        if not self.files:
            raise UsageError(f"--imagefolder {root} holds no images ({', '.join(IMG_EXTENSIONS)})")
        try:
            check_image_headers([os.path.join(root, name) for name in self.files])
        except UsageError as error:  # it names the flag of training sets
            raise UsageError(str(error).replace("--dataset imagefolder", "--imagefolder", 1)) from None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(os.path.join(self.root, self.files[index])) as image:
            return self.transform(image.convert("RGB")), self.NO_LABEL
