"""A nanoGPT-style language model, `forward(idx, targets=None) -> (logits, loss)`: no forward_fn needed.

    python examples/nanogpt.py --epochs 3
    torchrun --nproc_per_node=2 examples/nanogpt.py --epochs 3

Written as Karpathy's nanoGPT writes it: the model computes its own loss when
given targets, and `configure_optimizers` builds AdamW with two parameter
groups (weight decay on matrices, none on biases and norms); gradients are
clipped at 1.0 (--clip-grad-norm, nanoGPT's grad_clip). The trainer sees the
`targets` parameter in forward's signature, passes each batch's targets to it
and trains on the loss the model returns; no loss_fn is applied
(docs/data.md, "Your own task").
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

BLOCK, EMBED, HEADS = 16, 32, 2
TEXT = "the quick brown fox jumps over the lazy dog. "
VOCAB = sorted(set(TEXT))


class Characters(Dataset):
    """(x, y) windows of a character stream, y shifted by one: nanoGPT's get_batch as a data set."""

    def __init__(self, size: int, seed: int):
        self.data = torch.tensor([VOCAB.index(char) for char in TEXT * (size // len(TEXT) + 2)])
        self.starts = torch.randint(
            len(self.data) - BLOCK - 1, (size,), generator=torch.Generator().manual_seed(seed)
        )

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        return self.data[start : start + BLOCK], self.data[start + 1 : start + 1 + BLOCK]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.c_attn, self.c_proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.size()
        q, k, v = (
            t.view(batch, time, HEADS, channels // HEADS).transpose(1, 2)
            for t in self.c_attn(x).split(EMBED, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(len(VOCAB), EMBED), nn.Embedding(BLOCK, EMBED)
        self.h = nn.ModuleList([Block()])
        self.ln_f = nn.LayerNorm(EMBED)
        self.lm_head = nn.Linear(EMBED, len(VOCAB), bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # inference: only the last position
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float]
    ) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def train(argv: Sequence[str] | None = None) -> dict:
    config = parse_config(
        ["--clip-grad-norm", "1.0", *(sys.argv[1:] if argv is None else argv)]
    )  # nanoGPT's clip
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model = GPT()
    train_set, val_set = (
        Characters(config.train_size, config.seed),
        Characters(config.val_size, config.seed + 1),
    )
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=config.lr, betas=(0.9, 0.95))
    with MultiGPUTrainer(model, train_set, val_set, config, optimizer=optimizer) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
