"""launch_multi_gpu.sh: the dialogue, the printed commands, and real CPU runs it starts.

End-to-end tests train for real (gloo, the smallest synthetic runs, --dist-timeout
60) so a hang fails quickly; every subprocess has a wall-clock limit. Each real
run proves several things at once (four runs in all: piped answers with a busy
default port, a silent pipe, a terminal, two nodes), because starting torch
dominates their time. CPU tests set CUDA_VISIBLE_DEVICES="" so they take the CPU
path even on a GPU machine; GPU tests put tests/fake_bin (a fake nvidia-smi with
4 GPUs) first on PATH and only use --dry-run or decline at the confirmation.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = REPO / "launch_multi_gpu.sh"
FAKE_BIN = REPO / "tests" / "fake_bin"
# Trainer options after `--` for the smallest real runs (epochs and batch size are the
# launcher's own flags or answers: it refuses them after `--`).
TINY = [
    "--",
    "--train-size",
    "256",
    "--val-size",
    "64",
    "--mode",
    "flatten",
    "--no-progress",
    "--dist-timeout",
    "60",
]
DRY_TIMEOUT = 60
RUN_TIMEOUT = 240

sys.path.insert(0, str(REPO))
from conftest import needs_shellcheck, shellcheck_path  # noqa: E402
from multigpu.checkpoints import run_folders  # noqa: E402
from multigpu.config import TrainConfig, parse_config  # noqa: E402  (after the path tweak)
from multigpu.errors import UsageError  # noqa: E402
from multigpu.lr_scaling import scaled_lr  # noqa: E402

DEFAULTS = TrainConfig()
# Without --save-dir the launcher names a new run folder: run-1 in a fresh directory; in the checkout,
# whatever comes next there (a dry run creates nothing, so it stays the same during the tests).
FIRST_RUN = Path("checkpoints") / "run-1"


# --- helpers -------------------------------------------------------------------


def launcher_env(gpus: int | None = None, **extra: str) -> dict[str, str]:
    """Environment for the launcher: CPU-only, or `gpus` fake GPUs via the fake nvidia-smi."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("LAUNCH_DEFAULT_PORT", None)
    if gpus is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env["PATH"] = f"{FAKE_BIN}{os.pathsep}{env['PATH']}"
        env["FAKE_GPU_COUNT"] = str(gpus)
    env.update(extra)
    return env


def launch(
    args: Sequence[str],
    env: dict[str, str],
    cwd: Path = REPO,
    input: str | None = None,
    timeout: float = DRY_TIMEOUT,
) -> subprocess.CompletedProcess:
    """Run the launcher; stdin is `input`, or /dev/null (never a terminal)."""
    return subprocess.run(
        ["bash", str(LAUNCHER), *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def shown(path: str) -> str:
    """A path as the launcher prints it: relative when under the current directory (REPO here)."""
    prefix = f"{REPO}/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def dry_run_save_dir() -> str:
    """The save-dir a dry run in the checkout names by default."""
    return shown(run_folders.next_run_dir(str(REPO / "checkpoints")))


def ddp_head(nproc: int, port: int, ids: str | None = None, log: str | None = None) -> str:
    """The start of the launcher's ddp command: torchrun (through multigpu/launch/torchrun.py) with its threads per
    worker."""
    cores = len(os.sched_getaffinity(0))
    env = f"CUDA_VISIBLE_DEVICES={ids} " if ids else ""
    log = log or f"{dry_run_save_dir()}/torchrun.log"
    return (
        f"{env}OMP_NUM_THREADS={max(1, cores // nproc)} {shown(sys.executable)} multigpu/launch/torchrun.py "
        f"--log-file {log} --nproc_per_node={nproc} --master_port={port}"
    )


def training_flags(
    epochs: int = DEFAULTS.epochs,
    batch: int | str = DEFAULTS.batch_size,
    lr: str = repr(DEFAULTS.lr),
    scaling: str = DEFAULTS.lr_scaling,
    save_dir: str | None = None,
) -> str:
    save_dir = save_dir or dry_run_save_dir()
    return f"--epochs {epochs} --batch-size {batch} --lr {lr} --lr-scaling {scaling} --save-dir {save_dir}"


def assert_one_line_usage_error(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("launch_multi_gpu.sh: ")
    assert result.stdout == ""


class Launcher:
    """A launcher that starts a real run, in its own process group, its outputs read as they come.

    Reading both pipes all along means two launchers that wait for each other (two
    nodes) never stall on a full pipe; stdin stays open until `send(..., close=True)`
    or the end, so a test can also leave it open and silent.
    """

    def __init__(self, args: Sequence[str], env: dict[str, str], cwd: Path, read_stdout: bool = True) -> None:
        """`read_stdout` False: the test reads proc.stdout itself."""
        self.proc = subprocess.Popen(
            ["bash", str(LAUNCHER), *args],
            cwd=cwd,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.output = {"stdout": "", "stderr": ""}
        streams = (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))[0 if read_stdout else 1 :]
        self.readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True) for name, stream in streams
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str, stream) -> None:
        self.output[name] = stream.read()

    def send(self, text: str, close: bool) -> None:
        stdin = self.proc.stdin
        assert stdin is not None  # a pipe
        try:
            stdin.write(text)
            stdin.flush()
            if close:
                stdin.close()
        except BrokenPipeError:
            pass  # it stopped reading (or never read); wait() reports how it ended

    def wait(self, deadline: float) -> subprocess.CompletedProcess:
        """Wait until `deadline` (time.monotonic()); past it, stop the run and fail with its output."""
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        timed_out = self.proc.poll() is None
        if timed_out:
            self._stop()
        for reader in self.readers:
            reader.join(timeout=10)
        stdin = self.proc.stdin
        assert stdin is not None  # a pipe
        if not stdin.closed:
            stdin.close()
        result = subprocess.CompletedProcess(
            self.proc.args, self.proc.returncode, self.output["stdout"], self.output["stderr"]
        )
        if timed_out:
            pytest.fail(
                f"the launcher did not finish in time; it printed:\n{result.stdout[-2000:]}\n"
                f"{result.stderr[-3000:]}"
            )
        return result

    def _stop(self) -> None:
        # torchrun (the launcher execs it) stops its workers on SIGTERM; they run in sessions of their own.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_launcher(
    args: Sequence[str], env: dict[str, str], cwd: Path, answers: str = "", keep_stdin_open: bool = False
) -> subprocess.CompletedProcess:
    """A real run: pipe `answers`, then close stdin (or leave it open and silent)."""
    launcher = Launcher(args, env, cwd)
    launcher.send(answers, close=not keep_stdin_open)
    return launcher.wait(time.monotonic() + RUN_TIMEOUT)


