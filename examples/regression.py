"""A regression model with MSE and its own optimizer: pytorch/examples' DDP-tutorial task on MultiGPUTrainer.

    python examples/regression.py --epochs 3
    torchrun --nproc_per_node=2 examples/regression.py --epochs 3

Every flag of main_multi_gpu.py applies (batch, LR rule, AMP, resume, ...);
this script brings its own model and data, so --model and --dataset do not.
A regression has no accuracy: evaluation reports loss, mse and mae, and
best.pt follows val_loss (lower is better).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer


def linear_data(size: int, seed: int) -> TensorDataset:
    """y = x . w + noise, with w fixed: a set an nn.Linear(20, 1) can fit."""
    weights = torch.randn(20, 1, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 20, generator=generator)
    return TensorDataset(inputs, inputs @ weights + 0.1 * torch.randn(size, 1, generator=generator))


def train(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(argv)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    with MultiGPUTrainer(
        torch.nn.Linear(20, 1),
        linear_data(config.train_size, config.seed),
        linear_data(config.val_size, config.seed + 1),
        config,
        loss_fn=F.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
    ) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
