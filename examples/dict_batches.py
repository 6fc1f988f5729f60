"""Dict batches and a model that computes its own loss (Hugging Face style: `model(**batch).loss`).

    python examples/dict_batches.py --epochs 3
    torchrun --nproc_per_node=2 examples/dict_batches.py --epochs 3

Each sample is {"input_ids": ..., "labels": ...}; the default collate stacks
them into a dict batch, the trainer moves it to the device whole and calls
`model(**batch)`; the model returns {"loss", "logits"}, so no loss_fn is
needed, and accuracy is computed from the logits against batch["labels"].
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer

VOCAB, LENGTH, CLASSES = 64, 12, 4


class TokenSequences(Dataset):
    """Sequences whose class decides which token range they are drawn from: learnable by a bag of words."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(CLASSES, (size,), generator=generator)
        noise = torch.randint(VOCAB, (size, LENGTH), generator=generator)
        signal = self.labels[:, None] * (VOCAB // CLASSES) + torch.randint(
            VOCAB // CLASSES, (size, LENGTH), generator=generator
        )
        self.input_ids = torch.where(torch.rand(size, LENGTH, generator=generator) < 0.5, signal, noise)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class BagOfWordsClassifier(nn.Module):
    """Takes keyword arguments and returns its own loss, as a Hugging Face model does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(VOCAB, 32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels) if labels is not None else None}


def train(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(argv)
    torch.manual_seed(config.seed)
    with MultiGPUTrainer(
        BagOfWordsClassifier(),
        TokenSequences(config.train_size, config.seed),
        TokenSequences(config.val_size, config.seed + 1),
        config,
    ) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