# --- dry runs: the exact commands ----------------------------------------------


def test_fake_nvidia_smi_gpus_are_listed_and_the_default_is_ddp_on_all_of_them() -> None:
    port = free_port()
    result = launch(["--dry-run"], launcher_env(gpus=4, LAUNCH_DEFAULT_PORT=str(port)))
    assert result.returncode == 0, result.stderr
    for i in range(4):
        assert f"GPU {i}  NVIDIA A100-SXM4-80GB  81920 MiB" in result.stderr
    assert result.stdout == f"{ddp_head(4, port)} main_multi_gpu.py --multi-gpu ddp {training_flags()}\n"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--multi-gpu", "ddp"], "{ddp4} main_multi_gpu.py --multi-gpu ddp"),
        (["--multi-gpu", "ddp", "--gpu-ids", "1,3"], "{ddp2_ids13} main_multi_gpu.py --multi-gpu ddp"),
        (
            ["--multi-gpu", "ddp", "--gpus", "2", "--max-restarts", "3"],
            "{ddp2} --max_restarts=3 main_multi_gpu.py --multi-gpu ddp",
        ),
        (["--multi-gpu", "fsdp", "--gpus", "2"], "{ddp2} main_multi_gpu.py --multi-gpu fsdp"),
        (["--multi-gpu", "dp"], "{python} main_multi_gpu.py --multi-gpu dp"),
        (["--multi-gpu", "dp", "--gpus", "2"], "{python} main_multi_gpu.py --multi-gpu dp --gpu-ids 0,1"),
        (
            ["--multi-gpu", "dp", "--gpu-ids", "0,2,3"],
            "{python} main_multi_gpu.py --multi-gpu dp --gpu-ids 0,2,3",
        ),
        (["--multi-gpu", "none"], "CUDA_VISIBLE_DEVICES=0 {python} main_multi_gpu.py --multi-gpu none"),
        (
            ["--multi-gpu", "none", "--gpu-ids", "2"],
            "CUDA_VISIBLE_DEVICES=2 {python} main_multi_gpu.py --multi-gpu none",
        ),
        (
            ["--mode", "single", "--gpu-ids", "2"],
            "CUDA_VISIBLE_DEVICES=2 {python} main_multi_gpu.py --multi-gpu none",
        ),
        (["--mode", "dp", "--nproc", "2"], "{python} main_multi_gpu.py --multi-gpu dp --gpu-ids 0,1"),
    ],
    ids=[
        "ddp",
        "ddp-gpu-ids",
        "ddp-count-restarts",
        "fsdp-count",
        "dp",
        "dp-count",
        "dp-gpu-ids",
        "none",
        "none-gpu-id",
        "alias-mode-single",
        "alias-mode-dp-nproc",
    ],
)
def test_dry_run_prints_the_command_of_each_gpu_mode(args: list[str], expected: str) -> None:
    port = free_port()
    result = launch([*args, "--dry-run"], launcher_env(gpus=4, LAUNCH_DEFAULT_PORT=str(port)))
    assert result.returncode == 0, result.stderr
    head = expected.format(
        ddp4=ddp_head(4, port),
        ddp2=ddp_head(2, port),
        ddp2_ids13=ddp_head(2, port, "1,3"),
        python=shown(sys.executable),
    )
    assert result.stdout == f"{head} {training_flags()}\n"


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "{ddp2} main_multi_gpu.py --multi-gpu ddp"),
        (["--nproc", "1"], "{ddp1} main_multi_gpu.py --multi-gpu ddp"),
        (["--multi-gpu", "fsdp"], "{ddp2} main_multi_gpu.py --multi-gpu fsdp"),
        (["--mode", "single"], "{python} main_multi_gpu.py --multi-gpu none"),
    ],
    ids=["ddp-default-2-processes", "ddp-nproc-alias", "fsdp-default-2-processes", "single"],
)
def test_dry_run_on_a_cpu_machine_offers_cpu_ddp_and_single(args: list[str], expected: str) -> None:
    port = free_port()
    result = launch([*args, "--dry-run"], launcher_env(LAUNCH_DEFAULT_PORT=str(port)))
    assert result.returncode == 0, result.stderr
    assert "No CUDA GPU found" in result.stderr
    head = expected.format(ddp2=ddp_head(2, port), ddp1=ddp_head(1, port), python=shown(sys.executable))
    assert result.stdout == f"{head} {training_flags()}\n"


