"""Benchmark: this project's trainer against a hand-written loop and, when installed, Accelerate and Lightning,
on one workload, interleaved round by round (docs/speed.md, "Speed").

    python benchmarks/peers.py                            # 1 process and DDP over 2; 64 and 256 steps; 7 rounds
    python benchmarks/peers.py --nproc 2 --lengths 64 --rounds 11
    bash scripts/ensure_env.sh peers                      # Accelerate and Lightning (else: skipped, one line each)

The workload: the project's cnn, synthetic 1x28x28 images in memory, batch 64 per process, SGD (lr 0.01,
momentum 0.9, no weight decay, constant), fp32, no validation, one epoch of exactly --steps steps, 1 intra-op thread
per process. --model resnet18 (3x32x32) or resnet50 (3x224x224, 512 distinct images indexed over and over) and
--amp (this project's contenders only; the loop and the peers stay fp32) make the --autotune tables, e.g.
    python benchmarks/peers.py --model resnet50 --amp auto --contenders trainer,autotune,loop --nproc 1 --threads 0
Every contender runs in fresh processes (torchrun for 2 or more, gloo on the CPU and NCCL on GPUs), in an
order that rotates every round. Time is rank 0's, from just before the contender builds its own objects
(MultiGPUTrainer, Accelerator, lightning.Trainer; the model and data are built before, alike for all, the
imports are done, torch._dynamo too, which every torch optimizer's constructor and DDP's import on first use,
and the process group is joined, then a barrier) to the end of the last optimizer step: a framework's start-up inside
that window counts.
The trainer runs with its defaults but the workload's (it writes TensorBoard events and, after the last step,
a checkpoint, which is outside the window); Lightning without logger, checkpointing, progress bar or summary.
ratio = a contender's samples/s / the hand-written loop's in the same round; the table gives the median over
rounds and the range.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import (  # noqa: E402
    RESULT,
    benchmark_parser,
    machine_line,
    make_cnn,
    make_images,
    run_worker,
    write_markdown,
)

from data import default_num_workers  # noqa: E402
from multigpu.config import FIELDS  # noqa: E402

CONTENDERS = ("trainer", "autotune", "loop", "accelerate", "lightning")
NAMES = {
    "trainer": "this project",
    "autotune": "this project --autotune",
    "loop": "hand-written loop",
    "accelerate": "Accelerate",
    "lightning": "Lightning",
}
DEFAULT_CONTENDERS = "trainer,loop,accelerate,lightning"
SHAPES = {"cnn": (1, 28, 28), "resnet18": (3, 32, 32), "resnet50": (3, 224, 224)}
# Distinct training images: all of them for the small shapes; for 224 px a pool repeated to the run's length, since
# generating thousands of 224 px images would take each process longer than its run (a GPU's time is lent).
DISTINCT = {"resnet50": 512}
PACKAGES = {"accelerate": "accelerate", "lightning": "lightning"}  # the module each needs
LR, MOMENTUM = 0.01, 0.9


# ------------------------------------------------------------------ the contenders (one process each)
def run_trainer(model, data, args, world: int, started: Callable[[], float]) -> tuple[float, Any, dict]:
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    class LastStep:  # the end of the window: the last optimizer step
        def on_step_end(self, trainer):
            self.at = time.perf_counter()

    last = LastStep()
    start = started()
    # weight_decay=0: torch's SGD default, as the other contenders build it (the trainer's own default is 0.01)
    config = TrainConfig(
        multi_gpu="ddp" if world > 1 else "none",
        epochs=1,
        batch_size=args.batch,
        optimizer="sgd",
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=0.0,
        lr_schedule="constant",
        progress=False,
        save_dir=tempfile.mkdtemp(prefix="peers-"),
        autotune=args.worker == "autotune",
        amp=args.amp,
    )
    trainer = MultiGPUTrainer(model, data, None, config, callbacks=[last])
    trainer.fit()
    chosen = (
        {"chosen": trainer.autotune.chosen.words()} if trainer.autotune and trainer.autotune.chosen else {}
    )
    return last.at - start, trainer.model, chosen


def _loader(data, args, world: int):
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, seed=0, drop_last=True) if world > 1 else None
    device = torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # the trainer's loader settings there
    return DataLoader(
        data,
        batch_size=args.batch,
        sampler=sampler,
        shuffle=sampler is None,
        pin_memory=device.type == "cuda",
        num_workers=default_num_workers(device),
    )


def run_loop(model, data, args, world: int, started: Callable[[], float]) -> tuple[float, Any, dict]:
    """What a careful user writes by hand: DistributedSampler, DDP, SGD, no per-step host sync."""
    import torch

    start = started()
    device = _device()
    plain = model.to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            plain, device_ids=[device.index] if device.index is not None else None
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.CrossEntropyLoss()
    for inputs, targets in _loader(data, args, world):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _wait(device)
    return time.perf_counter() - start, plain, {}


def run_accelerate(model, data, args, world: int, started: Callable[[], float]) -> tuple[float, Any, dict]:
    import torch
    from accelerate import Accelerator

    start = started()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, _loader(data, args, 1)
    )  # it shards the loader
    loss_fn = torch.nn.CrossEntropyLoss()
    for inputs, targets in loader:
        accelerator.backward(loss_fn(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _wait(accelerator.device)
    return time.perf_counter() - start, accelerator.unwrap_model(model), {}


def run_lightning(model, data, args, world: int, started: Callable[[], float]) -> tuple[float, Any, dict]:
    import lightning
    import torch

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = model, torch.nn.CrossEntropyLoss()

        def training_step(self, batch, batch_index):
            inputs, targets = batch
            return self.loss_fn(self.model(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    class LastStep(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index):
            self.at = time.perf_counter()

    last = LastStep()
    start = started()
    trainer = lightning.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[last],
    )
    trainer.fit(Module(), _loader(data, args, 1))  # Lightning puts in its DistributedSampler itself
    assert trainer.global_step == args.steps, trainer.global_step
    return last.at - start, model, {}


def _device():
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _wait(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


RUNS = {
    "trainer": run_trainer,
    "autotune": run_trainer,
    "loop": run_loop,
    "accelerate": run_accelerate,
    "lightning": run_lightning,
}


def accuracy(model, args) -> float:
    """On 512 held-out samples of the same task, after the run (outside the window), in fp32 on the device it
    trained on (a 224 px model on the CPU would take longer than its run)."""
    import torch

    held_out = make_images(512, SHAPES[args.model], split="val")
    device = _device()  # where it trained (a framework may have moved it back to the CPU at its end)
    model = model.to(device).eval()
    correct = 0
    with torch.no_grad():
        for inputs, targets in zip(*(part.split(128) for part in held_out.tensors)):
            correct += (model(inputs.to(device)).argmax(1).cpu() == targets).sum().item()
    return correct / len(held_out)


def worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shape = SHAPES[args.model]
    model = make_cnn(shape, name=args.model)
    data = make_images(args.steps * args.batch * world, shape, distinct=DISTINCT.get(args.model))
    if args.worker == "lightning":
        import lightning  # noqa: F401  (imported before the window: an import is not the framework's start-up)
    elif args.worker == "accelerate":
        import accelerate  # noqa: F401
    import torch._dynamo  # noqa: F401  (0.7-2 s here, an import every contender pays: see the docstring)

    import train_multi_gpu  # noqa: F401

    if world > 1:  # joined before the window, then a barrier: the ranks' start-up skew is not a framework's
        _device()
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    def started() -> float:
        if world > 1:
            torch.distributed.barrier()
        return time.perf_counter()

    seconds, trained, extra = RUNS[args.worker](model, data, args, world, started)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            RESULT
            + json.dumps(
                {
                    "samples_per_sec": args.steps * args.batch * world / seconds,
                    "seconds": seconds,
                    "accuracy": accuracy(trained, args),
                    **extra,
                }
            ),
            flush=True,
        )


# ------------------------------------------------------------------ rounds and the table
def launch(args, contender: str, nproc: int, steps: int) -> dict[str, float]:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        contender,
        "--steps",
        str(steps),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--model",
        args.model,
        "--amp",
        args.amp,
    ]
    return run_worker(
        script, nproc, contender, {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    )


def installed(contender: str) -> bool:
    return contender not in PACKAGES or importlib.util.find_spec(PACKAGES[contender]) is not None


def main() -> None:
    parser = benchmark_parser(
        __doc__,
        rounds=7,
        steps=0,
        batch=64,
        log_every=50,
        steps_help="unused: see --lengths",
        output_help="Markdown file (default benchmarks/results/peers_<cpu|gpu>.md)",
    )
    parser.add_argument(
        "--lengths", default="64,256", help="run lengths in optimizer steps per rank, comma-separated"
    )
    parser.add_argument("--nproc", default="1,2", help="process counts, comma-separated (2 or more: DDP)")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per process (0: torch's default)"
    )
    parser.add_argument(
        "--model",
        choices=sorted(SHAPES),
        default="cnn",
        help="cnn on 1x28x28, resnet18 on 3x32x32, or resnet50 on 3x224x224",
    )
    parser.add_argument(
        "--amp",
        choices=FIELDS["amp"].metadata["choices"],
        default="off",
        help="this project's --amp (its two contenders only: the loop and the peers stay fp32)",
    )
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="which to run, comma-separated")
    parser.add_argument("--tiny", action="store_true", help="one round of 24 steps at 2 processes (CI)")
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny:
        args.rounds, args.lengths, args.nproc = 1, "24", "2"
    asked = [name for name in args.contenders.split(",") if name]
    unknown = sorted(set(asked) - set(CONTENDERS)) + (
        [] if "loop" in asked else ["(loop is needed: the ratios' base)"]
    )
    if unknown:
        sys.exit(
            f"error: --contenders {args.contenders}: not one of {', '.join(CONTENDERS)}: {', '.join(unknown)}"
        )
    contenders = [name for name in CONTENDERS if name in asked and installed(name)]
    for name in asked:
        if name not in contenders:
            print(f"{NAMES[name]}: not installed (pip install -e '.[peers]'): skipped", flush=True)
    raw: dict[str, Any] = {}
    rows = []
    for steps in [int(length) for length in args.lengths.split(",")]:
        for nproc in [int(count) for count in args.nproc.split(",")]:
            key, per_round = f"{steps} steps, {nproc} process(es)", []
            for round_index in range(args.rounds):
                order = (
                    contenders[round_index % len(contenders) :] + contenders[: round_index % len(contenders)]
                )
                measured = {name: launch(args, name, nproc, steps) for name in order}
                per_round.append(measured)
                print(
                    f"{key}, round {round_index + 1}: "
                    + ", ".join(
                        f"{NAMES[name]} {measured[name]['samples_per_sec']:.0f}" for name in contenders
                    )
                    + " samples/s",
                    flush=True,
                )
            raw[key] = per_round
            rows.append(_row(steps, nproc, args, per_round, contenders))
    header = [
        "run length",
        "config",
        *[f"{NAMES[name]} vs loop" for name in contenders if name != "loop"],
        "loop samples/s",
        "held-out accuracy (" + ", ".join(NAMES[name] for name in contenders) + ")",
    ]
    chosen = sorted(
        {
            measured["autotune"]["chosen"]
            for per_round in raw.values()
            for measured in per_round
            if "chosen" in measured.get("autotune", {})
        }
    )
    notes = [
        machine_line(),
        f"the project's {args.model} on synthetic {'x'.join(map(str, SHAPES[args.model]))} "
        f"images in memory{_distinct(args)}, batch {args.batch} per process, SGD, {_precision(args)}, no "
        f"validation, {_threads(args)}; "
        f"{args.rounds} interleaved rounds",
        "ratio: samples/s / the hand-written loop's in the same round, median (range); time from building "
        "the framework's objects to the end of the last optimizer step, on rank 0; accuracy: medians, on 512 "
        "held-out samples after the run",
        *([f"--autotune chose: {'; '.join(chosen)}"] if chosen else []),
        *_autotune_gains(raw),
        *[f"{NAMES[name]}: not installed, skipped" for name in asked if name not in contenders],
    ]
    device = "gpu" if _cuda() else "cpu"
    output = Path(args.output) if args.output else REPO / "benchmarks" / "results" / f"peers_{device}.md"
    write_markdown(output, "Trainer, hand-written loop and peers (benchmarks/peers.py)", header, rows, notes)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


def _distinct(args) -> str:
    return f" ({DISTINCT[args.model]} distinct, repeated)" if args.model in DISTINCT else ""


def _precision(args) -> str:
    return "fp32" if args.amp == "off" else f"this project with --amp {args.amp}, the others fp32"


def _threads(args) -> str:
    return f"{args.threads} thread(s) per process" if args.threads else "torch's default threads per process"


def _row(steps: int, nproc: int, args, per_round: list[dict], contenders: list[str]) -> list[str]:
    cells = []
    for name in contenders:
        if name == "loop":
            continue
        ratios = [
            measured[name]["samples_per_sec"] / measured["loop"]["samples_per_sec"] for measured in per_round
        ]
        cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    loop = statistics.median(measured["loop"]["samples_per_sec"] for measured in per_round)
    accuracy = ", ".join(
        f"{statistics.median(measured[name]['accuracy'] for measured in per_round):.3f}"
        for name in contenders
    )
    config = f"DDP, {nproc} processes" if nproc > 1 else "1 process"
    return [f"{steps} steps per rank", config, *cells, f"{loop:.0f}", accuracy]


def _autotune_gains(raw: dict[str, list[dict]]) -> list[str]:
    """--autotune against the same trainer without it, round by round (both contenders measured): the figure
    docs/speed.md's "--autotune" gives, median (range) of the rounds' ratios of samples/s."""
    lines = []
    for key, per_round in raw.items():
        ratios = [
            measured["autotune"]["samples_per_sec"] / measured["trainer"]["samples_per_sec"]
            for measured in per_round
            if "autotune" in measured and "trainer" in measured
        ]
        if ratios:
            lines.append(
                f"{key}: --autotune x{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) the "
                f"same trainer without it, samples/s, median (range) of the rounds' ratios"
            )
    return lines


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
