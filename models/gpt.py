"""A small decoder-only transformer (nanoGPT's shape): the model family users shard (--model gpt).

Token and position embeddings, a `blocks` ModuleList of TransformerBlock (pre-LayerNorm, causal
self-attention, MLP), a final LayerNorm and an LM head whose weight is the token embedding's. The
repeated blocks in a ModuleList are what FSDP wraps one unit each. No dropout, so 1 and N devices
train identically.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and the positions before it."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads) tensors
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)): pre-LayerNorm, as GPT-2."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Next-token prediction over `vocab_size` tokens with a context of `block_size` positions.

    `forward(idx, targets=None) -> (logits, loss)`: logits (B, T, vocab_size); the loss is the
    cross-entropy over every position when `targets` (B, T) are given, else None.
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 2, n_embd: int = 64):
        super().__init__()
        if n_embd % n_head:
            from multigpu.errors import UsageError

            raise UsageError(
                f"--n-embd {n_embd} must be a multiple of --n-head {n_head}: each head takes an equal "
                f"share of the embedding"
            )
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(TransformerBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # weight tying: one matrix reads and writes tokens
        self.apply(_init_weights)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: small normal weights, zero biases (the tied embedding is set once)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