@pytest.mark.parametrize("rank", [0, 1])
def test_dry_run_of_a_two_node_job_uses_c10d_rendezvous_hosted_by_node_0(rank: int) -> None:
    port = free_port()
    args = [
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        str(port),
        "--max-restarts",
        "2",
        "--epochs",
        "5",
        "--batch-size",
        "32",
        "--lr",
        "0.1",
        "--scale-lr",
        "linear",
        "--save-dir",
        "runs/two",
        "--dry-run",
    ]
    result = launch(args, launcher_env(gpus=4))
    assert result.returncode == 0, result.stderr
    # Node 0 hosts the rendezvous store; the id and endpoint are the same on every node.
    head = ddp_head(4, port, log=f"runs/two/torchrun-node{rank}.log").replace(f" --master_port={port}", "")
    assert result.stdout == (
        f"{head} --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=10.1.2.3:{port} "
        f"--rdzv_id=multigpu-{port} --rdzv_conf=is_host={int(rank == 0)} --max_restarts=2 main_multi_gpu.py "
        f"--multi-gpu ddp {training_flags(5, 32, '0.1', 'linear', 'runs/two')}\n"
    )
    assert f"per node x 2 nodes (this is node {rank})" in result.stderr
    # 32 per GPU x 4 GPUs x 2 nodes
    assert f"lr {scaled_lr(0.1, 'linear', 256, 32)!r} = 0.1 x linear(256/32)" in result.stderr
    # c10d assigns the global ranks, so the checkpoints may be written on either node.
    assert "use a --save-dir all nodes share" in result.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp_on_two_nodes_shards_within_each_node_and_replicates_across_them(rank: int) -> None:
    port = free_port()
    args = [
        "--multi-gpu",
        "fsdp",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        str(port),
        "--save-dir",
        "runs/two",
        "--dry-run",
    ]
    result = launch(args, launcher_env(gpus=4))
    assert result.returncode == 0, result.stderr
    assert " main_multi_gpu.py --multi-gpu fsdp --dp-replicate 2 --dp-shard 4 --epochs " in result.stdout
    assert (
        "Plan: FSDP (the model sharded) over 4 GPUs per node x 2 nodes (this is node "
        f"{rank}), hybrid: mesh replicate 2 x shard 4 (shard within each node, replicate across the nodes)"
    ) in result.stderr
    one_node = launch(["--multi-gpu", "fsdp", "--dry-run"], launcher_env(gpus=4))
    assert " main_multi_gpu.py --multi-gpu fsdp --epochs " in one_node.stdout  # one node: fsdp as always


def test_shown_lr_and_effective_batch_come_from_the_trainers_formula() -> None:
    args = [
        "--gpus",
        "4",
        "--batch-size",
        "48",
        "--lr",
        "3e-4",
        "--scale-lr",
        "sqrt",
        "--dry-run",
        "--",
        "--grad-accum-steps",
        "3",
        "--lr-base-batch",
        "64",
    ]
    result = launch(args, launcher_env(gpus=4))
    assert result.returncode == 0, result.stderr
    assert "effective batch 576 = 48 per GPU x 4 GPUs x 3 accumulation steps" in result.stderr
    assert f"lr {scaled_lr(3e-4, 'sqrt', 576, 64)!r} = 3e-4 x sqrt(576/64)" in result.stderr
    # The trainer gets the base LR and the rule, and computes the same value itself.
    assert result.stdout.rstrip().endswith(
        f"--lr 3e-4 --lr-scaling sqrt --save-dir {dry_run_save_dir()} --grad-accum-steps 3 --lr-base-batch 64"
    )


def test_batch_size_auto_is_shown_as_found_at_start_on_gpus_and_as_the_default_without() -> None:
    args = [
        "--batch-size",
        "auto",
        "--lr",
        "3e-4",
        "--scale-lr",
        "sqrt",
        "--save-dir",
        "runs/auto",
        "--dry-run",
    ]
    on_gpus = launch(args, launcher_env(gpus=4))
    assert on_gpus.returncode == 0, on_gpus.stderr
    assert (
        "effective batch the largest batch that fits per GPU, found at start (--batch-size auto) x 4 GPUs x "
        "1 accumulation step"
    ) in on_gpus.stderr
    assert "lr 3e-4 x sqrt(effective batch/32), once the batch is found" in on_gpus.stderr
    assert " --batch-size auto " in on_gpus.stdout
    on_cpu = launch(args, launcher_env())
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert (
        "effective batch 128 = 64 per process (--batch-size auto needs CUDA) x 2 processes x 1 accumulation "
        "step"
    ) in on_cpu.stderr


