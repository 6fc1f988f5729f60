"""Every bad input: one line on stderr, exit status 2, no traceback, and nothing already saved touched.

Each case runs with --save-dir holding a real run's last.pt and best.pt and
checks afterwards that every file there is byte-identical. Most cases run the
real entry point in this process (`main_multi_gpu.main(argv)`); where a process
boundary matters (torchrun's workers, a file-size limit) they run as
subprocesses. The Python API's cases check the exception type instead. Cases
marked "needs trainer wiring" fail until the trainer uses the checks they need.
Groups: the command line's values, names checked before the first step, data
that would hang or exhaust the machine, a file that fails mid-epoch, paths this
user may not use, and abbreviated flags in every parser of the project.
The launcher's own bad input is tested in test_launch_multi_gpu.py.
"""

from __future__ import annotations

import importlib
import math
import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import main_multi_gpu
import predict_multi_gpu
from conftest import (
    REPO,
    RUN_TIMEOUT,
    SHARED_DATA,
    assert_one_line,
    assert_untouched,
    blobs,
    busy_cpus,
    cli_command,
    cli_env,
    config_for,
    contents,
    file_size_limit,
    hold_save_dir,
    image_folder,
    permissions_apply,
    run_as_torchrun_workers,
    run_cli_ranks,
    run_on_small_file_system,
    tiny_model,
    tiny_text,
    torchruns_store,
)
from multigpu.config import TrainConfig
from multigpu.data.sampler import ResumableDistributedSampler
from multigpu.errors import UsageError
from multigpu.launch import launch_rules
from multigpu.models import build_model
from multigpu.sweep import cli as sweep_cli
from train_multi_gpu import MultiGPUTrainer

