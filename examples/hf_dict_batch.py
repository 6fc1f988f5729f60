"""A Hugging Face-style data set with a model that takes `forward(self, input_ids)`: no forward_fn needed.

    python examples/hf_dict_batch.py --epochs 3
    torchrun --nproc_per_node=2 examples/hf_dict_batch.py --epochs 3

Each sample is what a tokenized Hugging Face data set gives:
{"input_ids", "attention_mask", "label"}. The model's forward takes
input_ids alone, so the trainer reads its signature once and passes only the
keys it accepts, as Hugging Face's Trainer does; the targets come from the
"label" entry, the loss is the trainer's cross-entropy on the logits, and
accuracy is reported (docs/data.md, "Your own task").
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

VOCAB, MAX_LENGTH, PAD = 50, 16, 0


class Reviews(Dataset):
    """Padded token sequences of varied length: positive reviews use the upper half of the vocabulary more."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(2, (size,), generator=generator)
        lengths = torch.randint(4, MAX_LENGTH + 1, (size,), generator=generator)
        tokens = torch.randint(1, VOCAB // 2, (size, MAX_LENGTH), generator=generator)
        tokens += (self.labels[:, None] * (VOCAB // 2 - 1)) * (
            torch.rand(size, MAX_LENGTH, generator=generator) < 0.7
        )
        self.attention_mask = (torch.arange(MAX_LENGTH) < lengths[:, None]).long()
        self.input_ids = tokens * self.attention_mask  # PAD after each review's end

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "label": self.labels[index],
        }


class ReviewClassifier(nn.Module):
    """Mean of token embeddings (PAD embeds to zero), then a linear head: two class scores."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.head = nn.Linear(32, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(1))


def train(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(argv)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    with MultiGPUTrainer(
        ReviewClassifier(),
        Reviews(config.train_size, config.seed),
        Reviews(config.val_size, config.seed + 1),
        config,
    ) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