def test_dry_run_from_another_directory_names_the_trainer_by_path_and_writes_nothing(tmp_path: Path) -> None:
    result = launch(["--dry-run", "--save-dir", "out"], launcher_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # From another directory the trainer is named by its full path.
    assert f" {REPO}/main_multi_gpu.py --multi-gpu ddp " in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_help_lists_every_flag() -> None:
    result = subprocess.run(
        ["bash", str(LAUNCHER), "--help"], text=True, capture_output=True, timeout=DRY_TIMEOUT
    )
    assert result.returncode == 0
    for flag in [
        "--multi-gpu",
        "--mode",
        "--gpus",
        "--nproc",
        "--gpu-ids",
        "--epochs",
        "--batch-size",
        "--lr",
        "--lr-scaling",
        "--scale-lr",
        "--save-dir",
        "--yes",
        "--dry-run",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--max-restarts",
        "--slurm",
        "--partition",
        "--time",
        "--account",
        "--cpus-per-task",
        "--submit",
        "--oversubscribe",
        "--k8s",
        "--image",
        "--k8s-pvc",
        "--ray",
        "--ray-address",
        "--ray-max-failures",
    ]:
        assert re.search(rf"^\s+(-\w, |--[\w-]+ \w+, )*{re.escape(flag)}\b", result.stdout, re.M), flag


# --- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "0"], "--gpus must be at least 1, got 0"),
        (["--gpus", "5"], "--gpus 5: only 4 GPUs found (ids 0,1,2,3)"),
        (["--gpus", "two"], "--gpus must be a whole number, got 'two'"),
        (["--gpu-ids", "0,7"], "--gpu-ids 0,7: no GPU with id 7 (found: 0,1,2,3)"),
        (["--gpu-ids", "1,1"], "--gpu-ids 1,1: GPU 1 is listed twice"),
        (["--gpus", "2", "--gpu-ids", "0,1"], "give --gpus or --gpu-ids, not both"),
        (["--mode", "zero3"], "--multi-gpu must be one of ddp, fsdp, dp, none; got 'zero3'"),
        (["--multi-gpu", "auto"], "--multi-gpu must be one of ddp, fsdp, dp, none; got 'auto'"),
        (["--mode", "single", "--gpus", "2"], "--gpus 2: --multi-gpu none uses one device"),
        (["--master-port", "70000"], "--master-port must be at most 65535, got 70000"),
        (["--nnodes", "2", "--master-addr", "10.0.0.1"], "--nnodes 2 needs --node-rank"),
        (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs --master-addr"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
            "--node-rank 2: must be below --nnodes 2",
        ),
        (
            ["--nnodes", "2", "--node-rank", "-1", "--master-addr", "h"],
            "--node-rank must be at least 0, got -1",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--mode", "dp"],
            "--nnodes 2 needs --multi-gpu ddp",
        ),
        (
            ["--multi-gpu", "fsdp", "--dp-replicate", "3"],
            "--dp-replicate 3 does not divide this run's 4 processes into equal groups: give one of 1, 2, 4",
        ),
        (
            ["--multi-gpu", "fsdp", "--dp-replicate", "2", "--dp-shard", "4"],
            "--dp-replicate 2 x --dp-shard 4 = 8 processes, but this run has 4 processes",
        ),
        (
            ["--dp-replicate", "2"],
            "--dp-replicate shapes the device mesh of --multi-gpu fsdp; add --multi-gpu fsdp",
        ),
        (
            ["--multi-gpu", "fsdp", "--", "--dp-shard", "2"],
            "--dp-shard after -- would override the launcher's setting",
        ),
        (["--frobnicate"], "unknown option --frobnicate"),
        (["--epochs"], "--epochs needs a value"),
        (["--", "--batch-size", "8"], "--batch-size after -- would override the launcher's setting"),
        (
            ["--", "--epoch", "8"],
            "unrecognized arguments: --epoch 8",
        ),  # an abbreviation is refused, not read as --epochs
        (["--", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--slurm", "--time", "soon"], "--time 'soon': not a SLURM time"),
        (["--slurm", "--nnodes", "2"], "--nnodes 2 needs --save-dir on storage every node shares"),
        (["--slurm", "--node-rank", "1"], "--node-rank is SLURM's to decide"),
        (["--slurm", "--", "--resume", "last.pt"], "the job script continues with --resume auto by itself"),
        (
            ["--slurm", "--", "--overwrite"],
            "--overwrite after -- with --slurm: the job continues its --save-dir with "
            "--resume auto (a requeue must not start over)",
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_flag_values_give_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = launch(["--dry-run", *args], launcher_env(gpus=4))
    assert_one_line_usage_error(result)
    assert message in result.stderr


@pytest.mark.parametrize(
    "args, trainer_argv",
    [
        (["--epochs", "0"], ["--epochs", "0"]),
        (["--epochs", "-1"], ["--epochs", "-1"]),
        (["--epochs", "many"], ["--epochs", "many"]),
        (["--batch-size", "0"], ["--batch-size", "0"]),
        (["--lr", "-0.1"], ["--lr", "-0.1"]),
        (["--lr", "fast"], ["--lr", "fast"]),
        (["--scale-lr", "cubic"], ["--lr-scaling", "cubic"]),
        (["--", "--grad-accum-steps", "0"], ["--grad-accum-steps", "0"]),
        (["--", "--image-shape", "3,1"], ["--image-shape", "3,1"]),
        (["--", "--resume", "auto", "--overwrite"], ["--resume", "auto", "--overwrite"]),
    ],
    ids=lambda value: " ".join(value),
)
def test_a_value_the_trainer_refuses_is_refused_by_the_launcher_in_the_same_words(
    args: list[str], trainer_argv: list[str]
) -> None:
    with pytest.raises(UsageError) as refused:
        parse_config(trainer_argv)  # the trainer's own parser and TrainConfig
    result = launch(["--dry-run", *args], launcher_env(gpus=4))
    assert_one_line_usage_error(result)
    assert result.stderr == f"launch_multi_gpu.sh: {refused.value}\n"


def test_a_save_dir_that_is_a_file_is_refused_in_one_line_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    for extra in (["--dry-run"], ["--yes"]):
        result = launch(["--save-dir", "notes.txt", *extra], launcher_env(), cwd=tmp_path)
        assert_one_line_usage_error(result)
        assert "--save-dir notes.txt is a file, not a folder" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_flag_aliases_give_the_same_command_as_the_trainers_names() -> None:
    port = free_port()
    env = launcher_env(gpus=4, LAUNCH_DEFAULT_PORT=str(port))
    old = launch(["--mode", "single", "--scale-lr", "sqrt", "--nproc", "1", "--dry-run"], env)
    new = launch(["--multi-gpu", "none", "--lr-scaling", "sqrt", "--gpus", "1", "--dry-run"], env)
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stdout == new.stdout
    assert "--multi-gpu none" in new.stdout and "--lr-scaling sqrt" in new.stdout


def test_each_cpu_worker_gets_its_share_of_the_cores_in_the_printed_command() -> None:
    cores = len(os.sched_getaffinity(0))
    for processes in (1, cores, 2 * cores + 1):
        result = launch(["--gpus", str(processes), "--oversubscribe", "--dry-run"], launcher_env())
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"OMP_NUM_THREADS={max(1, cores // processes)} ")
        oversubscribed = f"--oversubscribe: {processes} processes share {cores} CPU core" in result.stderr
        assert oversubscribed == (processes > cores), result.stderr


def test_more_cpu_processes_than_cores_are_refused_unless_oversubscribe_is_given() -> None:
    cores = len(os.sched_getaffinity(0))
    refused = launch(["--yes", "--gpus", "999"], launcher_env())
    assert_one_line_usage_error(refused)
    assert (
        f"--gpus 999: more processes than this machine's {cores} CPU core" in refused.stderr
        and "give at most" in refused.stderr
        and "or add --oversubscribe" in refused.stderr
    )
    # Asked: the answer is refused in the same words and asked again; 'n' at the end runs nothing.
    asked = launch([], launcher_env(), input=f"ddp\n{cores + 1}\n{cores}\n1\n32\n\nnone\nn\n")
    assert asked.returncode == 0, asked.stderr
    assert f"  --gpus {cores + 1}: more processes than this machine's" in asked.stderr
    assert asked.stderr.count("CPU processes [") == 2 and "Not done" in asked.stderr


def test_a_number_off_the_menu_is_asked_again_naming_the_menu() -> None:
    """The CPU menu offers 1-3, and `7` was answered with a flag error about --multi-gpu."""
    asked = launch([], launcher_env(), input="7\n3\n")  # then the answers run out: nothing runs
    assert asked.returncode == 130, asked.stderr
    assert (
        "Mode [ddp]: 7\n  7 is not on the menu: answer 1-3, or one of ddp, none, fsdp\nMode [ddp]: 3\n"
        in asked.stderr
    )
    assert "--multi-gpu" not in asked.stderr and "CPU processes [" in asked.stderr  # 3 (fsdp) taken


def test_the_guides_transcript_of_the_commands_is_what_the_launcher_prints(tmp_path: Path) -> None:
    """The guide's launcher page shows the commands of a first run: its save dir is checkpoints/run-1."""
    guide = (REPO / "docs" / "launcher.md").read_text()
    for mode in ("dp", "none"):
        documented = re.search(rf"^{mode}:\s+(.*)$", guide, re.M)
        result = launch(["--multi-gpu", mode, "--dry-run"], launcher_env(4), cwd=tmp_path)
        printed = (
            result.stdout.strip()
            .splitlines()[-1]
            .replace(sys.executable, ".venv/bin/python")
            .replace(f"{REPO}/", "")
        )
        assert documented and printed == documented.group(1)


def test_dp_on_a_cpu_machine_falls_back_to_one_process_as_the_trainer_does() -> None:
    # One rule for the launcher and `python main_multi_gpu.py --multi-gpu dp`: no GPU, one CPU process.
    result = launch(["--mode", "dp", "--dry-run"], launcher_env())
    assert result.returncode == 0, result.stderr
    assert "Plan: one CPU process (--multi-gpu dp needs 2 or more GPUs" in result.stderr
    assert result.stdout == f"{shown(sys.executable)} main_multi_gpu.py --multi-gpu dp {training_flags()}\n"


def test_an_explicit_busy_master_port_is_refused_before_torchrun_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = launch(["--master-port", str(port), "--dry-run"], launcher_env())
    assert_one_line_usage_error(result)
    assert f"--master-port {port}: the port is busy" in result.stderr


# --- the dialogue driven by piped answers ---------------------------------------


def test_piped_answers_are_reasked_when_impossible_and_no_ends_without_running() -> None:
    # mode, GPUs (5 of 4, then an unknown id, then ids 1,3), epochs, batch, lr, scaling, confirm
    answers = "ddp\n5\n0,9\n1,3\n2\n16\n0.01\nlinear\nn\n"
    port = free_port()
    result = launch([], launcher_env(gpus=4, LAUNCH_DEFAULT_PORT=str(port)), input=answers)
    assert result.returncode == 0, result.stderr
    assert "  --gpus 5: only 4 GPUs found (ids 0,1,2,3)\n" in result.stderr
    assert "  --gpu-ids 0,9: no GPU with id 9 (found: 0,1,2,3)\n" in result.stderr
    assert result.stderr.count("GPUs: all, a count") == 3
    assert "effective batch 32 = 16 per GPU x 2 GPUs x 1 accumulation step" in result.stderr
    assert f"lr {scaled_lr(0.01, 'linear', 32, 32)!r} = 0.01 x linear(32/32)" in result.stderr
    assert result.stdout == (
        f"{ddp_head(2, port, '1,3')} main_multi_gpu.py --multi-gpu ddp "
        f"{training_flags(2, 16, '0.01', 'linear')}\n"
    )
    assert "Not done" in result.stderr


@pytest.mark.parametrize(
    "answers, head",
    [
        ("ddp\n3,\n", "{ddp1_id3} "),
        ("ddp\n2\n", "{ddp2} "),
        ("dp\n0,2\n", "{python} main_multi_gpu.py --multi-gpu dp --gpu-ids 0,2 "),
        ("4\n2\n", "{ddp2} main_multi_gpu.py --multi-gpu fsdp "),
        ("3\n9\n2\n", "CUDA_VISIBLE_DEVICES=2 {python} main_multi_gpu.py --multi-gpu none "),
        ("single\n\n", "CUDA_VISIBLE_DEVICES=0 {python} main_multi_gpu.py --multi-gpu none "),
    ],
    ids=[
        "ddp-one-id",
        "ddp-count",
        "dp-ids",
        "fsdp-by-number-count",
        "none-by-number-id-reasked",
        "single-by-its-old-name",
    ],
)
def test_piped_gpu_choices_become_the_right_command(answers: str, head: str) -> None:
    port = free_port()
    result = launch([], launcher_env(gpus=4, LAUNCH_DEFAULT_PORT=str(port)), input=answers + "\n\n\n\nn\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        head.format(ddp1_id3=ddp_head(1, port, "3"), ddp2=ddp_head(2, port), python=shown(sys.executable))
    )
    assert "Not done" in result.stderr


def test_piped_answers_that_run_out_stop_the_launcher_and_run_nothing(tmp_path: Path) -> None:
    """As Ctrl-D at a terminal question does (below): only --yes takes the defaults."""
    result = launch([], launcher_env(), cwd=tmp_path, input="ddp\n")
    assert result.returncode == 130, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "launch_multi_gpu.sh: end of input: nothing was run (answer every "
        "question, or give --yes to take the defaults)"
    )
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_piped_answers_drive_a_cpu_ddp_run_on_a_free_port_when_the_default_is_busy(tmp_path: Path) -> None:
    # mode, processes (0 is impossible, then 2), epochs, batch, lr (Enter: default), scaling, confirmation; the
    # last answer has no final newline, and counts all the same.
    answers = "ddp\n0\n2\n1\n32\n\nsqrt\ny"
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_launcher(TINY, launcher_env(LAUNCH_DEFAULT_PORT=str(port)), tmp_path, answers)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Mode [ddp]: ddp" in result.stderr
    assert "  --gpus must be at least 1, got 0\n" in result.stderr
    assert result.stderr.count("CPU processes [2]:") == 2
    assert "Scale the LR for it: linear, sqrt or none [none]: sqrt" in result.stderr
    expected_lr = scaled_lr(DEFAULTS.lr, "sqrt", 64, DEFAULTS.lr_base_batch)
    assert f"lr {expected_lr!r} = {DEFAULTS.lr!r} x sqrt(64/{DEFAULTS.lr_base_batch})" in result.stderr
    command = result.stdout.splitlines()[0]  # then the trainer's output
    found = re.search(r"--master_port=(\d+) ", command)
    assert found, command
    chosen = int(found.group(1))
    assert chosen != port
    assert f"Port {port} is busy: using port {chosen} for the rendezvous." in result.stderr
    # From another directory the trainer is named by its full path.
    assert command.endswith(
        f" --nproc_per_node=2 --master_port={chosen} {REPO}/main_multi_gpu.py --multi-gpu ddp "
        f"{training_flags(1, 32, repr(DEFAULTS.lr), 'sqrt', str(FIRST_RUN))} {' '.join(TINY[1:])}"
    )
    assert "done:" in result.stdout
    save_dir = tmp_path / FIRST_RUN
    assert (save_dir / "last.pt").is_file()
    saved = (save_dir / "launch_command.sh").read_text()
    assert f'{command} "$@"' in saved
    assert f"cd {tmp_path}" in saved


@pytest.mark.slow
def test_a_silent_stdin_pipe_times_out_to_the_defaults_instead_of_hanging(tmp_path: Path) -> None:
    # three answers, then the pipe stays open and says nothing until the launcher is done
    result = run_launcher(
        TINY, launcher_env(LAUNCH_INPUT_TIMEOUT="1"), tmp_path, "single\n1\n32\n", keep_stdin_open=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no answer on standard input within 1s: taking the defaults" in result.stderr
    # the launcher's run folder is numbered in its working directory (tmp_path), not in the checkout
    assert (
        f"main_multi_gpu.py --multi-gpu none {training_flags(1, 32, save_dir=str(FIRST_RUN))} --train-size"
        in result.stdout
    )
    assert (tmp_path / FIRST_RUN / "last.pt").is_file()


# --- nodes ------------------------------------------------------------------------


@pytest.mark.slow
def test_two_launchers_on_one_machine_train_together_as_two_nodes(tmp_path: Path) -> None:
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--gpus",
        "1",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--yes",
    ]
    launchers = []
    try:
        for rank in (0, 1):
            node_dir = tmp_path / f"node{rank}"
            node_dir.mkdir()
            launchers.append(Launcher([*common, "--node-rank", str(rank), *TINY], launcher_env(), node_dir))
    finally:
        deadline = time.monotonic() + RUN_TIMEOUT
        results = [launcher.wait(deadline) for launcher in launchers]
    outputs = [result.stdout + result.stderr for result in results]
    for rank, (result, output) in enumerate(zip(results, outputs)):
        assert result.returncode == 0, f"node {rank}:\n{output[-3000:]}"
        assert (
            f"--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:{port} --rdzv_id=multigpu-{port} "
            f"--rdzv_conf=is_host={int(rank == 0)} "
        ) in result.stdout
        assert "effective batch 64 = 32 per process x 2 processes" in result.stderr
    # One job: exactly one process is global rank 0, reports the run and writes the checkpoints.
    reporting = [rank for rank, output in enumerate(outputs) if "done:" in output]
    assert len(reporting) == 1, outputs
    for rank in (0, 1):
        assert (tmp_path / f"node{rank}" / FIRST_RUN / "last.pt").is_file() == (rank in reporting)


# --- the workers' verdict: their line and their exit status, torchrun's reports in a log ------------


@pytest.mark.slow
def test_a_sigterm_mid_run_stops_cleanly_with_exit_0_and_no_torchrun_traceback(tmp_path: Path) -> None:
    args = [
        "--yes",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--",
        "--train-size",
        "30000",
        "--val-size",
        "64",
        "--mode",
        "flatten",
        "--no-progress",
        "--dist-timeout",
        "60",
        "--log-every",
        "1",
        "--save-every-steps",
        "3",
    ]
    launcher = Launcher(args, launcher_env(), tmp_path)
    save_dir = tmp_path / FIRST_RUN
    deadline = time.monotonic() + RUN_TIMEOUT
    while (
        not list(save_dir.glob("step-*.pt")) and launcher.proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.2)  # polling the file system for the run's first step checkpoint
    launcher.proc.send_signal(signal.SIGTERM)  # the launcher's own pid: it became torchrun
    result = launcher.wait(deadline)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert (
        "checkpoint checkpoints/run-1/last.pt written. Continue with the same command plus --resume auto"
        in output
    )
    assert "Traceback" not in output and "SignalException" not in output
    assert "torchrun's own messages go to checkpoints/run-1/torchrun.log" in result.stderr
    assert "SignalException" in (save_dir / "torchrun.log").read_text()
    assert (save_dir / "last.pt").is_file()


@pytest.mark.slow
def test_ctrl_c_with_the_output_piped_into_a_reader_that_died_still_checkpoints_and_exits_0(
    tmp_path: Path,
) -> None:
    """`bash launch_multi_gpu.sh --yes | tee run.log`, then Ctrl-C: the SIGINT reaches tee too, which dies first.
    The console is best-effort (multigpu/launch/console.py): the checkpoint is written all the same, exit 0.

    dill is installed here (requirements.txt), as Hugging Face datasets brings it; torch then imports it in
    torchrun's process, and torchrun.py's log redirection must cope with the log handler dill adds."""
    import importlib.util

    assert importlib.util.find_spec("dill") is not None, (
        "dill (requirements.txt, tests only) is not installed"
    )
    args = [
        "--yes",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--",
        "--train-size",
        "30000",
        "--val-size",
        "64",
        "--mode",
        "flatten",
        "--no-progress",
        "--dist-timeout",
        "60",
        "--log-every",
        "1",
    ]
    launcher = Launcher(args, launcher_env(), tmp_path, read_stdout=False)  # read here, as tee reads it
    assert launcher.proc.stdout is not None  # a pipe
    first_step = next(
        (line for line in iter(launcher.proc.stdout.readline, "") if line.startswith("step ")), None
    )
    launcher.proc.stdout.close()  # the reader dies, then the Ctrl-C reaches the launcher's process group
    if first_step is not None:
        os.killpg(launcher.proc.pid, signal.SIGINT)
    result = launcher.wait(time.monotonic() + RUN_TIMEOUT)
    assert first_step is not None, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / FIRST_RUN / "last.pt").is_file()
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr


def test_bad_input_found_by_the_workers_is_their_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_launcher(
        ["--yes", "--epochs", "1", "--", "--dataset", "mnist", "--data-dir", "nowhere", "--no-progress"],
        launcher_env(),
        tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    run_lines = (
        result.stderr.split("Saved as checkpoints/run-1/launch_command.sh\n", 1)[1].strip().splitlines()
    )
    assert len(run_lines) == 1 and run_lines[0].startswith("error: --dataset mnist: files not found"), (
        run_lines
    )
    assert "ChildFailedError" in (tmp_path / FIRST_RUN / "torchrun.log").read_text()


# --- a real terminal ---------------------------------------------------------------


class Tmux:
    """A tmux server of our own (private socket) with one wide pane."""

    def __init__(self, directory: Path) -> None:
        self.socket = str(directory / "tmux.sock")
        env = {**os.environ, "TERM": os.environ.get("TERM") or "xterm-256color"}
        env.pop("TMUX", None)
        self.env = env
        self.tmux(
            "new-session",
            "-d",
            "-s",
            "launch",
            "-x",
            "250",
            "-y",
            "50",
            "-c",
            str(directory),
            "bash --norc --noprofile",
        )

    def tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", self.socket, *args],
            env=self.env,
            text=True,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout

    def type(self, text: str) -> None:
        if text:
            self.tmux("send-keys", "-t", "launch", "-l", text)
        self.tmux("send-keys", "-t", "launch", "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-t", "launch", "-S", "-500")

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 60) -> str:
        """Poll the pane until `pattern` (a regex) shows up `count` times; fail at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if len(re.findall(pattern, screen)) >= count:
                return screen
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{pattern!r} did not appear {count}x within {timeout}s; the pane shows:\n{screen}"
                )
            time.sleep(0.1)

    def launch(self, args: str, env: str = "") -> None:
        """Type the launcher's command line (CPU only), then one that shows its exit status: LAUNCH_EXIT=N."""
        self.type(
            f"CUDA_VISIBLE_DEVICES= PYTHON={shlex.quote(sys.executable)} {env} bash {shlex.quote(str(LAUNCHER))} "
            f"{args}; echo LAUNCH_EXIT=$?"
        )

    def close(self) -> None:
        subprocess.run(
            ["tmux", "-S", self.socket, "kill-server"], env=self.env, capture_output=True, timeout=30
        )


@contextlib.contextmanager
def terminal(prefix: str) -> Iterator[tuple[Tmux, Path]]:
    """A real terminal (tmux) whose shell works in a new directory, both gone afterwards."""
    directory = Path(
        tempfile.mkdtemp(prefix=prefix)
    )  # short: tmux socket paths are limited to ~100 characters
    term = Tmux(directory)
    try:
        yield term, directory
    finally:
        term.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed; the real-terminal test needs it"
)
def test_a_terminal_session_shows_the_prompts_reasks_wrong_answers_and_launches() -> None:
    with terminal("launch-tty-") as (term, directory):
        term.launch(" ".join(TINY), env="OMP_NUM_THREADS=1")
        term.wait_for(r"Mode \[ddp\]: ")
        term.type("tpu")  # no such mode
        term.wait_for(r"--multi-gpu must be one of")
        term.wait_for(r"Mode \[ddp\]: ", count=2)
        term.type("2")  # none (one process), by its menu number (the piped test runs DDP)
        term.wait_for(r"Epochs \[\d+\]: ")
        term.type("many")
        term.wait_for(r"argument --epochs: invalid int value: 'many'")
        term.wait_for(r"Epochs \[\d+\]: ", count=2)
        term.type("1")
        for prompt, answer in [
            (r"Batch size per process \[\d+\]: ", "16"),
            (r"Base learning rate .*\]: ", ""),
            (r"Scale the LR .*\]: ", "linear"),
            (r"Run it\? \(y/n\) \[y\]: ", "maybe"),
        ]:
            term.wait_for(prompt)
            term.type(answer)
        term.wait_for(r"'maybe': answer y or n")
        term.type("y")
        screen = term.wait_for(r"LAUNCH_EXIT=\d+", timeout=RUN_TIMEOUT)
        assert "LAUNCH_EXIT=0" in screen, screen
        assert "No CUDA GPU found" in screen
        assert f"lr {scaled_lr(DEFAULTS.lr, 'linear', 16, DEFAULTS.lr_base_batch)!r}" in screen
        assert "done:" in screen
        assert (directory / FIRST_RUN / "last.pt").is_file()
        assert (directory / FIRST_RUN / "launch_command.sh").is_file()


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed; the real-terminal test needs it"
)
def test_ctrl_d_at_the_first_terminal_question_runs_nothing() -> None:
    with terminal("launch-eof-") as (term, directory):
        term.launch(" ".join(TINY))
        term.wait_for(r"Mode \[ddp\]: ")
        term.tmux("send-keys", "-t", "launch", "C-d")
        screen = term.wait_for(r"LAUNCH_EXIT=\d+")
        assert (
            "LAUNCH_EXIT=130" in screen and "launch_multi_gpu.sh: end of input: nothing was run" in screen
        ), screen
        assert not (directory / "checkpoints").exists()