# Small enough that a case which wrongly trains still ends in about a second.
BASE = [
    "--train-size",
    "64",
    "--val-size",
    "32",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--no-progress",
    "--dist-timeout",
    "60",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save-dir of one real small run: last.pt, best.pt and its TensorBoard folder."""
    save_dir = tmp_path_factory.mktemp("prepared") / "ckpt"
    assert main_multi_gpu.main([*BASE, "--save-dir", str(save_dir)]) == 0
    assert {"last.pt", "best.pt"} <= {path.name for path in save_dir.iterdir()}
    return save_dir


@pytest.fixture
def save_dir(prepared: Path, tmp_path: Path) -> Path:
    """A copy of the prepared save-dir, for one case."""
    shutil.copytree(prepared, tmp_path / "ckpt")
    return tmp_path / "ckpt"


# ---------------------------------------------------------------- files the cases need
def text_file(tmp_path: Path) -> str:
    (tmp_path / "notes.txt").write_text("epoch 3: val acc 0.97\n")
    return str(tmp_path / "notes.txt")


def remove(*paths: Path) -> None:
    for path in paths:
        path.unlink()


def imagefolder(
    tmp_path: Path, classes: dict, spoil: Callable[[Path], object] = lambda root: None
) -> list[str]:
    spoil(image_folder(tmp_path / "images", classes))
    return ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "images"), "--image-shape", "3,8,8"]


def text_data(tmp_path: Path, content: bytes | None = None, characters: int = 6000) -> list[str]:
    """--dataset text reading a file of `content` (None: a good text of `characters` characters)."""
    path = tmp_path / "corpus.txt"
    if content is None:
        tiny_text(path, characters)
    else:
        path.write_bytes(content)
    return ["--dataset", "text", "--data-file", str(path), "--block-size", "16", "--n-embd", "16"]


def empty_file(tmp_path: Path) -> str:
    (tmp_path / "empty.pt").write_bytes(b"")
    return str(tmp_path / "empty.pt")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def mnist_downloads(tmp_path: Path, truncated: str) -> list[str]:
    """A copy of the real MNIST .gz downloads with one of them cut short (its checksum then fails)."""
    raw = SHARED_DATA / "MNIST" / "raw"
    if not (raw / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST not available at {raw}")
    shutil.copytree(raw, tmp_path / "mnist" / "MNIST" / "raw")
    truncate(tmp_path / "mnist" / "MNIST" / "raw" / truncated)
    return ["--dataset", "mnist", "--data-dir", str(tmp_path / "mnist")]


def mnist_extracted(tmp_path: Path, truncated: str | None) -> list[str]:
    """A small extracted MNIST raw folder (well-formed IDX files, 20 + 10 blank images), one file cut short."""
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", 20), ("t10k", 10)):
        for kind, dims in (("images-idx3", (count, 28, 28)), ("labels-idx1", (count,))):
            header = struct.pack(f">4B{len(dims)}I", 0, 0, 0x08, len(dims), *dims)  # IDX: unsigned bytes
            (raw / f"{split}-{kind}-ubyte").write_bytes(header + bytes(math.prod(dims)))
    if truncated:
        truncate(raw / truncated)
    return ["--dataset", "mnist", "--data-dir", str(tmp_path / "mnist")]


def empty_folder(tmp_path: Path) -> str:
    (tmp_path / "notes").mkdir()
    return str(tmp_path / "notes")


def half_sharded(tmp_path: Path) -> str:
    """A sharded checkpoint folder whose save never finished: no metadata, no state file."""
    (tmp_path / "last").mkdir()
    return str(tmp_path / "last")


def named_pipe(tmp_path: Path) -> str:
    os.mkfifo(tmp_path / "pipe")
    return str(tmp_path / "pipe")


def at_epoch(path: Path, epoch: int) -> list[str]:
    """Rewrite a checkpoint as if its run had trained `epoch` epochs."""
    state = torch.load(path, weights_only=True)
    torch.save({**state, "epoch": epoch}, path)
    return []


def unreadable_checkpoints_only(save_dir: Path) -> list[str]:
    truncate(save_dir / "last.pt")
    (save_dir / "step-000000004.pt").write_text("not a checkpoint")
    return []


def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send every HTTP(S) request to a local port that refuses connections: a machine without a network."""
    with socket.socket() as closed:  # bound and closed: nothing listens there
        closed.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(
        urllib.request, "_opener", None
    )  # urlopen's cached opener read the proxies when built


# ---------------------------------------------------------------- the command line, in this process
@dataclass
class Case:
    args: list[str]
    expected: str  # in the one error line
    files: Callable[[Path, Path], list[str]] | None = None  # (tmp_path, save_dir) -> more arguments
    marks: list = field(default_factory=list)
    owned: bool = False  # another run holds the save-dir meanwhile
    env: dict = field(default_factory=dict)  # environment variables for the run, e.g. what torchrun sets
    offline: bool = False  # every connection refused


def finite(flag: str, value: str) -> Case:
    return Case([flag, value], f"{flag} must be a finite number")


CLI = {
    # numbers: every numeric flag finite and in range (multigpu/config.py RANGES)
    "lr inf": finite("--lr", "inf"),
    "lr nan": finite("--lr", "nan"),
    "lr overflowing to inf": finite("--lr", "1e999"),
    "lr negative": Case(["--lr", "-0.1"], "--lr must not be negative, got -0.1"),
    "momentum nan": finite("--momentum", "nan"),
    "momentum above 1": Case(["--momentum", "1.5"], "--momentum must be between 0 and 1, got 1.5"),
    "outer-momentum above 1": Case(
        ["--outer-momentum", "1.5"], "--outer-momentum must be between 0 and 1, got 1.5"
    ),
    "sync-every zero": Case(["--sync-every", "0"], "--sync-every must be at least 1, got 0"),
    "semi-sync without replica groups": Case(
        ["--semi-sync", "diloco", "--sync-every", "8"],
        "--semi-sync diloco syncs the replica groups of --fault-tolerance: add --fault-tolerance",
    ),
    "lr-gamma negative": Case(["--lr-gamma", "-1"], "--lr-gamma must be positive, got -1.0"),
    "lr-gamma nan": finite("--lr-gamma", "nan"),
    "lr-gamma zero": Case(["--lr-gamma", "0"], "--lr-gamma must be positive"),
    "clip-grad-norm nan": finite("--clip-grad-norm", "nan"),
    "clip-grad-norm negative": Case(["--clip-grad-norm", "-1"], "--clip-grad-norm must not be negative"),
    "warmup-epochs nan": finite("--warmup-epochs", "nan"),
    "warmup-epochs inf": finite("--warmup-epochs", "inf"),
    "lr-step-epochs nan": finite("--lr-step-epochs", "nan"),
    "lr-step-epochs zero": Case(["--lr-step-epochs", "0"], "--lr-step-epochs must be positive"),
    "weight-decay nan": finite("--weight-decay", "nan"),
    "weight-decay negative": Case(["--weight-decay", "-0.1"], "--weight-decay must not be negative"),
    "seed too large": Case(["--seed", "99999999999999999999999"], "--seed must be between 0 and 2147483647"),
    "seed negative": Case(["--seed", "-1"], "--seed must be between 0 and 2147483647, got -1"),
    "dist-timeout inf": finite("--dist-timeout", "inf"),
    "dist-timeout nan": finite("--dist-timeout", "nan"),
    "dist-timeout zero": Case(
        ["--dist-timeout", "0"], "--dist-timeout must be between 1 and 1000000000, got 0.0"
    ),
    "dist-timeout below a second": Case(["--dist-timeout", "1e-9"], "--dist-timeout must be between 1 and "),
    "hang-timeout not below dist-timeout": Case(
        ["--hang-timeout", "60"], "--hang-timeout 60 must be below --dist-timeout 60"
    ),
    "hang-timeout negative": Case(["--hang-timeout", "-1"], "--hang-timeout must not be negative"),
    "epochs zero": Case(["--epochs", "0"], "--epochs must be at least 1, got 0"),
    "epochs fractional": Case(["--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
    "grad-accum-steps zero": Case(["--grad-accum-steps", "0"], "--grad-accum-steps must be at least 1"),
    "keep-last zero": Case(["--keep-last", "0"], "--keep-last must be at least 1"),
    "num-workers negative": Case(["--num-workers", "-1"], "--num-workers must not be negative"),
    "num-workers beyond the cores (a hang)": Case(
        ["--num-workers", "100000"], "--num-workers 100000 is more than 4 per CPU core"
    ),
    "image-shape beyond memory (an OOM kill)": Case(
        ["--image-shape", "3,100000,100000"],
        "--image-shape 3,100000,100000: one batch of 16 such images takes 1,920.0 GB, more than the ",
    ),
    "save-every-steps negative": Case(
        ["--save-every-steps", "-5"], "--save-every-steps must not be negative"
    ),
    "max-steps negative": Case(["--max-steps", "-1"], "--max-steps must not be negative, got -1"),
    "max-steps fractional": Case(["--max-steps", "2.5"], "argument --max-steps: invalid int value: '2.5'"),
    "dataset hf without files": Case(["--dataset", "hf"], "--dataset hf needs --data-files GLOB"),
    "streaming without dataset hf": Case(
        ["--streaming"],
        "--streaming is for --dataset hf, and this run's data set is synthetic; add --dataset hf",
    ),
    "data-files matching nothing": Case(
        ["--dataset", "hf", "--data-files", "no-such-dir/*.parquet"],
        "--data-files 'no-such-dir/*.parquet' matches no file",
    ),
    "fsdp-blocks unknown": Case(
        ["--multi-gpu", "fsdp", "--fsdp-blocks", "Nope"],
        "--fsdp-blocks Nope: the model has no module of class Nope; name classes it has, e.g. ",
    ),
    "fsdp with batch-size auto": Case(
        ["--multi-gpu", "fsdp", "--batch-size", "auto"],
        "--batch-size auto measures the whole model on one GPU, not the shards fsdp trains",
    ),
    "hybrid mesh in one process": Case(
        ["--multi-gpu", "fsdp", "--dp-replicate", "2", "--dp-shard", "2"],
        "--dp-replicate 2 --dp-shard 2 needs 4 processes, and this run is one process: "
        "start it with torchrun --nproc_per_node=4",
    ),
    "mesh that is not torchrun's 4 processes": Case(
        ["--multi-gpu", "fsdp", "--dp-replicate", "2", "--dp-shard", "3"],
        "--dp-replicate 2 x --dp-shard 3 = 6 "
        "processes, but this run has 4 processes: make replicate x shard = 4, or give --dp-shard -1 for the processes "
        "left",
        env=dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4"),
    ),
    "replicas that do not divide the processes": Case(
        ["--multi-gpu", "fsdp", "--dp-replicate", "3"],
        "--dp-replicate 3 does not divide this run's 4 processes into equal groups: give one of 1, 2, 4",
        env=dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4"),
    ),
    "dp-shard zero": Case(
        ["--dp-shard", "0"],
        "--dp-shard must be at least 1, or -1 for the processes left after --dp-replicate; got 0",
    ),
    "ema-decay 1": Case(
        ["--ema-decay", "1"], "--ema-decay 1 would keep the starting weights forever: give a value below 1"
    ),
    "ema-decay above 1": Case(["--ema-decay", "1.5"], "--ema-decay must be between 0 and 1, got 1.5"),
    "early-stop-patience negative": Case(
        ["--early-stop-patience", "-1"], "--early-stop-patience must not be negative"
    ),
    "lr-base-batch zero": Case(["--lr-base-batch", "0"], "--lr-base-batch must be at least 1"),
    "log-every zero": Case(["--log-every", "0"], "--log-every must be at least 1"),
    "train-size zero": Case(["--train-size", "0"], "--train-size must be at least 1"),
    "num-classes zero": Case(["--num-classes", "0"], "--num-classes must be at least 1"),
    "image-shape zero channels": Case(["--image-shape", "0,28,28"], "--image-shape must be C,H,W"),
    # names, checked before the first step
    "monitor that is not a metric": Case(
        ["--monitor", "val_bogus"],
        "--monitor val_bogus is not a validation metric of this run; it has val_loss, val_acc",
    ),
    "an abbreviated flag": Case(["--ep", "2"], "unrecognized arguments: --ep 2"),
    # model and devices
    "image too small for the cnn": Case(
        ["--image-shape", "3,1,1", "--model", "cnn"],
        "--model cnn needs images of at least 4x4 pixels, got 1x1",
    ),
    "ddp without torchrun": Case(["--multi-gpu", "ddp"], "started by torchrun: torchrun --nproc_per_node="),
    "none as one of torchrun's 2 workers": Case(
        ["--multi-gpu", "none"],
        "--multi-gpu none trains in one process, but torchrun started 2",
        env=dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2"),
    ),
    # checkpoints and directories
    "resume a text file": Case(
        [], "refused: not a checkpoint (it holds text", lambda tmp, ckpt: ["--resume", text_file(tmp)]
    ),
    "resume an empty file": Case(
        [], "refused: not a checkpoint (the file is empty)", lambda tmp, ckpt: ["--resume", empty_file(tmp)]
    ),
    "resume a missing file": Case(
        ["--resume", "/nonexistent/last.pt"], "checkpoint /nonexistent/last.pt does not exist"
    ),
    "save-dir is a file": Case([], "is not writable", lambda tmp, ckpt: ["--save-dir", text_file(tmp)]),
    "log-dir is unwritable": Case([], "--log-dir", lambda tmp, ckpt: ["--log-dir", text_file(tmp) + "/tb"]),
    "save-dir owned by a running run": Case(
        ["--resume", "auto"], "is in use by another run (pid ", owned=True
    ),
    "fresh run over an explicit save-dir's checkpoints": Case([], "--overwrite", None),
    "resume auto where no checkpoint loads": Case(
        ["--resume", "auto"], "last.pt", lambda tmp, ckpt: unreadable_checkpoints_only(ckpt)
    ),
    "resume a named pipe (reading it would wait forever)": Case(
        [],
        "refused: not a checkpoint (a named pipe (FIFO), not a regular file)",
        lambda tmp, ckpt: ["--resume", named_pipe(tmp)],
    ),
    "resume a folder without checkpoints": Case(
        [],
        "is a folder without checkpoints (last.pt, step-*.pt)",
        lambda tmp, ckpt: ["--resume", empty_folder(tmp)],
    ),
    "resume a half-written sharded checkpoint": Case(
        [],
        "refused: an incomplete sharded checkpoint (no .metadata or trainer_state.pt: its save did not finish)",
        lambda tmp, ckpt: ["--resume", half_sharded(tmp)],
    ),
    "async checkpoint of one file": Case(
        ["--async-checkpoint"],
        "--async-checkpoint writes sharded checkpoints in "
        "the background, and this run writes one file from rank 0",
    ),
    "resume auto and overwrite at once": Case(
        ["--resume", "auto", "--overwrite"],
        "--resume auto continues the run in --save-dir and --overwrite starts "
        "afresh over it: give one of them",
    ),
    "resume a checkpoint of the save-dir and overwrite it": Case(
        ["--overwrite"],
        "continues the run in --save-dir",
        lambda tmp, ckpt: ["--resume", str(ckpt / "last.pt")],
    ),
    "epochs below the checkpoint's": Case(
        ["--resume", "auto", "--epochs", "1"],
        "has trained 2 epoch(s), already past --epochs 1 (the total, not epochs "
        "more): nothing to train; pass --epochs 3 or more",
        lambda tmp, ckpt: at_epoch(ckpt / "last.pt", 2),
    ),
    "max-steps the checkpoint already reached": Case(
        ["--resume", "auto", "--max-steps", "1"],
        "optimizer steps, already at --max-steps 1 (the total, not steps "
        "more): nothing to train; pass a larger --max-steps to train on",
    ),
    # data sets
    "imagefolder without class folders": Case(
        [], "Couldn't find any class folder in", lambda tmp, ckpt: imagefolder(tmp, {"train": [], "val": []})
    ),
    "imagefolder with a text file named .jpg": Case(
        [],
        "cat/notes.jpg is not a readable image (not an image format PIL can read); remove or replace it",
        lambda tmp, ckpt: imagefolder(
            tmp,
            {"train": ["cat", "dog"], "val": ["cat", "dog"]},
            lambda root: (root / "train" / "cat" / "notes.jpg").write_text("hello"),
        ),
    ),
    "imagefolder with a val class train lacks": Case(
        [],
        "has class folder(s) fox that",
        lambda tmp, ckpt: imagefolder(tmp, {"train": ["cat", "dog"], "val": ["cat", "dog", "fox"]}),
    ),
    "imagefolder with a class folder without images": Case(
        [],
        "Found no valid file for the classes dog",
        lambda tmp, ckpt: imagefolder(
            tmp,
            {"train": ["cat", "dog"], "val": ["cat"]},
            lambda root: remove(root / "train" / "dog" / "0.png", root / "train" / "dog" / "1.png"),
        ),
    ),
    "imagefolder with a symlink loop": Case(
        [],
        "train/cat/again is a symbolic link to ",
        lambda tmp, ckpt: imagefolder(
            tmp,
            {"train": ["cat", "dog"], "val": ["cat", "dog"]},
            lambda root: (root / "train" / "cat" / "again").symlink_to(root / "train"),
        ),
    ),
    "imagefolder without val/": Case(
        [], "needs val/ inside --data-dir", lambda tmp, ckpt: imagefolder(tmp, {"train": ["cat"]})
    ),
    "mnist with a truncated .gz": Case(
        [],
        "train-images-idx3-ubyte.gz is corrupt (checksum mismatch: a truncated or damaged download); "
        "pass --download",
        lambda tmp, ckpt: mnist_downloads(tmp, "train-images-idx3-ubyte.gz"),
    ),
    "mnist with a truncated extracted file": Case(
        [],
        "t10k-labels-idx1-ubyte is corrupt (9 bytes where its header needs 18: truncated)",
        lambda tmp, ckpt: mnist_extracted(tmp, "t10k-labels-idx1-ubyte"),
    ),
    "text file missing": Case(
        ["--dataset", "text", "--data-file", "/nonexistent/tiny.txt"],
        "--data-file /nonexistent/tiny.txt: no such file; give a UTF-8 plain text file",
    ),
    "text file empty": Case(
        [], "is empty; give a file with some text", lambda tmp, ckpt: text_data(tmp, b"")
    ),
    "text file that is binary (NUL bytes)": Case(
        [],
        "holds NUL bytes, so it is binary, not text",
        lambda tmp, ckpt: text_data(tmp, b"abc\x00\x01\x02" * 200),
    ),
    "text file that is not UTF-8": Case(
        [],
        "is not UTF-8 text (byte 0 is not)",
        lambda tmp, ckpt: text_data(tmp, b"\x89PNG\r\n\x1a\n" + bytes(range(256))),
    ),
    "text shorter than two windows a split": Case(
        [],
        "has 200 characters, too few for two windows of --block-size 16 in each split (11 train, 1 val); give "
        "at least 330 characters",
        lambda tmp, ckpt: text_data(tmp, characters=200),
    ),
    "data-file without --dataset text": Case(
        [],
        "--data-file is the text of --dataset text, and this run's data set is synthetic; add --dataset text",
        lambda tmp, ckpt: ["--data-file", text_file(tmp)],
    ),
    "dataset text without a data-file": Case(["--dataset", "text"], "--dataset text needs --data-file FILE"),
    "gpt on images": Case(["--model", "gpt"], "--model gpt and --dataset synthetic do not fit"),
    "gpt heads that do not divide the embedding": Case(
        ["--n-head", "3"], "--n-embd 16 must be a multiple of --n-head 3", lambda tmp, ckpt: text_data(tmp)
    ),
    "cifar10 not there": Case(
        ["--dataset", "cifar10", "--data-dir", "/nonexistent/data"],
        "files not found in --data-dir /nonexistent/data; pass --download",
    ),
    "mnist corrupt and --download without a network": Case(
        ["--download"],
        "train-images-idx3-ubyte.gz is corrupt (checksum mismatch: a truncated or damaged download) "
        "and --download could not fetch a good copy ([Errno 111] Connection refused)",
        lambda tmp, ckpt: mnist_downloads(tmp, "train-images-idx3-ubyte.gz"),
        offline=True,
    ),
    "cifar10 --download without a network": Case(
        ["--download", "--dataset", "cifar10", "--data-dir", "/nonexistent/data"],
        "--download could not fetch the "
        "files into --data-dir /nonexistent/data ([Errno 111] Connection refused); check the network",
        offline=True,
    ),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=case.marks) for name, case in CLI.items()])
def test_bad_command_line_is_one_line_and_exit_2(name, save_dir, tmp_path, capsys, monkeypatch):
    case = CLI[name]
    monkeypatch.chdir(tmp_path)  # default folders (datasets/, checkpoints/) stay in the test's directory
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in case.env.items():
        monkeypatch.setenv(variable, value)
    more = case.files(tmp_path, save_dir) if case.files else []
    before = contents(save_dir)
    holder = hold_save_dir(save_dir) if case.owned else None
    if case.offline:
        no_network(monkeypatch)
    try:
        code = main_multi_gpu.main([*BASE, "--save-dir", str(save_dir), *case.args, *more])
    finally:
        if holder is not None:
            holder.communicate("", timeout=RUN_TIMEOUT)
    assert_one_line(code, capsys.readouterr().err, case.expected)
    assert_untouched(save_dir, before)


def test_a_monitor_typo_is_refused_before_the_first_step(tmp_path, capsys):
    code = main_multi_gpu.main([*BASE, "--save-dir", str(tmp_path / "ckpt"), "--monitor", "val_accuracy"])
    out, err = capsys.readouterr()
    assert_one_line(code, err, "--monitor val_accuracy is not a validation metric of this run")
    assert not [line for line in out.splitlines() if line.startswith(("step ", "epoch "))], (
        out
    )  # nothing trained
    assert not list(tmp_path.rglob("*.pt"))


# ---------------------------------------------------------------- abbreviations, in every parser
def benchmark(name: str) -> Any:
    """A script of benchmarks/, imported as its own folder sees it."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)


def script_main(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> object:
    """A benchmark whose main() reads sys.argv."""
    monkeypatch.setattr("sys.argv", [f"{module}.py", *argv])
    return benchmark(module).main()


# A prefix of a real flag of each command line: argparse would take it as that flag.
ABBREVIATED = {
    "main_multi_gpu.py (and examples/, through parse_config)": (
        lambda mp: main_multi_gpu.main(["--ep", "2"]),
        "--ep",
    ),
    "predict_multi_gpu.py": (
        lambda mp: predict_multi_gpu.main(["--checkpoint", "x.pt", "--out", "p.csv"]),
        "--out",
    ),
    "sweep_multi_gpu.py": (lambda mp: sweep_cli.main(["--num-se", "2"]), "--num-se"),
    "the launcher's rules": (lambda mp: launch_rules.main(["check", "--epoch", "3"]), "--epoch"),
    "the benchmarks' common flags": (
        lambda mp: (
            benchmark("bench_common")
            .benchmark_parser(None, rounds=1, steps=1, batch=1, log_every=1, output_help="")
            .parse_args(["--round", "2"])
        ),
        "--round",
    ),
    "benchmarks/inference_scaling.py": (
        lambda mp: benchmark("inference_scaling").parse_args(["--repeat", "3"]),
        "--repeat",
    ),
    "benchmarks/gpu_check.py": (lambda mp: benchmark("gpu_check").parse_args(["--cpu-dry"]), "--cpu-dry"),
    "benchmarks/trainer_vs_raw_ddp.py": (
        lambda mp: script_main("trainer_vs_raw_ddp", ["--npro", "2"], mp),
        "--npro",
    ),
}


@pytest.mark.parametrize("name", ABBREVIATED)
def test_an_abbreviated_flag_is_refused_by_every_parser(name, capsys, monkeypatch):
    run, abbreviation = ABBREVIATED[name]
    try:
        code = run(monkeypatch)
    except SystemExit as exit_:
        code = exit_.code
    output = capsys.readouterr()
    assert code == 2, output
    assert abbreviation in output.err + output.out and "unrecognized" in output.err + output.out, output


# ---------------------------------------------------------------- across a process boundary
def test_a_full_disk_at_start_is_refused_before_training(save_dir):
    before = contents(save_dir)
    # Room for nothing: the start probe writes real bytes, so a disk with no room is found at start.
    result = subprocess.run(
        cli_command([*BASE, "--save-dir", str(save_dir), "--resume", "auto"]),
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        preexec_fn=file_size_limit(16 * 1024),
    )
    assert_one_line(
        result.returncode,
        result.stderr,
        f"--save-dir {save_dir} is not writable (File too large); "
        f"free some space or choose another directory",
    )
    assert_untouched(save_dir, before)


@pytest.mark.slow
def test_a_save_dir_too_small_for_the_checkpoints_is_refused_at_start_unless_allowed(tmp_path):
    # A real 3 MB file system; the run's checkpoints (the mlp's, 1.1 MB each) need 3.3 MB at the most.
    save_dir, command = (
        tmp_path / "small" / "ckpt",
        cli_command([*BASE, "--mode", "flatten", "--model", "mlp", "--image-shape", "1,8,8"]),
    )
    save_dir.parent.mkdir()
    files = f"find {shlex.quote(str(save_dir.parent))} -type f"  # what is on the small file system at the end
    refused = run_on_small_file_system(
        "3m",
        save_dir.parent,
        f'"$@"; status=$?; {files}; exit $status',
        *command,
        "--save-dir",
        str(save_dir),
    )
    assert_one_line(
        refused.returncode,
        refused.stderr,
        f"--save-dir {save_dir} has 3.1 MB free, but this run's checkpoints need about 3.3 MB (last.pt, "
        f"best.pt, and the one being written, about 1.1 MB each): free some space, choose another "
        f"directory, or pass --allow-low-disk to start anyway",
    )
    assert (
        str(save_dir) not in refused.stdout and "step " not in refused.stdout
    )  # no file written, nothing trained
    # Accepting the risk: it warns and trains; one epoch's last.pt and best.pt fit.
    allowed = run_on_small_file_system(
        "3m",
        save_dir.parent,
        f'"$@" && {files} -name "*.pt"',
        *command,
        "--save-dir",
        str(save_dir),
        "--allow-low-disk",
    )
    assert allowed.returncode == 0, allowed.stderr
    assert f"warning: --save-dir {save_dir} has 3.1 MB free" in allowed.stdout
    assert sorted(allowed.stdout.splitlines()[-2:]) == [str(save_dir / "best.pt"), str(save_dir / "last.pt")]


def test_resume_auto_without_save_dir_refuses_another_commands_run(prepared, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(prepared, tmp_path / "checkpoints" / "run-1")
    before = contents(tmp_path / "checkpoints")
    code = main_multi_gpu.main([*BASE, "--resume", "auto", "--lr", "0.1", "--epochs", "2"])
    assert_one_line(
        code,
        capsys.readouterr().err,
        "--resume auto without --save-dir: no run under checkpoints has this command's settings; the "
        "newest, checkpoints/run-1, differs in lr: 0.001 -> 0.1: continue it with these settings by "
        "naming it (--save-dir checkpoints/run-1 --resume auto), or drop --resume auto to start a new "
        "run",
    )
    assert_untouched(tmp_path / "checkpoints", before)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["run-1"]


@pytest.mark.parametrize("workers", [0, 1], ids=["in the main process", "in a loader worker"])
def test_an_image_that_fails_to_decode_mid_epoch_is_one_line_naming_it_and_the_checkpoints_are_kept(
    workers, tmp_path, capsys
):
    run = [
        *BASE,
        *imagefolder(tmp_path, {"train": ["cat", "dog"], "val": ["cat", "dog"]}),
        "--save-dir",
        str(tmp_path / "ckpt"),
        "--num-workers",
        str(workers),
    ]
    assert main_multi_gpu.main(run) == 0
    broken = tmp_path / "images" / "train" / "dog" / "1.png"
    broken.write_bytes(
        broken.read_bytes()[:48]
    )  # a copy cut short after its header: the start's checks pass it
    before = contents(tmp_path / "ckpt")
    capsys.readouterr()
    code = main_multi_gpu.main([*run, "--resume", "auto", "--epochs", "2"])
    assert_one_line(
        code,
        capsys.readouterr().err,
        f"{broken} cannot be read (image file is truncated); remove or replace it",
    )
    assert_untouched(tmp_path / "ckpt", before)


def unreadable(path: Path) -> Path:
    path.chmod(0)
    return path


# name: (tmp_path, save_dir -> (arguments, the folder to run in, the one line's text)). Root reads anything, so
# these run with the capabilities that let it dropped (conftest.permissions_apply).
PERMISSIONS = {
    "an unreadable data file": lambda tmp, ckpt: (
        [*mnist_extracted(tmp, None), "--save-dir", str(ckpt)],
        tmp,
        f"--dataset mnist: {unreadable(tmp / 'mnist' / 'MNIST' / 'raw' / 't10k-images-idx3-ubyte')} cannot be read "
        f"(Permission denied); give this user read access to it",
    ),
    "an unreadable image folder": lambda tmp, ckpt: (
        [*imagefolder(tmp, {"train": ["cat", "dog"], "val": ["cat", "dog"]}), "--save-dir", str(ckpt)],
        tmp,
        f"cannot read the folder {unreadable(tmp / 'images' / 'train' / 'dog')} (Permission denied)",
    ),
    "a save-dir in a read-only folder": lambda tmp, ckpt: (
        ["--save-dir", str(tmp / "locked" / "run")],
        tmp,
        f"--save-dir {tmp / 'locked' / 'run'} is not writable (Permission denied)",
    ),
    "the current folder read-only, without --save-dir": lambda tmp, ckpt: (
        [],
        tmp / "locked",
        f"cannot use {tmp / 'locked' / 'checkpoints'}: permission denied",
    ),
}


@pytest.mark.parametrize("name", PERMISSIONS)
def test_a_path_this_user_may_not_use_is_one_line_naming_it(name, save_dir, tmp_path):
    (tmp_path / "locked").mkdir(mode=0o555)
    args, cwd, expected = PERMISSIONS[name](tmp_path, save_dir)
    before, cwd_before = contents(save_dir), sorted(cwd.iterdir())
    result = subprocess.run(
        cli_command([*BASE, *args]),
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        preexec_fn=permissions_apply(),
    )
    assert_one_line(result.returncode, result.stderr, expected)
    assert_untouched(save_dir, before)
    assert sorted(cwd.iterdir()) == cwd_before


RANKS = {
    "dp under torchrun": (
        ["--multi-gpu", "dp"],
        "--multi-gpu dp trains in one process, but torchrun started 2: "
        "use --multi-gpu ddp under torchrun, or run without torchrun",
    ),
    "a training set smaller than the world size": (
        ["--multi-gpu", "ddp", "--train-size", "1"],
        "a training set of 1 sample(s) cannot be shared by 2 ranks",
    ),
}


@pytest.mark.parametrize("name", RANKS)
def test_bad_input_under_torchrun_is_one_line_from_rank_0_and_exit_2_on_every_rank(name, save_dir):
    args, expected = RANKS[name]
    before = contents(save_dir)
    workers = run_cli_ranks([*BASE, "--save-dir", str(save_dir), "--resume", "auto", *args], nproc=2)
    assert [worker.returncode for worker in workers] == [2, 2], [worker.stderr for worker in workers]
    assert workers[1].stderr == ""  # rank 0 speaks for all
    assert_one_line(workers[0].returncode, workers[0].stderr, expected)
    assert_untouched(save_dir, before)


# Refusals every rank reaches on its own, before any process group: at the flags, the device set-up, the mesh.
EVERY_RANK_REFUSES = {
    "a value out of range": (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    "dp under torchrun": (["--multi-gpu", "dp"], RANKS["dp under torchrun"][1]),
    "a mesh of more processes than the run's": (
        ["--multi-gpu", "fsdp", "--dp-replicate", "3", "--dp-shard", "2"],
        "--dp-replicate 3 x --dp-shard 2 = 6 processes, but this run has 2 "
        "processes: make replicate x shard = 2, or give --dp-shard -1 for the "
        "processes left",
    ),
}
TORCHRUNS = 20


@pytest.mark.parametrize("name", EVERY_RANK_REFUSES)
def test_a_refusal_every_rank_reaches_is_said_once_under_torchrun_whichever_rank_ends_first(name):
    """torchrun ends every worker once one exits with an error: rank 0, alone to say the refusal, was ended before
    it had in 3 of 6 runs. 20 runs beside 2 busy cores, in turn with rank 0 slowest (stopped until torchrun ends
    it), rank 1 slowest, and neither."""
    args, expected = EVERY_RANK_REFUSES[name]
    with torchruns_store() as port, busy_cpus(2):
        runs = [
            run_as_torchrun_workers(args, 2, port, attempt, held=attempt % 3 if attempt % 3 < 2 else None)
            for attempt in range(TORCHRUNS)
        ]
    for attempt, (statuses, output) in enumerate(runs):
        assert output == f"error: {expected}\n", (attempt, statuses, output)
        assert 2 in statuses and set(statuses) <= {2, -15}, (attempt, statuses)


# ---------------------------------------------------------------- the Python API
class InputsOnly(Dataset):
    """A user's data set that forgot the targets: it yields (input,)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        return (torch.randn(16),)


def api_fit(tmp_path: Path, model: torch.nn.Module, dataset: Dataset, **options: Any) -> object:
    return MultiGPUTrainer(model, dataset, None, config_for(tmp_path, 1, epochs=1), **options).fit()


def api_build(
    tmp_path: Path,
    val: Dataset,
    model: torch.nn.Module | None = None,
    config: dict | None = None,
    **options: Any,
) -> object:
    """The trainer built, not fitted: what this refuses is refused before the first step."""
    return MultiGPUTrainer(
        model or tiny_model(),
        blobs(32, 0),
        val,
        config_for(tmp_path, 1, epochs=1, **(config or {})),
        **options,
    )


def regression_set(size: int) -> TensorDataset:
    """Targets of shape (N,), for a model whose outputs are (N, 1)."""
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 16, generator=generator), torch.randn(size, generator=generator))


