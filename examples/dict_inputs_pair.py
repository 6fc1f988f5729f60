"""(inputs, targets) pairs whose inputs is a dict, and a model written for a plain loop: no forward_fn needed.

    python examples/dict_inputs_pair.py --epochs 3
    torchrun --nproc_per_node=2 examples/dict_inputs_pair.py --epochs 3

The model was written for `for features, y in loader: loss = F.cross_entropy(model(features), y)`:
its `forward(self, features)` takes the whole dict of table columns. The
trainer does what that loop does, `model(inputs)`; it would spread the dict
as keywords only if its keys were forward's parameters (docs/data.md,
"Your own task").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer

CITIES, NUMERIC, CLASSES = 10, 6, 3


class Customers(Dataset):
    """Table rows: numeric columns and a city; the class depends on both."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.numeric = torch.randn(size, NUMERIC, generator=generator)
        self.city = torch.randint(CITIES, (size,), generator=generator)
        score = self.numeric[:, 0] + self.numeric[:, 1] - self.numeric[:, 2] + (self.city % 3 - 1).float()
        self.labels = torch.bucketize(score, torch.tensor([-0.7, 0.7]))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {"numeric": self.numeric[index], "city": self.city[index]}, self.labels[index]


class TableModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.city = nn.Embedding(CITIES, 4)
        self.net = nn.Sequential(nn.Linear(NUMERIC + 4, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(torch.cat([features["numeric"], self.city(features["city"])], dim=1))


def train(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(argv)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    with MultiGPUTrainer(
        TableModel(),
        Customers(config.train_size, config.seed),
        Customers(config.val_size, config.seed + 1),
        config,
    ) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
