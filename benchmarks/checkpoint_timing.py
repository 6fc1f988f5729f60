"""How long a checkpoint blocks training, how long it takes to load, and its size on disk (issue 22).

A decoder-only transformer (the built-in `--model gpt`, 16 blocks of width 768 by default: 113M parameters),
fp32, AdamW with its moments filled by one real step, so a checkpoint holds the weights and both moments
(about 1.4 GB). Each row saves through the project's own code (the trainer's Checkpointer, as a run does),
beside a plain `torch.save` of the same model and optimizer states:

- raw torch.save: one process, `torch.save({"model": ..., "optimizer": ...})`, the hand-written baseline;
- one file: one process, the trainer's one-file checkpoint (`--checkpoint-format file`: written to a temporary
  file, fsynced, renamed);
- sharded, sync: fsdp at 2 processes (gloo), each rank writing its shards with torch.distributed.checkpoint;
- sharded, async: the same with `--async-checkpoint`: training is blocked while a CPU copy is staged, the
  shards are written in the background ("complete" is when they are on disk and renamed into place).

Columns: training blocked per save, time until the checkpoint is complete, load time (a one-file checkpoint
into one process; a sharded one into fsdp at 2 processes and, resharded, into 1), size on disk. Each row is
repeated --rounds times (sync and async alternate within a round); medians and ranges.

    python benchmarks/checkpoint_timing.py                 # 113M parameters, 3 rounds (CPU, gloo)
    python benchmarks/checkpoint_timing.py --tiny          # a tiny model, 1 round: what CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import free_port, machine_line, markdown_table  # noqa: E402

SIZES = {"full": (16, 768, 12), "tiny": (2, 32, 2)}  # (blocks, width, heads)
VOCAB, BLOCK = 64, 16
ROWS = ("raw torch.save", "one file", "sharded, sync", "sharded, async")


def build_trainer(mode: str, size: str, save_dir: str, async_checkpoint: bool = False) -> Any:
    """A trainer as a run builds it (its own process group under torchrun's variables) on the gpt model, with
    one real AdamW step taken, so the optimizer holds both moments."""
    import torch
    from torch.utils.data import TensorDataset

    from models.gpt import GPT
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    blocks, width, heads = SIZES[size]
    torch.manual_seed(0)
    model = GPT(VOCAB, BLOCK, n_layer=blocks, n_head=heads, n_embd=width)
    tokens = torch.randint(VOCAB, (8, BLOCK + 1))
    config = TrainConfig(
        multi_gpu=mode,
        epochs=1,
        batch_size=1,
        optimizer="adamw",
        lr=1e-4,
        progress=False,
        save_dir=save_dir,
        checkpoint_format="sharded" if mode == "fsdp" else "file",
        async_checkpoint=async_checkpoint,
        hang_timeout=0,
        allow_low_disk=True,
    )
    trainer = MultiGPUTrainer(model, TensorDataset(tokens[:, :-1], tokens[:, 1:]), None, config)
    inputs = tokens[:1, :-1].to(trainer.runtime.device)
    loss = trainer.step.wrapped(inputs, tokens[:1, 1:].to(trainer.runtime.device))[1]
    loss.backward()
    trainer.optimizer.step()
    return trainer


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def load_seconds(trainer: Any, path: str) -> float:
    """Read checkpoint `path` into the trainer's live model and optimizer, as `--resume` does."""
    from multigpu.checkpoints import checkpoint

    return timed(lambda: trainer.checkpointer.load_into(trainer.stateful(), checkpoint.load(path), path))[0]


def _one_process(size: str, rounds: int, folder: str, sharded_from: str) -> dict[str, Any]:
    """Rows raw torch.save and one file, and the sharded folders loaded into one process (resharding 2 -> 1)."""
    import torch

    from multigpu.checkpoints import checkpoint

    results: dict[str, Any] = {"raw torch.save": [], "one file": [], "sharded load at 1": []}
    with build_trainer("none", size, os.path.join(folder, "file")) as trainer:
        results["parameters"] = sum(
            p.numel() for p in trainer.model.parameters()
        )  # the tied head counted once
        for round_number in range(rounds):
            raw = os.path.join(folder, f"raw-{round_number}.pt")
            state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
            seconds, _ = timed(lambda: torch.save(state, raw))
            load, _ = timed(lambda: torch.load(raw, weights_only=True))
            results["raw torch.save"].append(
                {"blocked": seconds, "complete": seconds, "load": load, "bytes": os.path.getsize(raw)}
            )
            os.remove(raw)
            seconds, path = timed(
                lambda: trainer.checkpointer.save(trainer.stateful(), f"round-{round_number}.pt")
            )
            results["one file"].append(
                {
                    "blocked": seconds,
                    "complete": seconds,
                    "load": load_seconds(trainer, path),
                    "bytes": checkpoint.size_of(path),
                }
            )
            os.remove(path)
    with build_trainer("fsdp", size, os.path.join(folder, "fsdp-at-1")) as trainer:
        for path in sorted(Path(sharded_from).glob("round-*")):
            results["sharded load at 1"].append(load_seconds(trainer, str(path)))
    return results


def _sharded_rank(rank: int, size: str, rounds: int, folder: str, port: int) -> None:
    """Rank `rank` of 2: sharded saves, sync and async alternating, and loads at 2; rank 0 writes the figures."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    from multigpu.checkpoints import checkpoint

    results: dict[str, list[dict[str, float]]] = {"sharded, sync": [], "sharded, async": []}
    save_dir = os.path.join(folder, "sharded")
    with build_trainer("fsdp", size, save_dir) as trainer:
        for round_number in range(rounds):
            for row in ("sharded, sync", "sharded, async"):
                trainer.config.async_checkpoint = row.endswith("async")
                name = f"{'async' if trainer.config.async_checkpoint else 'round'}-{round_number}"
                blocked, path = timed(lambda: trainer.checkpointer.save(trainer.stateful(), name))
                waited, _ = timed(
                    trainer.checkpointer.finish_saves
                )  # the shards on disk and renamed into place
                results[row].append(
                    {
                        "blocked": blocked,
                        "complete": blocked + waited,
                        "load": load_seconds(trainer, path),
                        "bytes": checkpoint.size_of(path) if rank == 0 else 0,
                    }
                )
    if rank == 0:
        Path(folder, "sharded.json").write_text(json.dumps(results))


def run(size: str, rounds: int) -> dict[str, Any]:
    """Every row's measurements, one dict per round."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_sharded_rank, args=(size, rounds, folder, free_port()), nprocs=2, join=True)
        sharded = json.loads(Path(folder, "sharded.json").read_text())
        one = _one_process(size, rounds, folder, os.path.join(folder, "sharded"))
    for row, load in zip(sharded["sharded, sync"], one.pop("sharded load at 1")):
        row["load at 1"] = load
    return {
        "parameters": one["parameters"],
        "raw torch.save": one["raw torch.save"],
        "one file": one["one file"],
        **sharded,
    }


def _median(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{statistics.median(values):.2f}" + (f" ({low:.2f}-{high:.2f})" if len(values) > 1 else "")


def table(results: dict[str, list[dict[str, float]]]) -> tuple[list[str], list[list[str]]]:
    header = [
        "save",
        "processes",
        "training blocked per save (s)",
        "complete on disk (s)",
        "load (s)",
        "size on disk (MB)",
    ]
    rows = []
    for row in ROWS:
        rounds = results[row]
        load = _median([r["load"] for r in rounds]) + (
            " at 2; " + _median([r["load at 1"] for r in rounds]) + " at 1"
            if "load at 1" in rounds[0]
            else ""
        )
        rows.append(
            [
                row,
                "2" if row.startswith("sharded") else "1",
                _median([r["blocked"] for r in rounds]),
                _median([r["complete"] for r in rounds]),
                load,
                f"{rounds[0]['bytes'] / 1e6:.1f}",
            ]
        )
    return header, rows


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model, 1 round (what CI runs)")
    parser.add_argument("--rounds", type=int, help="repeats of every row (default 3; 1 with --tiny)")
    parser.add_argument("--json", help="also write the raw measurements here")
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "full"
    results = run(size, args.rounds or (1 if args.tiny else 3))
    blocks, width, _ = SIZES[size]
    print(
        f"Checkpoint save and load, gpt of {blocks} blocks x width {width} ({results['parameters'] / 1e6:.1f}M "
        f"parameters), fp32 AdamW; {machine_line()}\n"
    )
    print(markdown_table(*table(results)))
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
