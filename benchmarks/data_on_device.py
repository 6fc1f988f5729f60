"""Benchmark: --data-on-device against the loader, for the built-in data and a CIFAR-sized tensor set.

    python benchmarks/data_on_device.py [--rounds 3] [--steps 200] [--only 1,3] [--auto] [--nproc 2] [--output PATH.md]

Each workload trains twice per round in fresh processes, through the loader (--data-on-device off) and with the
training set on the device (on), the order alternating each round: the built-in synthetic set (read once) with
the cnn, --dataset text (read once) with a small gpt, a TensorDataset of 50,000 CIFAR-sized images (3x32x32)
with the cnn, and the same set with CIFAR's crop and flip (data.augment.RandomCropFlip). Shows the steady
samples/s (every logging interval but the first) of both, their ratio, and whether the two runs ended with
identical weights (not expected with augmentation: the loader and the device draw their crops from different
generators). With --auto a third run per round, --data-on-device auto, which measures both ways in its first
steps and keeps the faster: its steady samples/s against the faster of the other two, and the way it kept.
With --nproc N every run is N DDP processes under torchrun. docs/speed.md, "Data on the device".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]
from bench_common import (  # noqa: E402
    alternating_rounds,
    benchmark_parser,
    logged_rates,
    machine_line,
    steady,
    write_markdown,
)

WORKLOADS = (
    "synthetic 1x28x28, cnn",
    "text, gpt",
    "CIFAR-sized tensors, cnn",
    "CIFAR-sized tensors + crop and flip, cnn",
)
RESULT = "RESULT "


def data_and_model(workload: str, args: Any, save_dir: str) -> tuple[Any, Any, dict[str, Any]]:
    """The training set, the model and the config fields of `workload` (built alike in both runs)."""
    import torch
    from torch.utils.data import TensorDataset

    from multigpu.config import TrainConfig
    from multigpu.data import RandomCropFlip, build_datasets
    from multigpu.models import build_model

    samples = args.steps * args.batch
    if workload.startswith("synthetic"):
        spec = build_datasets(TrainConfig(train_size=samples, image_shape="1,28,28"))
        return spec.train, build_model("cnn", spec.input_shape, spec.num_classes), {}
    if workload.startswith("text"):
        text = Path(save_dir) / "text.txt"
        words = "the quick brown fox jumps over a lazy dog while seven small cats sleep".split()
        text.write_text(" ".join(words[(i * 7) % len(words)] for i in range(samples * 64 // 4)))
        config = TrainConfig(dataset="text", data_file=str(text), model="gpt", block_size=64)
        spec = build_datasets(config)
        return spec.train, build_model("gpt", spec.input_shape, spec.num_classes, config), {}
    generator = torch.Generator().manual_seed(0)
    images = TensorDataset(
        torch.randn(args.cifar_size, 3, 32, 32, generator=generator),
        torch.randint(0, 10, (args.cifar_size,), generator=generator),
    )
    data = RandomCropFlip(images, padding=4) if "crop" in workload else images
    return data, build_model("cnn", (3, 32, 32), 10), {"max_steps": args.steps}


def worker(workload: str, mode: str, args: Any) -> None:
    """One run in this process (one rank of it under torchrun) in the folder args.run_dir; rank 0 prints its steady
    samples/s, a digest of its final weights and the way --data-on-device auto kept."""
    import torch

    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    torch.manual_seed(0)
    data, model, extra = data_and_model(workload, args, args.run_dir)
    config = TrainConfig(
        epochs=1,
        batch_size=args.batch,
        log_every=args.log_every,
        progress=False,
        save_dir=os.path.join(args.run_dir, "run"),
        data_on_device=mode,
        lr_schedule="constant",
        **extra,
    )
    with MultiGPUTrainer(model, data, None, config) as trainer:
        trainer.fit()
        digest = hashlib.sha256()
        for name, tensor in sorted(trainer.model.state_dict().items()):
            digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
        kept = (
            trainer.autotune.chosen.words(only_data=True)
            if trainer.autotune and trainer.autotune.chosen
            else ""
        )
        if not trainer.runtime.is_main:
            return
    rate = steady(logged_rates(os.path.join(args.run_dir, "run", "tb")))
    print(
        RESULT + json.dumps({"samples_per_sec": rate, "weights": digest.hexdigest(), "kept": kept}),
        flush=True,
    )


def run(workload: str, mode: str, args: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as run_dir:
        launch = (
            [sys.executable]
            if args.nproc == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={args.nproc}",
            ]
        )
        command = [
            *launch,
            __file__,
            "--worker",
            workload,
            "--mode",
            mode,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
            "--log-every",
            str(args.log_every),
            "--cifar-size",
            str(args.cifar_size),
            "--run-dir",
            run_dir,
        ]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            cwd=REPO,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise SystemExit(
            f"{workload}, --data-on-device {mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(RESULT) :])


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__,
        rounds=3,
        steps=200,
        batch=64,
        log_every=20,
        output_help="the Markdown table (default: benchmarks/results/data_on_device_<cpu|gpu>.md)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--only", help="comma-separated workload numbers (1-4) to run")
    parser.add_argument("--cifar-size", type=int, default=50_000, help="images in the CIFAR-sized tensor set")
    parser.add_argument(
        "--auto", action="store_true", help="also a run under --data-on-device auto each round"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="DDP processes per run, under torchrun (default 1: one process, no torchrun)",
    )
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.mode, args)
        return 0
    import torch

    workloads = [WORKLOADS[int(n) - 1] for n in args.only.split(",")] if args.only else list(WORKLOADS)
    modes = ["off", "on", *(["auto"] if args.auto else [])]
    results, (load_before, load_after) = alternating_rounds(
        args.rounds,
        workloads,
        [f"--data-on-device {mode}" for mode in modes],
        lambda workload, variant: run(workload, variant.split()[-1], args),
        lambda figures: (
            f"{figures['samples_per_sec']:.0f} samples/s"
            + (f", kept {figures['kept']}" if figures["kept"] else "")
        ),
    )
    results = {(workload, variant.split()[-1]): runs for (workload, variant), runs in results.items()}
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{workload} | {mode}": runs for (workload, mode), runs in results.items()}, indent=1)
            + "\n"
        )
    gpu = torch.cuda.is_available()
    output = Path(args.output or HERE / "results" / f"data_on_device_{'gpu' if gpu else 'cpu'}.md")
    processes = "one process" if args.nproc == 1 else f"{args.nproc} DDP processes under torchrun"
    notes = [
        machine_line(),
        f"CIFAR-sized: {args.cifar_size:,} random 3x32x32 images in a TensorDataset; "
        f"{processes}, fp32, batch {args.batch} per process, {args.steps} steps per run (one epoch of the "
        f"built-in sets), AdamW, constant LR; samples/s over every --log-every {args.log_every} interval but the "
        f"first, medians of {args.rounds} rounds (ratio: per round, median and range); load average "
        f"{load_before:.2f} before, {load_after:.2f} after",
    ]
    header = [
        "workload",
        "loader samples/s",
        "on the device samples/s",
        "on the device / loader",
        "final weights",
    ]
    if args.auto:
        header += ["auto samples/s", "auto / the faster of the two", "auto kept"]
    write_markdown(
        output,
        "--data-on-device against the loader",
        header,
        [_row(workload, results, args.auto) for workload in workloads],
        notes,
    )
    return 0


def _row(workload: str, results: dict[tuple[str, str], list[dict[str, Any]]], auto: bool) -> list[str]:
    """A workload's row: both ways' medians and ratio, whether their weights match; auto's, against the faster."""
    loader, device = (
        [run_["samples_per_sec"] for run_ in results[(workload, mode)]] for mode in ("off", "on")
    )
    ratios = [on / off for on, off in zip(device, loader)]
    compared = ["on", "auto"] if auto else ["on"]
    same = all(
        a["weights"] == b["weights"]
        for mode in compared
        for a, b in zip(results[(workload, "off")], results[(workload, mode)])
    )
    row = [
        workload,
        f"{statistics.median(loader):.0f}",
        f"{statistics.median(device):.0f}",
        _ratios(ratios),
        "identical" if same else "differ",
    ]
    if not auto:
        return row
    rates = [run_["samples_per_sec"] for run_ in results[(workload, "auto")]]
    kept = sorted({run_["kept"] for run_ in results[(workload, "auto")]})
    return row + [
        f"{statistics.median(rates):.0f}",
        _ratios([rate / max(on, off) for rate, on, off in zip(rates, device, loader)]),
        ", ".join(kept),
    ]


def _ratios(ratios: list[float]) -> str:
    return f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


if __name__ == "__main__":
    sys.exit(main())
