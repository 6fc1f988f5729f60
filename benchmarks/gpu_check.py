"""The one command that proves the GPU path: every check is one row of a Markdown table.

    bash benchmarks/gpu_check.sh                       # on a GPU machine: every row, within 13 min on one GPU
    bash benchmarks/gpu_check.sh --cpu-dry-run         # every row's code path on the CPU, tiny sizes (a CI test)
    bash benchmarks/gpu_check.sh --cpu-dry-run --jobs 2   # the same, two rows at a time (each uses about a core)
    bash benchmarks/gpu_check.sh --only dp,sync-bn --output /tmp/gpu_check.md
    bash benchmarks/gpu_check.sh --only float8 --budget 300   # a shorter loan: rows left without time FAIL

A row is a function `row_xxx(ctx) -> Verdict` registered with @row("name"); a
later issue adds a check by adding one. A row that raises becomes FAIL with
its one-line error, and the other rows still run. A feature that does not
exist yet is "n/a". In a dry run the rows that need CUDA run what they can on
the CPU and report "skipped: no CUDA", so their code cannot rot.

Training runs are real `main_multi_gpu.py` processes (under torchrun for DDP);
what needs the Python API runs in gpu_check_workers.py, also in its own
process. Every process has a time limit taken from the whole run's budget.
Writes the table to --output (default gpu_check.md) and the raw figures as
JSON beside it. Exit status: 0 when no row FAILs, else 1; 0 with one line on a
machine without CUDA (unless --cpu-dry-run); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]
from gpu_check_workers import RESULT, read_scalars  # noqa: E402  (after the path set-up)

from multigpu.monitoring.flops import transformer_flops_per_token  # noqa: E402

EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:")  # torchrun's prefix of a worker's lines
PASS, FAIL, NOT_APPLICABLE, NO_CUDA = "PASS", "FAIL", "n/a", "skipped: no CUDA"
# The whole run's time: on GPUs under 13 minutes (a short loan of a GPU machine; a row left without time is a
# FAIL that says so; --only runs fewer rows); the dry run's only catches hangs (CI machines are slow).
BUDGET_S = {"gpu": 780.0, "dry": 600.0}
LOSS_DROP = 0.9  # "the loss decreases": the last logged train/loss is below 0.9 x the first
SYNC_BN_TOLERANCE = 1e-4  # max abs difference of weights and running statistics, fp32 without TF32
FSDP_TOLERANCE = 1e-4  # fsdp against ddp, fp32 MLP: reduce-scatter and all-reduce sum in different orders
TARGET_RATIO = 0.97  # trainer samples/s at least this share of the hand-written loop's
# Issue 43's pass lines: NVIDIA's ResNet-50 v1.5 reference is 2,470 img/s on one A100 (mixed precision), x1.5;
# nanoGPT's GPT-2 small reaches about 40% MFU on an A100; a data wait this small means the data never waits.
RESNET50_TARGET = 3700.0  # samples/s, --autotune --amp auto, synthetic data on the device, --batch-size auto
GPT_MFU_TARGET = 0.40
DATA_WAIT_LIMIT = 0.05  # of each interval's time, median
FORMULA_TOLERANCE = 0.10  # the trainer's MFU against 6N + attention's, relative

# How big each check is: on GPUs, and tiny for the CPU dry run. "{batch}" and "{samples}" are filled per run.
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "train": [
            "--train-size",
            "19200",
            "--val-size",
            "512",
            "--batch-size",
            "64",
            "--epochs",
            "1",
            "--log-every",
            "20",
            "--lr",
            "1e-3",
        ],  # 300 steps
        "ddp": {"batch": 64, "steps": 40, "log_every": 10, "save_every": 20},
        "dp": [
            "--model",
            "resnet18",
            "--image-shape",
            "3,32,32",
            "--train-size",
            "8192",
            "--val-size",
            "512",
            "--batch-size",
            "128",
            "--epochs",
            "1",
            "--log-every",
            "16",
        ],
        "overflow": {"batch": 64, "steps": 60, "bad_step": 30, "log_every": 10},
        "sync_bn": {"batch": 16, "steps": 12, "log_every": 4},
        "fsdp": {"batch": 64, "steps": 20, "log_every": 5, "memory": []},  # memory: the 50M-parameter model
        "hsdp": {"batch": 32, "steps": 20, "log_every": 5},
        "data_path": {"batch_shape": [128, 3, 224, 224], "steps": 20},
        "predict": {"samples": 20000, "batch": 512, "shape": [3, 16, 16]},
        "throughput": {
            "model": "resnet50",
            "image_shape": [3, 224, 224],
            "classes": 1000,
            "steps": 30,
            "log_every": 10,
            "rounds": 3,
            "workers": 4,
            "amps": ["off", "bf16"],
        },
        "compile": [
            "--train-size",
            "9600",
            "--val-size",
            "512",
            "--batch-size",
            "64",
            "--epochs",
            "1",
            "--log-every",
            "15",
            "--amp",
            "bf16",
        ],  # 150 steps: compiling is most of the time
        "channels_last": [
            "--model",
            "resnet18",
            "--image-shape",
            "3,32,32",
            "--train-size",
            "25600",
            "--val-size",
            "512",
            "--batch-size",
            "256",
            "--epochs",
            "1",
            "--log-every",
            "20",
            "--amp",
            "bf16",
        ],
        "batch_auto": [
            "--model",
            "resnet50",
            "--image-shape",
            "3,224,224",
            "--num-classes",
            "1000",
            "--train-size",
            "4096",
            "--val-size",
            "64",
            "--epochs",
            "1",
            "--log-every",
            "2",
            "--amp",
            "bf16",
        ],
        "mfu": [
            "--model",
            "resnet50",
            "--image-shape",
            "3,224,224",
            "--num-classes",
            "1000",
            "--val-size",
            "64",
            "--epochs",
            "1",
            "--log-every",
            "10",
            "--amp",
            "bf16",
        ],  # + batch and train size by GPU memory
        # 224 timed steps a run: the cnn's step is 2.5-3 ms on an H200, so 24 (70 ms) judged 3% on noise
        "scaling": ["--rounds", "3", "--steps", "256", "--log-every", "32", "--batch", "64"],
        # issue 43's rows: data on the device, ResNet-50 past NVIDIA's reference, GPT-2 small's MFU, float8
        "data_on_device": [
            "--model",
            "resnet18",
            "--image-shape",
            "3,32,32",
            "--train-size",
            "25600",
            "--val-size",
            "512",
            "--batch-size",
            "256",
            "--epochs",
            "1",
            "--log-every",
            "20",
            "--amp",
            "bf16",
        ],
        # 100 steps: an H100's batch (1,555) made 8,192 samples x 3 epochs 18 steps, too few for the trials
        "resnet50": [
            "--model",
            "resnet50",
            "--image-shape",
            "3,224,224",
            "--num-classes",
            "1000",
            "--train-size",
            "16384",
            "--val-size",
            "64",
            "--epochs",
            "12",
            "--max-steps",
            "100",
            "--log-every",
            "10",
            "--batch-size",
            "auto",
        ],
        "gpt": {
            "characters": 4_000_000,
            "args": [
                "--n-layer",
                "12",
                "--n-head",
                "12",
                "--n-embd",
                "768",
                "--block-size",
                "1024",
                "--batch-size",
                "48",
                "--max-steps",
                "60",
                "--log-every",
                "10",
                "--compile",
            ],
        },
    },
    "dry": {
        "train": [
            "--train-size",
            "512",
            "--val-size",
            "64",
            "--batch-size",
            "32",
            "--epochs",
            "2",
            "--log-every",
            "4",
            "--lr",
            "3e-3",
        ],
        "ddp": {"batch": 16, "steps": 8, "log_every": 4, "save_every": 4},
        "dp": [
            "--train-size",
            "128",
            "--val-size",
            "32",
            "--batch-size",
            "16",
            "--epochs",
            "1",
            "--log-every",
            "4",
        ],
        "overflow": {"batch": 16, "steps": 12, "bad_step": 6, "log_every": 4},
        "sync_bn": {"batch": 8, "steps": 8, "log_every": 4},
        "fsdp": {"batch": 16, "steps": 4, "log_every": 2, "memory": ["--small"]},
        "hsdp": {"batch": 8, "steps": 3, "log_every": 3},
        "data_path": {},
        "predict": {"samples": 101, "batch": 16, "shape": [3, 8, 8]},
        "throughput": {
            "model": "small",
            "image_shape": [3, 16, 16],
            "classes": 10,
            "steps": 8,
            "log_every": 2,
            "rounds": 2,
            "workers": 0,
            "amps": ["off", "bf16"],
            "batch": 8,
        },  # 2 rounds: both orders
        # The CPU compiles C++ for --compile: a tiny MLP, so the dry run's compile takes seconds, not minutes.
        "compile": [
            "--mode",
            "flatten",
            "--image-shape",
            "1,8,8",
            "--train-size",
            "256",
            "--val-size",
            "32",
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--log-every",
            "2",
            "--lr",
            "3e-3",
        ],
        "channels_last": [
            "--image-shape",
            "3,12,12",
            "--train-size",
            "256",
            "--val-size",
            "32",
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--log-every",
            "2",
            "--lr",
            "3e-3",
        ],
        "batch_auto": ["--train-size", "128", "--val-size", "32", "--epochs", "1", "--log-every", "1"],
        "mfu": [
            "--image-shape",
            "3,16,16",
            "--val-size",
            "32",
            "--epochs",
            "1",
            "--log-every",
            "2",
            "--amp",
            "bf16",
        ],
        "scaling": [
            "--rounds",
            "1",
            "--steps",
            "6",
            "--log-every",
            "2",
            "--batch",
            "8",
            "--max-devices",
            "1",
        ],
        "data_on_device": [
            "--image-shape",
            "3,12,12",
            "--train-size",
            "256",
            "--val-size",
            "32",
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--log-every",
            "2",
        ],
        "resnet50": [
            "--image-shape",
            "3,16,16",
            "--train-size",
            "768",
            "--val-size",
            "32",
            "--epochs",
            "1",
            "--log-every",
            "4",
            "--batch-size",
            "auto",
        ],  # the cnn: 12 steps, too few to tune
        "gpt": {
            "characters": 6000,
            "args": [
                "--n-layer",
                "2",
                "--n-head",
                "2",
                "--n-embd",
                "32",
                "--block-size",
                "32",
                "--batch-size",
                "8",
                "--max-steps",
                "8",
                "--log-every",
                "2",
            ],
        },
    },
}


class RowError(Exception):
    """A check that could not be carried out; its message is the row's one-line figure."""