def api(make: Callable[[Path], object], error: type, expected: str, *marks) -> object:
    return pytest.param(make, error, expected, marks=marks)


API = {
    "batch_size as text": api(
        lambda tmp: TrainConfig(batch_size="64"),
        UsageError,
        "TrainConfig batch_size (--batch-size) must be an int or 'auto', got '64' (str)",
    ),
    "fractional max_steps": api(
        lambda tmp: TrainConfig(max_steps=2.5),  # type: ignore[arg-type]  # the wrong type, on purpose
        UsageError,
        "TrainConfig max_steps (--max-steps) must be an int, got 2.5 (float)",
    ),
    "fractional epochs": api(
        lambda tmp: TrainConfig(epochs=1.5),  # type: ignore[arg-type]  # the wrong type, on purpose
        UsageError,
        "TrainConfig epochs (--epochs) must be an int, got 1.5 (float)",
    ),
    "lr as text": api(
        lambda tmp: TrainConfig(lr="0.1"),  # type: ignore[arg-type]  # the wrong type, on purpose
        UsageError,
        "TrainConfig lr (--lr) must be a float",
    ),
    "progress as a number": api(
        lambda tmp: TrainConfig(progress=1),  # type: ignore[arg-type]  # the wrong type, on purpose
        UsageError,
        "TrainConfig progress (--progress) must be a bool, got 1 (int)",
    ),
    "a bool for an int": api(
        lambda tmp: TrainConfig(train_size=True), UsageError, "must be an int, got True (bool)"
    ),
    "save_dir as a number": api(
        lambda tmp: TrainConfig(save_dir=3),  # type: ignore[arg-type]  # the wrong type, on purpose
        UsageError,
        "TrainConfig save_dir (--save-dir) must be a str",
    ),
    "momentum nan": api(
        lambda tmp: TrainConfig(momentum=float("nan")), UsageError, "--momentum must be a finite"
    ),
    "seed beyond the generators": api(
        lambda tmp: TrainConfig(seed=2**40), UsageError, "--seed must be between"
    ),
    "sampler for more ranks than samples": api(
        lambda tmp: ResumableDistributedSampler(1, rank=0, world_size=2),
        UsageError,
        "cannot be shared by 2 ranks",
    ),
    "image too small for the cnn": api(
        lambda tmp: build_model("cnn", (3, 1, 1), 10), UsageError, "at least 4x4"
    ),
    "data set without targets": api(
        lambda tmp: api_fit(tmp, tiny_model(), InputsOnly()), ValueError, "target"
    ),
    "model outputs fewer than the classes": api(
        lambda tmp: api_fit(tmp, tiny_model(classes=2), blobs(32, 0, classes=4)), ValueError, "class"
    ),
    # names and shapes, checked on a few validation samples when the trainer is built
    "monitor that is not a metric": api(
        lambda tmp: api_build(tmp, blobs(16, 1), config=dict(monitor="val_f1")),
        UsageError,
        "--monitor val_f1 is not a validation metric of this run; it has val_loss, val_acc",
    ),
    "early stopping without a validation set": api(
        lambda tmp: api_build(tmp, None, config=dict(early_stop_patience=2)),  # type: ignore[arg-type]  # no validation set: refused
        UsageError,
        "--early-stop-patience watches a validation metric, and this run has no validation set",
    ),
    "a metric name that does not exist": api(
        lambda tmp: api_build(tmp, blobs(16, 1), metrics=["acc", "f1"]), ValueError, "unknown metric 'f1'"
    ),
    "a validation set without targets": api(
        lambda tmp: api_build(tmp, InputsOnly()),
        ValueError,
        "a batch must be an (inputs, targets) pair or a dict",
    ),
    "a metric function that fails": api(
        lambda tmp: api_build(tmp, blobs(16, 1), metrics={"p": lambda outputs, targets: outputs.probs}),
        AttributeError,
        "probs",
    ),
    "regression outputs (N, 1) against targets (N,)": api(
        lambda tmp: api_build(tmp, regression_set(16), torch.nn.Linear(16, 1), loss_fn=torch.nn.MSELoss()),
        UsageError,
        "outputs of shape (8, 1) and targets of shape (8,) differ: MSELoss would broadcast them",
    ),
    "the same without a validation set, at the first batch": api(
        lambda tmp: api_fit(tmp, torch.nn.Linear(16, 1), regression_set(32), loss_fn=F.l1_loss),
        ValueError,
        "outputs of shape (8, 1) and targets of shape (8,) differ: l1_loss would broadcast them",
    ),
}


@pytest.mark.parametrize("make, error, expected", list(API.values()), ids=list(API))
def test_bad_python_api_input_is_one_clear_exception(make, error, expected, tmp_path):
    with pytest.raises(Exception) as raised:
        make(tmp_path)
    assert isinstance(raised.value, error), f"{type(raised.value).__name__}: {raised.value}"
    message = str(raised.value)
    assert "\n" not in message and expected in message and "unpack" not in message, message
