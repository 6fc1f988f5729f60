"""Training on a stream of JSONL shard files: a torch IterableDataset, no __len__, read shard after shard.

    python examples/jsonl_stream.py stream-data --steps-per-epoch 15 --batch-size 16 --lr 0.01
    torchrun --nproc_per_node=2 examples/jsonl_stream.py stream-data --steps-per-epoch 8 --num-workers 2

The first argument is the folder of shards (`*.jsonl`, one {"x": [...16 floats], "y": class} per line); the
rest are main_multi_gpu.py's flags. The shards are written there first if the folder does not exist: three of
unequal length. The trainer splits the stream over ranks x DataLoader workers (the dataset does not shard
itself), ends each pass at the same step on every rank and resumes at the exact sample with --resume auto
(docs/data.md, "Your own data").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from main_multi_gpu import main_guarded
from multigpu.config import parse_config
from train_multi_gpu import MultiGPUTrainer

SHARD_SIZES = (100, 101, 37)


class JsonlStream(IterableDataset):
    """Samples from every `*.jsonl` file of `folder`, in name order; the same on every pass."""

    def __init__(self, folder: Path):
        self.files = sorted(folder.glob("*.jsonl"))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for path in self.files:
            with open(path, encoding="utf-8") as lines:
                for line in lines:
                    sample = json.loads(line)
                    yield torch.tensor(sample["x"]), torch.tensor(sample["y"])


def write_shards(folder: Path, seed: int) -> None:
    """Three shards of blobs around 4 class centres, written to a folder of this process's own and renamed
    into place whole: ranks that start together never read a half-written set."""
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(1234)) * 3
    generator = torch.Generator().manual_seed(seed)
    partial = folder.with_name(f"{folder.name}.part-{os.getpid()}")
    partial.mkdir(parents=True)
    for index, size in enumerate(SHARD_SIZES):
        targets = torch.randint(4, (size,), generator=generator)
        inputs = centres[targets] + torch.randn(size, 16, generator=generator)
        rows = (json.dumps({"x": x.tolist(), "y": int(y)}) for x, y in zip(inputs, targets))
        (partial / f"shard-{index}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    try:
        partial.rename(folder)
    except OSError:  # another rank's identical set got there first
        shutil.rmtree(partial)


def train(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = Path(argv.pop(0) if argv and not argv[0].startswith("-") else "stream-data")
    config = parse_config(argv)
    if not folder.exists():
        write_shards(folder, config.seed)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with MultiGPUTrainer(model, JsonlStream(folder), JsonlStream(folder), config) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
