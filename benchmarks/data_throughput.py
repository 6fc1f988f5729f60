"""Benchmark: samples/s of the data loader alone and of training, map-style vs streaming, 0/1/2 workers.

    python benchmarks/data_throughput.py [--samples 4096] [--batch 64] [--work 200] [--workers 0 1 2]
                                         [--output benchmarks/results/data_throughput.md]

Each sample costs the same to make in both forms: it is parsed from a JSON line
of --work numbers, as a reader of JSONL shards does. Map-style reads line i by
index; the stream reads the lines in order through an IterableDataset, split by
the trainer (data/streaming.py). "loader" iterates the trainer's own
DataLoader for one epoch; "training" is one epoch of MultiGPUTrainer (one
process, a small MLP) and its samples/s. When training is much slower than the
loader, data is not the bottleneck and more --num-workers buy nothing; when the
two are close, the data waits (the run's "data wait" share) and a worker or two
more help, up to the cores the machine has per process (docs/data.md,
"Your own data").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import machine_line, write_markdown  # noqa: E402  (after the path set-up)

from multigpu.config import TrainConfig  # noqa: E402
from train_multi_gpu import MultiGPUTrainer  # noqa: E402


def json_lines(samples: int, work: int) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    return [
        json.dumps({"x": torch.randn(work, generator=generator).tolist(), "y": i % 4}) for i in range(samples)
    ]


def parse(line: str) -> tuple[torch.Tensor, torch.Tensor]:
    sample = json.loads(line)
    return torch.tensor(sample["x"][:16]), torch.tensor(sample["y"])


class Lines(Dataset):
    def __init__(self, lines: list[str]):
        self.lines = lines

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return parse(self.lines[index])


class LineStream(IterableDataset):
    def __init__(self, lines: list[str]):
        self.lines = lines

    def __len__(self) -> int:
        return len(self.lines)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return map(parse, self.lines)


def measure(dataset: Any, workers: int, batch: int, save_dir: str) -> tuple[float, float]:
    """(loader samples/s, training samples/s) over one epoch."""
    config = TrainConfig(
        batch_size=batch,
        epochs=1,
        num_workers=workers,
        progress=False,
        save_dir=save_dir,
        lr=0.01,
        log_every=10_000,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    with contextlib.redirect_stdout(io.StringIO()), MultiGPUTrainer(model, dataset, None, config) as trainer:
        if trainer.stream is None:
            trainer.sampler.set_epoch(0)
        started, count = time.perf_counter(), 0
        for batch_ in trainer.train_loader:
            count += len(batch_[-1]) if trainer.stream is None else batch_[1]
        loader_rate = count / (time.perf_counter() - started)
        if trainer.stream is not None:
            trainer.stream.shard.pass_number = 0
        summary = trainer.fit()
    return loader_rate, summary["samples_per_sec"]


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--work", type=int, default=200, help="numbers per JSON line: the cost of a sample")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "data_throughput.md"))
    args = parser.parse_args(argv)
    lines = json_lines(args.samples, args.work)
    rows = []
    for kind, dataset in (("map-style", Lines(lines)), ("streaming", LineStream(lines))):
        for workers in args.workers:
            with tempfile.TemporaryDirectory() as save_dir:
                loader_rate, train_rate = measure(dataset, workers, args.batch, save_dir)
            rows.append([kind, workers, f"{loader_rate:,.0f}", f"{train_rate:,.0f}"])
    write_markdown(
        Path(args.output),
        f"Data throughput: {args.samples} samples of {args.work} JSON numbers, batch "
        f"{args.batch}, one process",
        ["data", "--num-workers", "loader samples/s", "training samples/s"],
        rows,
        [machine_line()],
    )


if __name__ == "__main__":
    main()