@dataclass
class Verdict:
    """What a row function returns: PASS/FAIL/n/a/skipped: no CUDA, the figure shown, the raw figures."""

    status: str
    figure: str
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    """One line of the table: a registered check and its verdict."""

    name: str
    status: str
    figure: str
    raw: dict[str, Any]
    seconds: float


ROWS: list[tuple[str, Callable[[Context], Verdict]]] = []


def row(name: str) -> Callable[[Callable[[Context], Verdict]], Callable[[Context], Verdict]]:
    """Register a check as a row of the table, in the order of definition."""

    def register(function: Callable[[Context], Verdict]) -> Callable[[Context], Verdict]:
        ROWS.append((name, function))
        return function

    return register


def row_names() -> list[str]:
    return [name for name, _ in ROWS]


# ---------------------------------------------------------------------------- running things
@dataclass
class Context:
    """What every row may use: the machine, the sizes, a scratch folder and the time left."""

    dry_run: bool
    cuda: bool
    gpus: int
    gpu_memory_gib: float
    scratch: Path
    deadline: float
    python: str = sys.executable
    gpt_runs: dict[tuple[str, ...], dict[str, Any]] = field(
        default_factory=dict
    )  # gpt_run's, by its extra flags
    runs: dict[str, Any] = field(default_factory=dict)  # shared_run's, by name
    runs_lock: threading.Lock = field(
        default_factory=threading.Lock
    )  # rows side by side (--jobs) share them too

    def shared_run(self, name: str, make: Callable[[], Any]) -> Any:
        """make()'s result, made once per check: rows that read the same run share it (a row beside the one making
        it waits for it)."""
        with self.runs_lock:
            if name not in self.runs:
                self.runs[name] = make()
            return self.runs[name]

    def sizes(self, check: str) -> Any:
        return SIZES["dry" if self.dry_run else "gpu"][check]

    @property
    def nproc(self) -> int:
        """Processes of the torchrun checks: one per GPU (one gloo process in a dry run)."""
        return self.gpus if self.cuda else 1

    def folder(self, name: str) -> str:
        path = self.scratch / name
        path.mkdir(parents=True, exist_ok=False)
        return str(path)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run `command` in the repository, at most `timeout` s (less if the budget is nearly spent)."""
        limit = min(timeout, self.seconds_left())
        if limit <= 1:
            raise RowError("not run: the time budget of the whole check is spent")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.dry_run:
            env["OMP_NUM_THREADS"] = "1"  # tiny runs on a small CI machine: threads would only compete
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            try:
                stdout = process.communicate(timeout=10)[
                    0
                ]  # a survivor holding the pipes must not hold the check
            except subprocess.TimeoutExpired:
                stdout = ""
            script = next((Path(arg).name for arg in command if arg.endswith(".py")), command[0])
            raise RowError(
                f"timed out after {limit:.0f}s: {script}; its last output: {last_line(stdout)!r}"
            ) from None
        result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        if result.returncode != 0:
            raise RowError(f"exit {result.returncode}: {error_line(stderr) or error_line(stdout)}")
        return result

    def launch(
        self, script: str, args: Sequence[str], nproc: int | None, timeout: float
    ) -> subprocess.CompletedProcess:
        """`python SCRIPT ARGS`, or under torchrun with `nproc` processes."""
        path = str(REPO / script)
        launcher = (
            []
            if nproc is None
            else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        )
        return self.run([self.python, *launcher, path, *args], timeout)

    def cli(
        self, args: Sequence[str], timeout: float, nproc: int | None = None
    ) -> subprocess.CompletedProcess:
        """main_multi_gpu.py with `args`, quiet (no bar; a log line per --log-every steps)."""
        return self.launch(
            "main_multi_gpu.py", [*args, "--no-progress", "--dist-timeout", "120"], nproc, timeout
        )

    def worker(
        self, name: str, params: dict[str, Any], timeout: float, nproc: int | None = None
    ) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
        """Run one worker of gpu_check_workers.py; its figures and the finished process."""
        result = self.launch("benchmarks/gpu_check_workers.py", [name, json.dumps(params)], nproc, timeout)
        lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
        if not lines:
            raise RowError(f"worker {name} printed no result: {last_line(result.stdout)}")
        return json.loads(lines[-1][len(RESULT) :]), result


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun's workers have process groups of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    family, index = [pid], 0
    while index < len(family):
        family += children.get(family[index], [])
        index += 1
    for member in family:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def error_line(text: str) -> str:
    """The line that says what failed: the CLI's `error:` line or the last exception, not torchrun's banners."""
    lines = [RANK_PREFIX.sub("", line).strip() for line in text.splitlines() if line.strip(" =-")]
    said = [line for line in lines if line.startswith("error:") or EXCEPTION_LINE.match(line)]
    said = [line for line in said if "ChildFailedError" not in line] or lines
    return said[-1][:300] if said else ""


def judge(
    ctx: Context, figure: str, raw: dict[str, Any], problems: list[str], needs_cuda: bool = True
) -> Verdict:
    """FAIL naming what went wrong; else PASS, or "skipped: no CUDA" for a CUDA check whose CPU path ran."""
    if problems:
        return Verdict(FAIL, f"{'; '.join(problems)} ({figure})", raw)
    if needs_cuda and not ctx.cuda:
        return Verdict(NO_CUDA, f"CPU path ran: {figure}", raw)
    return Verdict(PASS, figure, raw)


def values(scalars: dict[str, list[tuple[int, float]]], tag: str) -> list[float]:
    return [value for _, value in scalars.get(tag, [])]


def loss_problems(losses: list[float]) -> list[str]:
    if len(losses) < 2:
        return [f"{len(losses)} logged losses, need 2 or more"]
    if not losses[-1] < LOSS_DROP * losses[0]:
        return [
            f"loss did not decrease (last {losses[-1]:.4g} not below {LOSS_DROP} x first {losses[0]:.4g})"
        ]
    return []


def gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------- 1. environment
def driver_version() -> str:
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"
    return output.splitlines()[0].strip() if output.strip() else "unknown"


@row("environment")
def row_environment(ctx: Context) -> Verdict:
    import torch

    raw: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_build": torch.version.cuda,
        "cpus": os.cpu_count(),
        "gpus": [],
    }
    if not ctx.cuda:
        return Verdict(
            PASS,
            f"no CUDA device; torch {raw['torch']} (CUDA build {raw['cuda_build']}); "
            f"Python {raw['python']}; {raw['cpus']} CPUs",
            raw,
        )
    for index in range(ctx.gpus):
        props = torch.cuda.get_device_properties(index)
        raw["gpus"].append(
            {
                "name": props.name,
                "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
            }
        )
    nccl = torch.cuda.nccl.version()
    raw.update(
        driver=driver_version(),
        cudnn=torch.backends.cudnn.version(),
        bf16=torch.cuda.is_bf16_supported(),
        nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    )
    first = raw["gpus"][0]
    figure = (
        f"{ctx.gpus} x {first['name']} ({gib(first['memory_bytes'])}, sm {first['capability']}); "
        f"driver {raw['driver']}; CUDA {raw['cuda_build']}; cuDNN {raw['cudnn']}; NCCL {raw['nccl']}; "
        f"torch {raw['torch']}; bf16 {'yes' if raw['bf16'] else 'no'}; Python {raw['python']}; {raw['cpus']} CPUs"
    )
    return Verdict(PASS, figure, raw)


# ---------------------------------------------------------------------------- 2. one GPU, three precisions
def train(
    ctx: Context, name: str, extra: Sequence[str], sizes: str = "train", timeout: float = 120
) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """Train through the CLI on one device (the "train" sizes unless told); its TensorBoard scalars and stdout."""
    save_dir = ctx.folder(name)
    result = ctx.cli(
        [*ctx.sizes(sizes), "--multi-gpu", "none", "--save-dir", save_dir, *extra], timeout=timeout
    )
    return read_scalars(os.path.join(save_dir, "tb")), result.stdout


def median_rate(scalars: dict[str, list[tuple[int, float]]]) -> tuple[str, float | None]:
    """The median of the logged train/samples_per_sec, as text for a figure and as a number (None: none logged)."""
    rates = values(scalars, "train/samples_per_sec")
    rate = statistics.median(rates) if rates else None
    return ("" if rate is None else f", {rate:.0f} samples/s"), rate


def loss_figure(scalars: dict[str, list[tuple[int, float]]]) -> tuple[str, dict[str, Any], list[str]]:
    losses = values(scalars, "train/loss")
    steps = scalars["train/loss"][-1][0] if losses else 0
    rate_text, rate = median_rate(scalars)
    figure = (
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps{rate_text}"
        if losses
        else "no loss logged"
    )
    return figure, {"losses": losses, "steps": steps, "samples_per_sec": rate}, loss_problems(losses)


def train_bf16(ctx: Context) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """The "train" sizes in bf16 on one device, trained once: the bf16 row reads its loss, telemetry its time split."""
    return ctx.shared_run("train-bf16", lambda: train(ctx, "train-bf16", ["--amp", "bf16"]))


def precision_row(ctx: Context, amp: str) -> Verdict:
    scalars = train_bf16(ctx)[0] if amp == "bf16" else train(ctx, f"train-{amp}", ["--amp", amp])[0]
    figure, raw, problems = loss_figure(scalars)
    return judge(ctx, figure, raw, problems, needs_cuda=False)


@row("train fp32")
def row_train_fp32(ctx: Context) -> Verdict:
    return precision_row(ctx, "off")


@row("train bf16")
def row_train_bf16(ctx: Context) -> Verdict:
    return precision_row(ctx, "bf16")


@row("train fp16")
def row_train_fp16(ctx: Context) -> Verdict:
    scalars, stdout = train(ctx, "train-fp16", ["--amp", "fp16"])
    figure, raw, problems = loss_figure(scalars)
    scales = values(scalars, "train/loss_scale")
    raw.update(loss_scale=scales, skipped_steps=sum(values(scalars, "train/skipped_steps")))
    if not ctx.cuda:  # the CPU has no fp16 autocast: the trainer says so and uses bf16
        fallback = "--amp fp16 needs a CUDA device" in stdout
        return judge(
            ctx,
            f"{figure}; bf16 fallback line {'printed' if fallback else 'missing'}",
            raw,
            problems + ([] if fallback else ["no bf16 fallback line on the CPU"]),
        )
    if not scales:
        problems.append("no train/loss_scale logged: the GradScaler was not used")
    scale_text = f"{scales[0]:g} -> {scales[-1]:g}" if scales else "none"
    return judge(
        ctx,
        f"{figure}; GradScaler loss scale {scale_text}, {raw['skipped_steps']:.0f} step(s) skipped",
        raw,
        problems,
    )


@row("fp16 overflow")
def row_fp16_overflow(ctx: Context) -> Verdict:
    sizes = ctx.sizes("overflow")
    params = {**sizes, "samples": sizes["batch"] * sizes["steps"], "save_dir": ctx.folder("overflow")}
    raw, _ = ctx.worker("fp16-overflow", params, timeout=120)
    bad, problems = raw["injected_step"], []
    if bad not in raw["skipped_steps_seen"]:
        problems.append(f"the step with the injected inf (step {bad}) was not skipped")
    if not raw["weights_unchanged_at_injected_step"]:
        problems.append("weights changed at the skipped step")
    if not raw["weights_changed_at_step_before"] and bad - 1 not in raw["skipped_steps_seen"]:
        problems.append("weights did not change at the normal step before it")
    if raw["skipped_steps_logged"] != len(raw["skipped_steps_seen"]):
        problems.append(
            f"train/skipped_steps counted {raw['skipped_steps_logged']:.0f}, "
            f"the loss scale fell {len(raw['skipped_steps_seen'])} time(s)"
        )
    figure = (
        f"inf loss injected at step {bad}: skipped (weights unchanged), loss scale {raw['scale_before']:g} -> "
        f"{raw['scale_after']:g}; train/skipped_steps {raw['skipped_steps_logged']:.0f} "
        f"(steps {raw['skipped_steps_seen']})"
    )
    return judge(ctx, figure, raw, problems)


# ---------------------------------------------------------------------------- 3. torchrun with NCCL
def load_checkpoint(path: str) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def load_last(save_dir: str) -> dict[str, Any]:
    """The run's last checkpoint read whole: `last/` (sharded, fsdp's default; read by one process, whatever the
    number that wrote it) or `last.pt`."""
    from multigpu.checkpoints import sharded

    folder = os.path.join(save_dir, "last")
    return sharded.load_whole(folder) if os.path.isdir(folder) else load_checkpoint(folder + ".pt")


@row("ddp torchrun")
def row_ddp_torchrun(ctx: Context) -> Verdict:
    sizes, nproc = ctx.sizes("ddp"), ctx.nproc
    save_dir = ctx.folder("ddp")
    args = [
        "--multi-gpu",
        "ddp",
        "--train-size",
        str(sizes["batch"] * nproc * sizes["steps"]),
        "--val-size",
        "256",
        "--batch-size",
        str(sizes["batch"]),
        "--log-every",
        str(sizes["log_every"]),
        "--save-every-steps",
        str(sizes["save_every"]),
        "--save-dir",
        save_dir,
    ]
    first = ctx.cli([*args, "--epochs", "1"], timeout=150, nproc=nproc).stdout
    backend = "nccl" if ctx.cuda else "gloo"
    events = sorted(str(path.relative_to(save_dir)) for path in Path(save_dir).rglob("events.out.tfevents.*"))
    # Rank 0's files; the save-dir's lock (.run.lock) is the run's own and not an output.
    files = sorted(
        path.name for path in Path(save_dir).iterdir() if path.is_file() and path.name != ".run.lock"
    )
    state = load_checkpoint(os.path.join(save_dir, "last.pt"))
    second = ctx.cli([*args, "--epochs", "2", "--resume", "auto"], timeout=150, nproc=nproc).stdout
    resumed = load_checkpoint(os.path.join(save_dir, "last.pt"))
    raw = {
        "nproc": nproc,
        "event_files": events,
        "files": files,
        "done_lines": first.count("done:"),
        "first": {
            "epoch": state["epoch"],
            "global_step": state["global_step"],
            "world_size": state["world_size"],
        },
        "resumed": {"epoch": resumed["epoch"], "global_step": resumed["global_step"]},
    }
    problems = [
        text
        for failed, text in [
            (
                f"mode ddp: {nproc} processes, backend {backend}" not in first,
                f"no 'mode ddp ... backend {backend}' line",
            ),
            (raw["done_lines"] != 1, f"{raw['done_lines']} 'done:' lines (only rank 0 may print)"),
            (len(events) != 1, f"{len(events)} event files (only rank 0 may write)"),
            (
                any(not (name.endswith(".pt") and ".tmp" not in name) for name in files),
                f"unexpected files {files}",
            ),
            (
                state["world_size"] != nproc or state["epoch"] != 1,
                "last.pt is not epoch 1 of this world size",
            ),
            ("resumed from" not in second, "the second run did not resume"),
            (
                (resumed["epoch"], resumed["global_step"]) != (2, 2 * state["global_step"]),
                f"resume ended at epoch {resumed['epoch']} step {resumed['global_step']}",
            ),
        ]
        if failed
    ]
    figure = (
        f"{nproc} process(es), {backend}: {raw['done_lines']} 'done:' line, {len(events)} event file, "
        f"{', '.join(files)}; "
        f"last.pt loads with weights_only=True (step {state['global_step']}); --resume auto continued to "
        f"epoch {resumed['epoch']}, step {resumed['global_step']}"
    )
    return judge(ctx, figure, raw, problems)


# ---------------------------------------------------------------------------- 4. DataParallel
@row("dp")
def row_dp(ctx: Context) -> Verdict:
    save_dir = ctx.folder("dp")
    raw, result = ctx.worker(
        "cli",
        {"argv": [*ctx.sizes("dp"), "--multi-gpu", "dp", "--no-progress", "--save-dir", save_dir]},
        timeout=120,
    )
    rate_text, raw["samples_per_sec"] = median_rate(read_scalars(os.path.join(save_dir, "tb")))
    problems = (
        []
        if raw["exit"] == 0 and "done:" in result.stdout
        else [f"exit {raw['exit']} without a 'done:' line"]
    )
    if ctx.gpus >= 2:
        ids = ",".join(map(str, range(ctx.gpus)))
        if f"nn.DataParallel over cuda:{ids}" not in result.stdout:
            problems.append(f"no 'DataParallel over cuda:{ids}' line")
        if not all(raw["max_memory_allocated"]):
            problems.append("a GPU was not used")
        memory = " / ".join(gib(peak) for peak in raw["max_memory_allocated"])
        return judge(
            ctx, f"DataParallel over {ctx.gpus} GPUs{rate_text}; peak memory per GPU {memory}", raw, problems
        )
    if "--multi-gpu dp needs 2 or more GPUs" not in result.stdout:
        problems.append("no fallback line for fewer than 2 GPUs")
    device = "cuda:0" if ctx.cuda else "cpu"
    return judge(
        ctx,
        f"{ctx.gpus} GPU{'' if ctx.gpus == 1 else 's'}: fallback line printed, trained on {device}"
        f"{rate_text}",
        raw,
        problems,
    )


# ---------------------------------------------------------------------------- 5. SyncBatchNorm
@row("sync-bn")
def row_sync_bn(ctx: Context) -> Verdict:
    sizes, nproc = ctx.sizes("sync_bn"), ctx.nproc
    state = str(ctx.scratch / "sync-bn.pt")
    params = {
        **sizes,
        "samples": sizes["batch"] * nproc * sizes["steps"],
        "sync_bn": True,
        "save_dir": ctx.folder("sync-bn"),
        "state_out": state,
    }
    raw, _ = ctx.worker("sync-bn", params, timeout=120, nproc=nproc)
    problems = loss_problems(raw["losses"])
    expected = raw["batchnorm_layers"] if ctx.cuda else 0  # SyncBatchNorm cannot train on the CPU: kept as is
    if raw["sync_batchnorm_layers"] != expected:
        problems.append(f"{raw['sync_batchnorm_layers']} SyncBatchNorm layers, expected {expected}")
    figure = (
        f"{raw['sync_batchnorm_layers']} of {raw['batchnorm_layers']} BatchNorm layers converted under DDP "
        f"({nproc} process(es)); loss {raw['losses'][0]:.3f} -> {raw['losses'][-1]:.3f}"
    )
    if nproc >= 2:
        single = str(ctx.scratch / "sync-bn-single.pt")
        ctx.worker(
            "sync-bn",
            {
                **params,
                "batch": sizes["batch"] * nproc,
                "sync_bn": False,
                "state_out": single,
                "save_dir": ctx.folder("sync-bn-single"),
            },
            timeout=60,
        )
        raw["max_abs_difference"] = max_difference(load_checkpoint(state), load_checkpoint(single))
        if not raw["max_abs_difference"] <= SYNC_BN_TOLERANCE:
            problems.append(
                f"differs from one process by {raw['max_abs_difference']:.3g} > {SYNC_BN_TOLERANCE}"
            )
        figure += (
            f"; {nproc} x {sizes['batch']} vs 1 process x {nproc * sizes['batch']}: max abs difference "
            f"{raw['max_abs_difference']:.3g} (tolerance {SYNC_BN_TOLERANCE})"
        )
    else:
        figure += "; equality with one process: n/a (needs 2 GPUs)"
    return judge(ctx, figure, raw, problems)


def max_difference(first: dict[str, Any], second: dict[str, Any]) -> float:
    return max((first[key].double() - second[key].double()).abs().max().item() for key in first)


# ---------------------------------------------------------------------------- 5b. sharded training
@row("fsdp")
def row_fsdp(ctx: Context) -> Verdict:
    """--multi-gpu fsdp on NCCL: the same weights as ddp (fp32), bf16 through FSDP's policy, its checkpoint of
    N processes resumed by one (reshard N -> 1), and 1/N of ddp's per-rank memory (benchmarks/memory_scaling.py)."""
    sizes, nproc = ctx.sizes("fsdp"), ctx.nproc
    args = [
        "--mode",
        "flatten",
        "--train-size",
        str(sizes["batch"] * nproc * sizes["steps"]),
        "--val-size",
        "64",
        "--batch-size",
        str(sizes["batch"]),
        "--log-every",
        str(sizes["log_every"]),
        "--lr-schedule",
        "constant",
    ]
    weights = {}
    for mode in ("ddp", "fsdp"):
        save_dir = ctx.folder(f"fsdp-{mode}")
        ctx.cli(
            [*args, "--multi-gpu", mode, "--epochs", "1", "--save-dir", save_dir], timeout=150, nproc=nproc
        )
        weights[mode] = load_last(save_dir)["model"]
    bf16_dir = ctx.folder("fsdp-bf16")
    bf16 = ctx.cli(
        [*args, "--multi-gpu", "fsdp", "--amp", "bf16", "--epochs", "1", "--save-dir", bf16_dir],
        timeout=150,
        nproc=nproc,
    ).stdout
    resumed = ctx.cli(
        [
            *args,
            "--multi-gpu",
            "fsdp",
            "--amp",
            "bf16",
            "--epochs",
            "2",
            "--resume",
            "auto",
            "--save-dir",
            bf16_dir,
        ],
        timeout=150,
    ).stdout  # one process: the whole model in one shard
    memory = ctx.scratch / "fsdp-memory.json"
    ctx.run(
        [
            ctx.python,
            str(HERE / "memory_scaling.py"),
            *sizes["memory"],
            "--device",
            "cuda" if ctx.cuda else "cpu",
            "--processes",
            str(nproc),  # the row compares ddp and fsdp at N processes: one world size is enough
            "--json",
            str(memory),
        ],
        timeout=240,
    )
    ranks = json.loads(memory.read_text())[str(nproc)]
    held = {
        mode: max(sum(rank[mode][key] for key in ("params", "grads", "optimizer")) for rank in ranks)
        for mode in ("ddp", "fsdp")
    }
    largest_block = ranks[0]["fsdp"]["largest_block"]
    losses = values(read_scalars(os.path.join(bf16_dir, "tb")), "train/loss")
    raw = {
        "nproc": nproc,
        "max_abs_difference": max_difference(weights["fsdp"], weights["ddp"]),
        "bytes": held,
        "bf16_losses": losses,
        "memory": ranks,
    }
    problems = [
        text
        for failed, text in [
            (
                not raw["max_abs_difference"] <= FSDP_TOLERANCE,
                f"fsdp differs from ddp by {raw['max_abs_difference']:.3g} > {FSDP_TOLERANCE}",
            ),
            (f"mode fsdp: {nproc} process" not in bf16 and nproc > 1, "no 'mode fsdp' line"),
            (not losses or not all(map(math.isfinite, losses)), f"bf16 losses {losses}"),
            (
                "resumed from" not in resumed or "one shard" not in resumed,
                "the fsdp checkpoint did not resume in 1 process",
            ),
            (
                held["fsdp"] > held["ddp"] / nproc * 1.1 + largest_block,
                f"fsdp holds {held['fsdp'] / 1e6:.1f} MB per rank, "
                f"not about 1/{nproc} of ddp's {held['ddp'] / 1e6:.1f} MB",
            ),
        ]
        if failed
    ]
    figure = (
        f"{nproc} process(es): fsdp vs ddp fp32 max abs difference {raw['max_abs_difference']:.3g} "
        f"(tolerance {FSDP_TOLERANCE}); bf16 loss {losses[0] if losses else float('nan'):.3f} -> "
        f"{losses[-1] if losses else float('nan'):.3f}; checkpoint of {nproc} resumed in 1; params+grads+AdamW "
        f"per rank {held['fsdp'] / 1e6:.1f} MB vs ddp {held['ddp'] / 1e6:.1f} MB "
        f"({held['fsdp'] / held['ddp']:.3f}, ideal {1 / nproc:.3f})"
    )
    return judge(ctx, figure, raw, problems)