# --- lint ----------------------------------------------------------------------------


@needs_shellcheck
def test_launcher_and_the_other_shell_scripts_pass_shellcheck() -> None:
    scripts = [
        LAUNCHER,
        FAKE_BIN / "nvidia-smi",
        REPO / ".ci" / "run",
        *sorted((REPO / "scripts").glob("*.sh")),
    ]
    shellcheck = shellcheck_path()
    assert shellcheck is not None  # needs_shellcheck
    result = subprocess.run(
        [shellcheck, "--severity=style", *map(str, scripts)],
        text=True,
        capture_output=True,
        timeout=DRY_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout


# --- a save-dir that holds another run -------------------------------------------


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed; the real-terminal test needs it"
)
@pytest.mark.parametrize(
    "answer, expected",
    [
        ("c", "--save-dir {dir} --resume auto"),
        ("o", "--save-dir {dir} --overwrite"),
        ("", "--save-dir {dir}-2"),
    ],
)
def test_a_save_dir_with_checkpoints_asks_to_continue_start_anew_or_overwrite(
    answer: str, expected: str
) -> None:
    with terminal("launch-held-") as (term, directory):
        (directory / "old").mkdir()
        (directory / "old" / "last.pt").write_bytes(b"a run's checkpoint")
        term.launch("--dry-run --save-dir old")
        for prompt, reply in [
            (r"Mode \[ddp\]: ", ""),
            (r"CPU processes \[\d+\]: ", ""),
            (r"Epochs \[\d+\]: ", ""),
            (r"Batch size per process \[\d+\]: ", ""),
            (r"Base learning rate .*\]: ", ""),
            (r"Scale the LR .*\]: ", ""),
        ]:
            term.wait_for(prompt)
            term.type(reply)
        term.wait_for(r"old holds another run's checkpoints \(last.pt\)")
        term.wait_for(
            r"Continue that run \(c\), start in a new folder old-2 \(n\), or overwrite it \(o\)\? \[n\]: "
        )
        term.type(answer)
        screen = term.wait_for(r"LAUNCH_EXIT=\d+")
        assert "LAUNCH_EXIT=0" in screen and expected.format(dir="old") in screen, screen
        assert (directory / "old" / "last.pt").read_bytes() == b"a run's checkpoint"


