"""A Hugging Face transformers model trained as it is: a small GPT-2 built from its config (no download).

    python examples/hf_gpt2.py --epochs 1 --train-size 512 --save-dir runs/gpt2 --export-on-end hf
    torchrun --nproc_per_node=2 examples/hf_gpt2.py --epochs 2 --save-dir runs/gpt2-ddp --export-on-end hf

Each sample is what a tokenized data set gives a causal language model:
{"input_ids", "labels"}. GPT2LMHeadModel's forward takes both and returns its
own loss, which the trainer trains on. The checkpoint keeps the model's config,
so `--export-on-end hf` (or `python -m multigpu.export CKPT FOLDER --format hf`)
writes the model's own save_pretrained folder, which
`AutoModelForCausalLM.from_pretrained(FOLDER)` loads (docs/data.md, "Your own task").
Needs the [hf] extra: pip install '.[hf]'.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer

VOCAB, LENGTH = 64, 16


class Counting(Dataset):
    """Token windows that count on from a random start (mod the vocabulary): a next token to learn."""

    def __init__(self, size: int, seed: int):
        start = torch.randint(VOCAB, (size, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}  # the model shifts the labels itself


def train(argv: Sequence[str] | None = None) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = parse_config(argv)
    torch.manual_seed(config.seed)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )  # token ids within this vocabulary
    with MultiGPUTrainer(
        model, Counting(config.train_size, 0), Counting(config.val_size, 1), config
    ) as trainer:
        trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train, sys.argv[1:]))