@row("hsdp")
def row_hsdp(ctx: Context) -> Verdict:
    """--multi-gpu fsdp on a hybrid mesh (--dp-replicate 2) with NCCL: replicate 2 x shard N/2 on 4 or more GPUs,
    2 x 1 on 2 or 3 (the 2-D mesh's code path; on one node); the same weights as ddp with --grad-accum-steps 2,
    and its checkpoint resumed at 1 x N (sharded over every process). Needs 2 GPUs (2 gloo processes dry)."""
    if ctx.cuda and ctx.gpus < 2:
        return Verdict(NOT_APPLICABLE, f"hybrid sharding needs 2 or more GPUs, this machine has {ctx.gpus}")
    sizes = ctx.sizes("hsdp")
    nproc = 2 * (ctx.gpus // 2) if ctx.cuda else 2
    shard = nproc // 2
    args = [
        "--mode",
        "flatten",
        "--train-size",
        str(sizes["batch"] * nproc * 2 * sizes["steps"]),
        "--val-size",
        "64",
        "--batch-size",
        str(sizes["batch"]),
        "--grad-accum-steps",
        "2",
        "--log-every",
        str(sizes["log_every"]),
        "--lr-schedule",
        "constant",
        "--epochs",
        "1",
    ]
    runs = {"ddp": ["--multi-gpu", "ddp"], "hsdp": ["--multi-gpu", "fsdp", "--dp-replicate", "2"]}
    outputs, weights = {}, {}
    for name, flags in runs.items():
        save_dir = ctx.folder(f"hsdp-{name}")
        outputs[name] = ctx.cli([*args, *flags, "--save-dir", save_dir], timeout=150, nproc=nproc).stdout
        weights[name] = load_last(save_dir)["model"]
    resumed = ctx.cli(
        [
            *args,
            "--multi-gpu",
            "fsdp",
            "--dp-replicate",
            "1",
            "--epochs",
            "2",
            "--resume",
            "auto",
            "--save-dir",
            str(ctx.scratch / "hsdp-hsdp"),
        ],
        timeout=150,
        nproc=nproc,
    ).stdout
    raw = {
        "nproc": nproc,
        "mesh": [2, shard],
        "max_abs_difference": max_difference(weights["hsdp"], weights["ddp"]),
    }
    problems = [
        text
        for failed, text in [
            (
                not raw["max_abs_difference"] <= FSDP_TOLERANCE,
                f"hybrid differs from ddp by {raw['max_abs_difference']:.3g} > {FSDP_TOLERANCE}",
            ),
            (f"mesh replicate 2 x shard {shard}" not in outputs["hsdp"], "no 'mesh replicate 2' plan line"),
            ("resumed from" not in resumed, f"the 2 x {shard} checkpoint did not resume at 1 x {nproc}"),
        ]
        if failed
    ]
    figure = (
        f"{nproc} processes, mesh replicate 2 x shard {shard}, 2 accumulation steps: vs ddp max abs difference "
        f"{raw['max_abs_difference']:.3g} (tolerance {FSDP_TOLERANCE}); checkpoint resumed at 1 x {nproc}"
    )
    return judge(ctx, figure, raw, problems)


# ---------------------------------------------------------------------------- 6. data path
@row("data path")
def row_data_path(ctx: Context) -> Verdict:
    raw, _ = ctx.worker(
        "data-path", {**ctx.sizes("data_path"), "save_dir": ctx.folder("data-path")}, timeout=90
    )
    problems = (
        []
        if raw["loader_pin_memory"] == ctx.cuda
        else [f"train_loader.pin_memory is {raw['loader_pin_memory']}"]
    )
    figure = f"train_loader.pin_memory {raw['loader_pin_memory']} on {raw['device']}, {raw['loader_workers']} workers"
    if "copy" in raw:
        pinned, pageable = raw["copy"]["pinned"], raw["copy"]["pageable"]
        if not pinned["host_wait_ms"] < pageable["host_wait_ms"]:
            problems.append("a pinned non_blocking copy held the host as long as a pageable one")
        shape = "x".join(map(str, ctx.sizes("data_path")["batch_shape"]))
        figure += (
            f"; copy {shape} + conv: pinned {pinned['steps_per_sec']:.0f} steps/s (host waits "
            f"{pinned['host_wait_ms']:.3f} ms per copy), pageable {pageable['steps_per_sec']:.0f} steps/s "
            f"(host waits {pageable['host_wait_ms']:.3f} ms)"
        )
    return judge(ctx, figure, raw, problems)


# ---------------------------------------------------------------------------- 7. throughput
def throughput_batch(ctx: Context) -> int:
    """ResNet-50 at 224 px: a batch per GPU that fills memory reasonably (about 30 GiB at 256 in fp32)."""
    if ctx.dry_run:
        return ctx.sizes("throughput")["batch"]
    return next(
        batch for memory, batch in ((70, 256), (35, 128), (16, 64), (0, 32)) if ctx.gpu_memory_gib >= memory
    )


@row("throughput")
def row_throughput(ctx: Context) -> Verdict:
    nproc = ctx.nproc
    params = {**ctx.sizes("throughput"), "batch": throughput_batch(ctx), "tmp": ctx.folder("throughput")}
    raw, _ = ctx.worker("throughput", params, timeout=300, nproc=nproc)
    medians = {
        amp: {loop: statistics.median(rates) for loop, rates in loops.items()}
        for amp, loops in raw["samples_per_sec"].items()
    }
    ratios = {amp: loops["trainer"] / loops["raw"] for amp, loops in medians.items()}
    raw.update(
        medians=medians,
        ratios=ratios,
        batch_per_device=params["batch"],
        bf16_speedup=medians["bf16"]["trainer"] / medians["off"]["trainer"],
    )
    problems = [
        f"{amp}: trainer/raw {ratio:.3f} < {TARGET_RATIO}"
        for amp, ratio in ratios.items()
        if ratio < TARGET_RATIO
    ]
    shape = "x".join(map(str, params["image_shape"]))
    parts = [
        f"{'fp32' if amp == 'off' else amp} trainer {loops['trainer']:.0f} / raw {loops['raw']:.0f} samples/s "
        f"= {ratios[amp]:.3f}" + peak_text(raw["max_memory_allocated"][amp])
        for amp, loops in medians.items()
    ]
    figure = (
        f"{params['model']} {shape}, {nproc} process(es) x batch {params['batch']}, medians of "
        f"{params['rounds']} alternating rounds: {'; '.join(parts)}; bf16 speed-up x{raw['bf16_speedup']:.2f}"
    )
    return judge(ctx, figure, raw, problems if ctx.cuda else [])  # CPU rates say nothing about the target


def peak_text(peaks: dict[str, int | None]) -> str:
    """Peak memory of trainer and raw loop, where measured (CUDA only)."""
    if peaks["trainer"] is None:
        return ""
    return f", max_memory_allocated trainer {gib(peaks['trainer'])} / raw {gib(peaks['raw'])}"


# ---------------------------------------------------------------------------- 8. prediction
PREDICT_TOLERANCE = 1e-4  # max abs difference of GPU and CPU outputs, fp32 without TF32 (different kernels)


@row("predict GPU vs CPU")
def row_predict(ctx: Context) -> Verdict:
    sizes, nproc = ctx.sizes("predict"), ctx.nproc
    raw, _ = ctx.worker("predict", {**sizes, "save_dir": ctx.folder("predict")}, timeout=120, nproc=nproc)
    problems = [
        text
        for failed, text in [
            (raw["samples"] != sizes["samples"], f"{raw['samples']} outputs for {sizes['samples']} samples"),
            (not raw["in_order"], "the CPU outputs are not in dataset order"),
            (
                not raw["max_abs_difference"] <= PREDICT_TOLERANCE,
                f"differs from the CPU by {raw['max_abs_difference']:.3g} > {PREDICT_TOLERANCE}",
            ),
        ]
        if failed
    ]
    where = f"{raw['world_size']} process(es) on {raw['device']}" + (
        " (DDP)" if raw["world_size"] > 1 else ""
    )
    figure = (
        f"MultiGPUTrainer.predict of {raw['samples']} samples, batch {sizes['batch']}, on {where}: "
        f"{raw['samples'] / raw['seconds']:.0f} samples/s, CPU {raw['samples'] / raw['cpu_seconds']:.0f} "
        f"samples/s (x{raw['cpu_seconds'] / raw['seconds']:.1f}); max abs difference "
        f"{raw['max_abs_difference']:.3g} (tolerance {PREDICT_TOLERANCE}); CPU outputs "
        f"{'in' if raw['in_order'] else 'NOT in'} dataset order"
    )
    return judge(ctx, figure, raw, problems)


# ---------------------------------------------------------------------------- 9. speed (docs/speed.md, "Speed")
SHARES_TOLERANCE = 1e-3  # the time/ fractions of an interval sum to 1 within this


def split_at(
    scalars: dict[str, list[tuple[int, float]]], tag: str, step: int
) -> tuple[list[float], list[float]]:
    """The values of `tag` logged up to `step`, and after it (a run and its resumed continuation)."""
    pairs = sorted(scalars.get(tag, []))
    return [v for s, v in pairs if s <= step], [v for s, v in pairs if s > step]


def median_of(items: list[float]) -> float | None:
    return statistics.median(items) if items else None


@row("--compile")
def row_compile(ctx: Context) -> Verdict:
    """Trains compiled, then resumes uncompiled from its checkpoint: plain keys, and both speeds."""
    save_dir = ctx.folder("compile")
    args = [*ctx.sizes("compile"), "--multi-gpu", "none", "--save-dir", save_dir]
    ctx.cli([*args, "--compile"], timeout=300)
    first = load_checkpoint(os.path.join(save_dir, "last.pt"))
    resumed = ctx.cli([*args, "--epochs", "2", "--resume", "auto"], timeout=150).stdout
    scalars = read_scalars(os.path.join(save_dir, "tb"))
    compiled_rates, plain_rates = split_at(scalars, "train/samples_per_sec", first["global_step"])
    losses = split_at(scalars, "train/loss", first["global_step"])[0]
    raw = {
        "compiled_samples_per_sec": median_of(compiled_rates),
        "uncompiled_samples_per_sec": median_of(plain_rates),
        "losses": losses,
        "prefixed_keys": [key for key in first["model"] if "_orig_mod" in key],
    }
    problems = loss_problems(losses) + [
        text
        for failed, text in [
            (bool(raw["prefixed_keys"]), f"checkpoint keys carry _orig_mod: {raw['prefixed_keys'][:2]}"),
            (
                "resumed from" not in resumed,
                "the uncompiled run did not resume the compiled run's checkpoint",
            ),
            (not plain_rates, "the resumed run logged no steps"),
        ]
        if failed
    ]
    speed = (
        f"; compiled x{raw['compiled_samples_per_sec'] / raw['uncompiled_samples_per_sec']:.2f} (medians, "
        f"compile time included)"
        if compiled_rates and plain_rates
        else ""
    )
    figure = (
        f"compiled: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {raw['compiled_samples_per_sec']:.0f} samples/s; "
        f"resumed uncompiled from its checkpoint (plain keys) to epoch 2: "
        f"{raw['uncompiled_samples_per_sec'] or 0:.0f} samples/s{speed}"
        if losses
        else "no loss logged"
    )
    return judge(ctx, figure, raw, problems)


@row("--channels-last")
def row_channels_last(ctx: Context) -> Verdict:
    """The same training channels-last and channels-first: both learn; their speeds."""
    rates, raw, problems = {}, {}, []
    for layout, extra in (("channels-first", []), ("channels-last", ["--channels-last"])):
        figure, raw[layout], found = loss_figure(train(ctx, layout, extra, "channels_last", timeout=240)[0])
        rates[layout] = raw[layout]["samples_per_sec"]
        problems += [f"{layout}: {problem}" for problem in found]
    speed = (
        f"; channels-last x{rates['channels-last'] / rates['channels-first']:.2f}"
        if all(rates.values())
        else ""
    )
    figure = (
        f"channels-last {rates['channels-last'] or 0:.0f} samples/s, channels-first "
        f"{rates['channels-first'] or 0:.0f} samples/s{speed}; loss {raw['channels-last']['losses'][0]:.3f} -> "
        f"{raw['channels-last']['losses'][-1]:.3f}"
        if raw["channels-last"]["losses"]
        else "no loss logged"
    )
    return judge(ctx, figure, raw, problems)


AUTO_LINE = re.compile(r"^--batch-size auto: (\d+) per device")


@row("--batch-size auto")
def row_batch_size_auto(ctx: Context) -> Verdict:
    """The largest batch that fits is found, used (the plan says so) and trains within the GPU's memory."""
    scalars, stdout = train(ctx, "batch-size-auto", ["--batch-size", "auto"], "batch_auto", timeout=300)
    lines = stdout.splitlines()
    said = next((line for line in lines if line.startswith("--batch-size auto")), "")
    chosen = AUTO_LINE.match(said)
    batch = int(chosen.group(1)) if chosen else 64  # without CUDA: the default
    raw: dict[str, Any] = {
        "line": said,
        "batch": batch,
        "peak_allocated_gib": max(values(scalars, "memory/max_allocated_gb"), default=None),
    }
    problems = [
        text
        for failed, text in [
            (not said, "no '--batch-size auto' line"),
            (ctx.cuda and not chosen, f"no batch found: {said!r}"),
            (
                not any(line.startswith(f"batch {batch} per device") for line in lines),
                f"the plan does not use {batch}",
            ),
            (not values(scalars, "train/loss"), "no step trained"),
        ]
        if failed
    ]
    if not ctx.cuda:
        return judge(ctx, f"{said}; the plan uses batch {batch}", raw, problems)
    memory = raw["peak_allocated_gib"] or 0.0
    if memory > ctx.gpu_memory_gib:
        problems.append(f"peak memory {memory:.2f} GiB over the GPU's {ctx.gpu_memory_gib:.2f} GiB")
    return judge(
        ctx,
        f"{said}; trained with it: peak allocated {memory:.2f} of {ctx.gpu_memory_gib:.2f} GiB "
        f"({memory / ctx.gpu_memory_gib:.0%})",
        raw,
        problems,
    )


@row("telemetry")
def row_telemetry(ctx: Context) -> Verdict:
    """The time split, memory and FLOP rate in TensorBoard, and the end-of-run line that sums them up."""
    scalars, stdout = train_bf16(ctx)
    kinds = ("data_wait", "copy", "compute") if ctx.cuda else ("data_wait", "compute")
    shares = {kind: values(scalars, f"time/{kind}_frac") for kind in kinds}
    sums = [sum(parts) for parts in zip(*shares.values())]
    done = next((line for line in stdout.splitlines() if line.startswith("done:")), "")
    raw: dict[str, Any] = {
        "shares": shares,
        "done": done,
        "tflops_per_device": median_of(values(scalars, "perf/tflops_per_device")),
        **{tag: values(scalars, tag) for tag in scalars if tag.startswith("memory/")},
    }
    problems = [
        text
        for failed, text in [
            (not sums, "no time/ fractions logged"),
            (
                any(not 0 <= share <= 1 for parts in shares.values() for share in parts),
                "a fraction outside [0, 1]",
            ),
            (
                any(abs(total - 1) > SHARES_TOLERANCE for total in sums),
                f"fractions do not sum to 1: {sums[:3]}",
            ),
            (not raw["tflops_per_device"], "no perf/tflops_per_device"),
            ("data wait" not in done, "the end-of-run line has no data wait"),
            (ctx.cuda and not raw.get("memory/max_allocated_gb"), "no memory/max_allocated_gb"),
            (ctx.cuda and "peak memory" not in done, "the end-of-run line has no peak memory"),
            (ctx.cuda and any(raw.get("memory/ooms", [])), "out-of-memory errors during training"),
        ]
        if failed
    ]
    split = ", ".join(
        f"{kind.replace('_', ' ')} {median_of(parts) or 0:.1%}" for kind, parts in shares.items()
    )
    memory = (
        f"; peak allocated {max(raw['memory/max_allocated_gb']):.2f} GiB, reserved "
        f"{max(raw['memory/max_reserved_gb']):.2f} GiB, allocator retries "
        f"{max(raw['memory/alloc_retries']):.0f}"
        if ctx.cuda
        else ""
    )
    figure = (
        f"medians per interval: {split}{memory}; {raw['tflops_per_device'] or 0:.3g} TFLOP/s per device; "
        f"end-of-run line: {done.split('; ', 1)[-1] if '; ' in done else done}"
    )
    return judge(ctx, figure, raw, problems)


def mfu_args(ctx: Context) -> list[str]:
    """ResNet-50 at 224 px in bf16 with a batch by GPU memory, 30 steps (the small cnn, 4 steps, on the CPU)."""
    batch = throughput_batch(ctx)
    return ["--batch-size", str(batch), "--train-size", str(batch * (30 if ctx.cuda else 4))]


@row("MFU")
def row_mfu(ctx: Context) -> Verdict:
    """perf/mfu on a GPU of multigpu/monitoring/flops.py's table; on any other, none (never guessed)."""
    from multigpu.monitoring.flops import gpu_row

    scalars, stdout = train(ctx, "mfu", mfu_args(ctx), "mfu", timeout=240)
    steps = sorted(step for step, _ in scalars.get("perf/tflops_per_device", []))
    later = [value for step, value in sorted(scalars.get("perf/mfu", [])) if step > steps[0]] if steps else []
    tflops = median_of(
        [value for step, value in sorted(scalars.get("perf/tflops_per_device", [])) if step > steps[0]]
        if steps
        else []
    )
    name = torch_device_name() if ctx.cuda else None
    raw = {"gpu": name, "row": gpu_row(name) if name else None, "mfu": later, "tflops_per_device": tflops}
    if tflops is None:
        return Verdict(FAIL, "no perf/tflops_per_device logged after the first interval", raw)
    if not ctx.cuda:
        return judge(
            ctx,
            f"{tflops:.3g} TFLOP/s per device (FLOPs counted once at start); no perf/mfu on the CPU",
            raw,
            ["perf/mfu logged on the CPU"] if later else [],
        )
    if raw["row"] is None:
        return Verdict(
            NOT_APPLICABLE,
            f"{name} is not in multigpu/monitoring/flops.py's table: no MFU (never guessed); "
            f"{tflops:.3g} TFLOP/s per device",
            raw,
        )
    mfu = median_of(later)
    problems = (
        ["no perf/mfu logged"] if mfu is None else ([] if 0 < mfu <= 1 else [f"MFU {mfu:.3f} outside (0, 1]"])
    )
    done = next((line for line in stdout.splitlines() if line.startswith("done:")), "")
    return judge(
        ctx,
        f"resnet50 224px bf16: MFU {mfu or 0:.1%} (median after the first interval), "
        f"{tflops:.1f} TFLOP/s per device against {raw['row']}'s bf16 peak; "
        f"{done.split('; ', 1)[-1] if '; ' in done else done}",
        raw,
        problems,
    )


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


@row("scaling")
def row_scaling(ctx: Context) -> Verdict:
    """benchmarks/scaling.py on the devices present: samples/s, speed-up, efficiency and trainer/raw per set."""
    output = ctx.scratch / "scaling" / "scaling.md"
    ctx.launch("benchmarks/scaling.py", [*ctx.sizes("scaling"), "--output", str(output)], None, timeout=360)
    rows = json.loads(output.with_suffix(".json").read_text())
    parts = [
        f"{row['setup']}: {row['trainer_samples_per_sec']:.0f} samples/s (raw {row['raw_samples_per_sec']:.0f}, "
        f"trainer/raw {row['ratio']:.3f}), x{row['trainer_speedup']:.2f}, efficiency "
        f"{row['trainer_efficiency']:.0%}, first step {row['trainer_startup_s']:.1f} s "
        f"(raw {row['raw_startup_s']:.1f} s)"
        for row in rows
    ]
    problems = [
        f"{row['setup']}: trainer/raw {row['ratio']:.3f} < {TARGET_RATIO}"
        for row in rows
        if row["ratio"] < TARGET_RATIO
    ]
    return judge(ctx, "; ".join(parts), {"rows": rows}, problems if ctx.cuda else [])  # CPU rates: no verdict


# ---------------------------------------------------------------------------- 10. issue 43: speed to the limit
def after_first(scalars: dict[str, list[tuple[int, float]]], tag: str, skip: int = 1) -> list[float]:
    """The values of `tag` after its first `skip` logged intervals (start-up, compiling, --autotune's trials)."""
    return [value for _, value in sorted(scalars.get(tag, []))[skip:]]


def weights_equal(first: str, second: str) -> bool:
    import torch

    a, b = load_last(first)["model"], load_last(second)["model"]
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@row("data on device")
def row_data_on_device(ctx: Context) -> Verdict:
    """The same run with the training set on the device and through the loader: samples/s and data wait of
    each; on the CPU (deterministic kernels) the final weights are identical."""
    runs: dict[str, Any] = {}
    for mode in ("off", "on"):
        scalars, stdout = train(
            ctx, f"data-{mode}", ["--data-on-device", mode], "data_on_device", timeout=240
        )
        runs[mode] = {
            "samples_per_sec": median_of(after_first(scalars, "train/samples_per_sec")),
            "data_wait": median_of(after_first(scalars, "time/data_wait_frac")),
            "line": next((line for line in stdout.splitlines() if line.startswith("data:")), ""),
        }
    same = weights_equal(str(ctx.scratch / "data-off"), str(ctx.scratch / "data-on"))
    on, off = runs["on"], runs["off"]
    problems = [
        text
        for failed, text in [
            (
                not on["line"].startswith("data: the training set on the device"),
                f"not on the device: {on['line']!r}",
            ),
            (
                None in (on["samples_per_sec"], off["samples_per_sec"]),
                "no samples/s logged after the first interval",
            ),
            (not ctx.cuda and not same, "the final weights differ from the loader's"),
            (
                ctx.cuda and (on["data_wait"] or 0) >= DATA_WAIT_LIMIT,
                f"data wait {on['data_wait'] or 0:.1%} on the device",
            ),
            (
                ctx.cuda
                and None not in (on["samples_per_sec"], off["samples_per_sec"])
                and on["samples_per_sec"] < TARGET_RATIO * off["samples_per_sec"],
                "slower on the device than the loader",
            ),
        ]
        if failed
    ]
    figure = (
        f"on the device {on['samples_per_sec'] or 0:.0f} samples/s (data wait {on['data_wait'] or 0:.1%}), "
        f"loader {off['samples_per_sec'] or 0:.0f} samples/s (data wait {off['data_wait'] or 0:.1%}), "
        f"x{(on['samples_per_sec'] or 0) / (off['samples_per_sec'] or 1):.2f}; final weights "
        f"{'identical' if same else 'not identical (GPU kernels need not be deterministic)'}"
    )
    return judge(ctx, figure, {**runs, "identical": same}, problems)


@row("ResNet-50 --autotune")
def row_resnet50_autotune(ctx: Context) -> Verdict:
    """ResNet-50 at 224 px with --autotune --amp auto, --batch-size auto and synthetic data on the device:
    samples/s after the trials against RESNET50_TARGET, data wait under DATA_WAIT_LIMIT."""
    scalars, stdout = train(
        ctx,
        "resnet50-autotune",
        ["--autotune", "--amp", "auto", "--data-on-device", "on"],
        "resnet50",
        timeout=300,
    )
    lines = stdout.splitlines()
    tuned = next((line for line in lines if line.startswith("--autotune:")), "")
    at = re.search(r"steps \d+-(\d+) measured", tuned)
    after = int(at.group(1)) if at else 0
    rates = [value for step, value in sorted(scalars.get("train/samples_per_sec", [])) if step > after + 10]
    waits = [value for step, value in sorted(scalars.get("time/data_wait_frac", [])) if step > after + 10]
    rate, wait = median_of(rates), median_of(waits)
    batch = next((line.split()[1] for line in lines if line.startswith("batch ")), "?")
    raw = {"samples_per_sec": rates, "data_wait": waits, "autotune": tuned, "batch": batch}
    problems = [
        text
        for failed, text in [
            (rate is None, "no samples/s logged after the trials"),
            (
                not any(line.startswith("data: the training set on the device") for line in lines),
                "data not on the device",
            ),
            (
                ctx.cuda and (rate or 0) < RESNET50_TARGET,
                f"{rate or 0:.0f} samples/s < {RESNET50_TARGET:.0f}",
            ),
            (ctx.cuda and (wait or 0) >= DATA_WAIT_LIMIT, f"data wait {wait or 0:.1%}"),
        ]
        if failed
    ]
    figure = (
        f"{rate or 0:.0f} samples/s at batch {batch} (median after --autotune's trials; target "
        f"{RESNET50_TARGET:.0f}), data wait {wait or 0:.1%}; {tuned}"
    )
    return judge(ctx, figure, raw, problems)


def text_file(ctx: Context, characters: int) -> str:
    """A plain text file of words for --dataset text, the same on every run."""
    import random

    words, draw = (
        "the quick brown fox jumps over a lazy dog while seven small cats sleep".split(),
        random.Random(0),
    )
    path = ctx.scratch / f"text-{characters}.txt"
    if not path.exists():
        path.write_text(" ".join(draw.choice(words) for _ in range(characters // 4))[:characters])
    return str(path)


def gpt_run(ctx: Context, name: str, extra: Sequence[str]) -> dict[str, Any]:
    """--model gpt (GPT-2 small's shape on GPUs) on --dataset text, bf16, data on the device: tokens/s, the
    trainer's MFU and TFLOP/s, and 6N + attention's MFU from the same tokens/s. The MFU row's bf16 run is
    float8's baseline too, so a run with the same flags is made once per check (it compiles for a minute)."""
    if tuple(extra) not in ctx.gpt_runs:
        ctx.gpt_runs[tuple(extra)] = measure_gpt(ctx, name, extra)
    return ctx.gpt_runs[tuple(extra)]


def measure_gpt(ctx: Context, name: str, extra: Sequence[str]) -> dict[str, Any]:
    """One gpt_run, measured."""
    from multigpu.monitoring.flops import peak_flops

    sizes = ctx.sizes("gpt")
    args = [
        "--dataset",
        "text",
        "--data-file",
        text_file(ctx, sizes["characters"]),
        "--model",
        "gpt",
        "--amp",
        "bf16",
        "--data-on-device",
        "on",
        *sizes["args"],
        *extra,
    ]
    if not ctx.cuda:
        args = [arg for arg in args if arg != "--compile"]  # g++ compiles for minutes on the CPU
    save_dir = ctx.folder(name)
    stdout = ctx.cli([*args, "--multi-gpu", "none", "--save-dir", save_dir], timeout=300).stdout
    scalars = read_scalars(os.path.join(save_dir, "tb"))
    value = dict(zip(args, args[1:]))  # each flag and what follows it
    layers, width, context = int(value["--n-layer"]), int(value["--n-embd"]), int(value["--block-size"])
    said = re.search(r"model gpt \(([\d,]+) parameters\)", stdout)
    params = (
        int(said.group(1).replace(",", "")) - context * width if said else 0
    )  # without the position embedding
    tokens = median_of([rate * context for rate in after_first(scalars, "train/samples_per_sec")])
    name_ = torch_device_name() if ctx.cuda else ""
    peak = peak_flops(name_, "bf16") if ctx.cuda else None
    per_token = transformer_flops_per_token(params, layers, width, context)
    return {
        "params": params,
        "tokens_per_sec": tokens,
        "mfu": median_of(after_first(scalars, "perf/mfu")),
        "tflops": median_of(after_first(scalars, "perf/tflops_per_device")),
        "peak": peak,
        "formula_tflops": (tokens or 0) * per_token / 1e12,
        "formula_mfu": (tokens or 0) * per_token / peak if peak else None,
    }


@row("GPT-2 small MFU")
def row_gpt_mfu(ctx: Context) -> Verdict:
    """--model gpt at GPT-2 small's size (12 x 768, 12 heads, context 1024) in bf16 with SDPA and --compile:
    MFU as the trainer reports it against GPT_MFU_TARGET, cross-checked against 6N + attention from tokens/s."""
    run = gpt_run(ctx, "gpt-bf16", [])
    measured, formula = (
        (run["mfu"], run["formula_mfu"]) if ctx.cuda else (run["tflops"], run["formula_tflops"])
    )
    agree = bool(measured and formula) and abs(measured - formula) <= FORMULA_TOLERANCE * formula
    problems = [
        text
        for failed, text in [
            (not run["tokens_per_sec"], "no tokens/s logged after the first interval"),
            (
                not agree,
                f"the trainer's {measured} and 6N + attention's {formula} differ by more than "
                f"{FORMULA_TOLERANCE:.0%}",
            ),
            (
                ctx.cuda and (run["mfu"] or 0) < GPT_MFU_TARGET,
                f"MFU {run['mfu'] or 0:.1%} < {GPT_MFU_TARGET:.0%}",
            ),
        ]
        if failed
    ]
    unit = (
        f"MFU {run['mfu'] or 0:.1%} (trainer), {run['formula_mfu'] or 0:.1%} (6N + attention)"
        if ctx.cuda
        else f"{run['tflops'] or 0:.3g} TFLOP/s (trainer), {run['formula_tflops']:.3g} (6N + attention)"
    )
    figure = f"{run['params']:,} parameters, {run['tokens_per_sec'] or 0:,.0f} tokens/s; {unit}"
    return judge(ctx, figure, run, problems)


@row("float8")
def row_float8(ctx: Context) -> Verdict:
    """The GPT of the row above with --float8 tensorwise against bf16 where the GPU has float8 (compute
    capability 8.9); elsewhere --float8 must be refused in one line, exit 2."""
    import torch

    capable = ctx.cuda and torch.cuda.get_device_capability(0) >= (8, 9)
    if not capable:
        try:
            train(ctx, "float8-refused", ["--float8", "tensorwise"], "data_on_device", timeout=120)
        except RowError as refusal:
            said = str(refusal)
            if said.startswith("exit 2: error: --float8 tensorwise needs a GPU of compute capability 8.9"):
                where = "the CPU" if not ctx.cuda else torch.cuda.get_device_name(0)
                verdict = NO_CUDA if not ctx.cuda else NOT_APPLICABLE
                return Verdict(
                    verdict, f"{where}: refused in one line, exit 2 ({said[8:]})", {"refusal": said}
                )
            return Verdict(FAIL, f"refused, but not as it should be: {said}", {"refusal": said})
        return Verdict(FAIL, "--float8 trained on a device without float8", {})
    runs = {
        "bf16": gpt_run(ctx, "float8-bf16", []),
        "float8": gpt_run(ctx, "float8-tensorwise", ["--float8", "tensorwise"]),
    }
    bf16, fp8 = runs["bf16"]["tokens_per_sec"] or 0, runs["float8"]["tokens_per_sec"] or 0
    problems = [] if fp8 > bf16 > 0 else [f"float8 {fp8:,.0f} tokens/s not above bf16's {bf16:,.0f}"]
    return judge(
        ctx,
        f"float8 tensorwise {fp8:,.0f} tokens/s, bf16 {bf16:,.0f}: x{fp8 / (bf16 or 1):.2f}",
        runs,
        problems,
    )


# ---------------------------------------------------------------------------- the table
def check(ctx: Context, rows: Sequence[tuple[str, Callable[[Context], Verdict]]], jobs: int = 1) -> list[Row]:
    """Run each row (`jobs` of them side by side, a dry run's option); an exception is that row's FAIL with its
    one-line error, and the next row runs. The rows come back in the order given."""
    if jobs == 1:  # in this thread: Ctrl-C stops the check at once (a pool would wait for the running row)
        return [run_row(ctx, *item) for item in rows]
    pool = ThreadPoolExecutor(max_workers=jobs)  # threads: a row mostly waits for its subprocesses
    try:
        return list(pool.map(lambda item: run_row(ctx, *item), rows))
    finally:
        pool.shutdown(cancel_futures=True)  # on Ctrl-C the rows not started are dropped


def run_row(ctx: Context, name: str, function: Callable[[Context], Verdict]) -> Row:
    started = time.monotonic()
    try:
        verdict = function(ctx)
    except RowError as error:
        verdict = Verdict(FAIL, str(error))
    except Exception as error:  # noqa: BLE001  (any bug in a check is that check's FAIL)
        verdict = Verdict(FAIL, f"{type(error).__name__}: {last_line(str(error)) or 'no message'}")
    result = Row(name, verdict.status, verdict.figure, verdict.raw, time.monotonic() - started)
    sys.stderr.write(
        f"{name}: {verdict.status} ({result.seconds:.0f}s)\n"
    )  # one write: rows may end together
    sys.stderr.flush()
    return result


def exit_status(rows: Sequence[Row]) -> int:
    return 1 if any(row.status == FAIL for row in rows) else 0


def markdown(title: str, rows: Sequence[Row]) -> str:
    lines = [title, "", "| check | status | figures | s |", "|---|---|---|---|"]
    for item in rows:
        figure = item.figure.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {item.name} | {item.status} | {figure} | {item.seconds:.0f} |")
    return "\n".join(lines) + "\n"


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line and exit status 2, no usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"gpu_check: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every row's code path on the CPU with tiny sizes (hides any GPU)",
    )
    parser.add_argument(
        "--output",
        default="gpu_check.md",
        help="where the Markdown table goes; the raw figures go beside it as .json",
    )
    parser.add_argument("--only", help=f"comma-separated rows to run, of: {', '.join(row_names())}")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole check (default 780 on GPUs, 600 in a dry run); rows left "
        "without time FAIL and say so",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="rows run side by side (--cpu-dry-run only: on GPUs each row has the GPUs to itself)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and not args.cpu_dry_run):
        parser.error(
            f"--jobs {args.jobs}: give 1 or more, and more than 1 only with --cpu-dry-run (on GPUs the "
            f"rows time themselves, so they run one at a time)"
        )
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget {args.budget:g}: give a positive number of seconds")
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(row_names()))
        if unknown:
            parser.error(f"--only: unknown row(s) {', '.join(unknown)}; rows are: {', '.join(row_names())}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = (
            ""  # before torch looks: the dry run takes the CPU path everywhere
        )
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_dry_run:
        print(
            f"gpu_check: no CUDA device visible (torch {torch.__version__}), nothing to check; "
            f"--cpu-dry-run runs every check's code path on the CPU",
            flush=True,
        )
        return 0
    gpus = torch.cuda.device_count() if cuda else 0
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 0.0
    mode = "dry" if args.cpu_dry_run else "gpu"
    selected = [(name, fn) for name, fn in ROWS if not args.only or name in args.only.split(",")]
    started, scratch = time.monotonic(), Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        ctx = Context(
            args.cpu_dry_run, cuda, gpus, memory, scratch, started + (args.budget or BUDGET_S[mode])
        )
        rows = check(ctx, selected, args.jobs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.monotonic() - started
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = (
        "CPU dry run (tiny sizes; no GPU figures)"
        if args.cpu_dry_run
        else f"{gpus} x {torch.cuda.get_device_name(0)}"
    )
    table = markdown(f"GPU check, {date}: {where}, torch {torch.__version__}, {seconds:.0f} s in all", rows)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(table)
    report = {
        "date": date,
        "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
        "seconds": seconds,
        "rows": [asdict(item) for item in rows],
    }
    output.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(table, end="", flush=True)
    print(f"written: {output} and {output.with_suffix('.json')}", file=sys.stderr)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