def test_resume_auto_without_save_dir_names_the_run_the_trainer_would_continue(tmp_path: Path) -> None:
    for number, lr in ((1, 0.001), (2, 0.5)):  # run-2, the newest, was trained with another LR
        (tmp_path / "checkpoints" / f"run-{number}").mkdir(parents=True)
        torch.save(
            {"config": TrainConfig(lr=lr).to_dict()}, tmp_path / "checkpoints" / f"run-{number}" / "last.pt"
        )
    result = launch(["--yes", "--dry-run", "--", "--resume", "auto"], launcher_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--save-dir checkpoints/run-1 --resume auto" in result.stdout.splitlines()[-1]
    refused = launch(
        ["--yes", "--dry-run", "--lr", "0.2", "--", "--resume", "auto"], launcher_env(), cwd=tmp_path
    )
    assert_one_line_usage_error(refused)
    assert "the newest, checkpoints/run-2, differs in lr: 0.5 -> 0.2" in refused.stderr


def test_with_yes_a_save_dir_with_checkpoints_gives_way_to_a_new_folder(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "best.pt").write_bytes(b"a better model")
    result = launch(["--yes", "--dry-run", "--save-dir", "old"], launcher_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("--save-dir old-2")
    assert (tmp_path / "old" / "best.pt").read_bytes() == b"a better model" and not (
        tmp_path / "old-2"
    ).exists()


# ---------------------------------------------------------------- LoRA (--lora-r, --qlora)
LANGUAGE_MODEL = [
    "--",
    "--dataset",
    "hf",
    "--data-files",
    "lm/train.jsonl",
    "--text-column",
    "text",
    "--model",
    "hf",
]


@pytest.mark.parametrize(
    "answers, flags",
    [
        ("8\nyes\n", "--lora-r 8 --qlora "),
        ("4\n\n", "--lora-r 4 --dataset"),
        ("\n", "--save-dir checkpoints/run-1 --dataset"),
    ],
    ids=["qlora", "lora", "every weight"],
)
def test_a_language_model_folder_is_asked_about_lora_and_the_answers_are_the_commands(
    tmp_path: Path, answers: str, flags: str
) -> None:
    result = launch(
        [*LANGUAGE_MODEL, "--model-path", "lm/model"],
        launcher_env(),
        cwd=tmp_path,
        input=f"none\n1\n8\n\n\n{answers}n\n",
    )
    assert result.returncode == 0, result.stderr
    assert "LoRA adapters' rank, e.g. 8 (0: fine-tune every weight) [0]: " in result.stderr
    assert ("Load the base in 4-bit, QLoRA (yes/no) [no]: " in result.stderr) == (
        flags != "--save-dir checkpoints/run-1 --dataset"
    )
    assert flags in result.stdout


def test_lora_is_not_asked_of_other_models_nor_where_given(tmp_path: Path) -> None:
    untrained = launch(
        [*LANGUAGE_MODEL, "--model-config", "lm/model", "--tokenizer", "lm"],
        launcher_env(),
        cwd=tmp_path,
        input="none\n1\n8\n\n\nn\n",
    )
    given = launch(
        ["--dry-run", "--lora-r", "2", "--qlora", "--gpus", "1", *LANGUAGE_MODEL, "--model-path", "lm/model"],
        launcher_env(),
        cwd=tmp_path,
    )
    for result in (untrained, given):
        assert result.returncode == 0, result.stderr
        assert "LoRA adapters' rank" not in result.stderr
    assert (
        "  LoRA adapters of rank 2 train, the base frozen, the base's linear layers in 4-bit NF4 (QLoRA)"
        in given.stderr
    )
    assert "--lora-r 2 --qlora " in given.stdout
