"""Benchmark: MultiGPUTrainer against a minimal hand-written DDP loop on the same model and data.

    python benchmarks/trainer_vs_raw_ddp.py [--nproc 2] [--rounds 3] [--epochs 2]

Each round runs both under torchrun (gloo on CPU, NCCL on GPUs), alternating
which goes first, so drifts in machine load hit both alike. Prints each run's
training samples/s, the medians and their ratio (target: trainer >= 0.97 x raw).
Both measure training time only: the loops over batches, not start-up,
evaluation or checkpoint writing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]
from bench_common import make_cnn as make_model  # noqa: E402  (after the path set-up)
from bench_common import make_images as make_data  # noqa: E402


def run_trainer(args) -> float:
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    config = TrainConfig(
        multi_gpu="ddp",
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=1e-3,
        progress=False,
        log_every=args.log_every,
        save_dir=tempfile.mkdtemp(),
    )
    return MultiGPUTrainer(make_model(), make_data(args.samples), None, config).fit()["samples_per_sec"]


def run_raw(args) -> float:
    """What a careful user writes by hand: DistributedSampler, DDP, AdamW, no per-step sync."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    cuda = torch.cuda.is_available()
    _rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=600))
    model = DistributedDataParallel(make_model().to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(args.samples)
    sampler = DistributedSampler(data, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, pin_memory=cuda)
    loss_fn = torch.nn.CrossEntropyLoss()
    samples, seconds = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            samples += targets.shape[0] * dist.get_world_size()
        loss.item()  # wait for the device, as the trainer's last sync point does
        seconds += time.perf_counter() - start
    dist.destroy_process_group()
    return samples / seconds


def worker(args) -> None:
    per_sec = run_trainer(args) if args.worker == "trainer" else run_raw(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"loop": args.worker, "samples_per_sec": per_sec}), flush=True)


def launch(args, loop: str) -> float:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        os.path.abspath(__file__),
        "--worker",
        loop,
        "--epochs",
        str(args.epochs),
        "--samples",
        str(args.samples),
        "--batch-size",
        str(args.batch_size),
        "--log-every",
        str(args.log_every),
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])["samples_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--worker", choices=["trainer", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, list[float]] = {"trainer": [], "raw": []}
    for round_index in range(args.rounds):
        order = ["trainer", "raw"] if round_index % 2 == 0 else ["raw", "trainer"]
        for loop in order:
            results[loop].append(launch(args, loop))
            print(f"round {round_index + 1}: {loop:7s} {results[loop][-1]:8.0f} samples/s", flush=True)
    trainer, raw = statistics.median(results["trainer"]), statistics.median(results["raw"])
    print(
        f"median samples/s: trainer {trainer:.0f}, raw DDP loop {raw:.0f}, ratio {trainer / raw:.3f} "
        f"({args.nproc} processes, batch {args.batch_size}, {args.samples} samples x {args.epochs} epochs)"
    )


if __name__ == "__main__":
    main()
