"""pytorch/examples' MNIST recipe on MultiGPUTrainer: Adadelta and a StepLR stepped once per epoch.

    python examples/adadelta_steplr.py --dataset mnist --download --epochs 3 --lr 1.0 --eval-batch-size 1000
    torchrun --nproc_per_node=2 examples/adadelta_steplr.py --epochs 3 --lr 1.0

The data set and model come from the registries (--dataset, --model) as in
main_multi_gpu.py; the optimizer and schedule are the user's own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from multigpu.data import build_datasets
from multigpu.models import build_model
from train_multi_gpu import MultiGPUTrainer


def train(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(argv)
    data = build_datasets(config)
    torch.manual_seed(config.seed)
    model = build_model(config.model_name, data.input_shape, data.num_classes, config)
    with MultiGPUTrainer(
        model,
        data.train,
        data.val,
        config,
        optimizer=lambda params: torch.optim.Adadelta(params, lr=config.lr),
        scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7),
        scheduler_interval="epoch",
    ) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
