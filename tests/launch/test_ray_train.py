"""main_multi_gpu.py --ray-workers N: the training as Ray Train workers, inside the process group Ray makes.

Every real run goes to one local Ray instance with 2 CPUs, started once for the whole session (`ray_head`: `ray
start --head --block` on loopback ports, ended with its processes at the end), as a user's runs go to their
cluster; each run is a driver of its own (`python main_multi_gpu.py ... --ray-address`). Two workers train to
weights bit-identical to `torchrun --nproc_per_node=2` with the same flags, rank 0 alone speaks and writes, and a
worker SIGKILLed mid-run (the fault injector) is restarted by Ray and the run ends where the uninterrupted one
ends. Bad input is one line and exit 2, most of it before Ray starts (checked in this process).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_launch_multi_gpu import launch, launcher_env

import main_multi_gpu
from conftest import PYTHON, REPO, RUN_TIMEOUT, cli_env, free_port, run_cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the [ray] extra (ray[train]) is not installed"
)

# Ray's own settings for the tests: no usage report (no network here), no token file, every address loopback
# (Ray otherwise advertises the machine's network address), and every worker's line shown (Ray merges identical
# lines of several workers into one, which would hide a second rank's output).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_DEDUP_LOGS": "0",
    # Ray Train gives up on a worker group that took 60 s to start and starts another, which on a loaded 2-core
    # machine takes as long again: let a slow start finish.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "240",
}
HEAD_START_SECONDS = 120
# 512 samples, 2 x 32 per step: 8 steps, a checkpoint every 2. TRAINING: what the launcher passes on after `--`.
TRAINING = [
    "--train-size",
    "512",
    "--val-size",
    "100",
    "--no-progress",
    "--dist-timeout",
    "60",
    "--save-every-steps",
    "2",
]
RUN = [
    *TRAINING,
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--multi-gpu",
    "ddp",
    "--lr",
    "0.001",
    "--lr-scaling",
    "none",
]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="session")
def ray_head() -> Iterator[str]:
    """A local Ray cluster of 2 CPUs for every Ray test of the session; its address, HOST:PORT."""
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's sockets live here: a short path
    port = free_port()
    command = [
        str(Path(PYTHON).parent / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=2",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={folder}",
        "--object-store-memory=100000000",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    head = subprocess.Popen(
        command,
        env=cli_env(RAY_ENV),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its processes are one group: ended together, and only they
    )
    started = threading.Event()
    said: list[str] = []

    def read() -> None:
        assert head.stdout is not None  # a pipe
        for line in head.stdout:
            said.append(line)
            if "Ray runtime started" in line:
                started.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + HEAD_START_SECONDS
        while not started.wait(0.2):
            assert head.poll() is None and time.monotonic() < deadline, "".join(said)[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        end_session(head)
        shutil.rmtree(folder, ignore_errors=True)


def end_session(head: subprocess.Popen) -> None:
    """End the head and every process of its session, all started by it (Ray puts each worker in a process group
    of its own, so the head's group alone would leave them running): SIGTERM, then SIGKILL what is left."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_processes(head.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + 5
        while [pid for pid in session_processes(head.pid) if pid != head.pid] or head.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)  # polling the processes' end: they are not our children
    head.wait()


def session_processes(session: int) -> list[int]:
    """The processes of a session (Linux /proc: the sixth field of /proc/PID/stat, after the command's name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            if int(fields[3]) == session:
                found.append(int(entry.name))
    return found


def on_ray(address: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A driver: `main_multi_gpu.py --ray-workers 2 --ray-address ADDRESS ARGS`, its output without colours."""
    driver = subprocess.Popen(
        [PYTHON, str(REPO / "main_multi_gpu.py"), "--ray-workers", "2", "--ray-address", address, *args],
        cwd=REPO,
        env=cli_env({**RAY_ENV, **(env or {})}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = driver.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        driver.kill()  # Ray ends the run of a driver that is gone
        stdout, stderr = driver.communicate()
        pytest.fail(f"the driver ran past {RUN_TIMEOUT} s:\n{ANSI.sub('', stdout + stderr)[-5000:]}")
    return subprocess.CompletedProcess(
        driver.args, driver.returncode, ANSI.sub("", stdout), ANSI.sub("", stderr)
    )


def final_weights(save_dir: Path) -> dict[str, Any]:
    return torch.load(save_dir / "last.pt", weights_only=True)["model"]


def assert_same_weights(save_dir: Path, reference: Path) -> None:
    weights, expected = final_weights(save_dir), final_weights(reference)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def step_lines(output: str) -> list[str]:
    """The trainer's step lines as Ray forwards them: "(RayTrainWorker pid=N) step 2: ...", or without the
    prefix where Ray's logging configuration leaves it out."""
    return re.findall(r"^(?:\(RayTrainWorker pid=\d+(?:, ip=[^)]*)?\) )?(step \d+:.*)$", output, re.M)


# --- bad input: one line, exit 2, in this process (no Ray started) ----------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ray-workers", "0"], "--ray-workers must be at least 1, got 0"),
        (["--ray-workers", "two"], "--ray-workers must be a whole number, got 'two'"),
        (["--ray-address", "head:6379"], "--ray-address is for a run on Ray: add --ray-workers N"),
        (
            ["--ray-workers", "2", "--ray-gpus-per-worker", "2"],
            "--ray-gpus-per-worker must be at most 1, got 2",
        ),
        (["--ray-workers", "2", "--ray-max-failures", "-1"], "--ray-max-failures must be at least 0, got -1"),
        (
            ["--ray-workers", "2", "--ray-address", "head"],
            "--ray-address head: expected HOST:PORT of the Ray head",
        ),
        (["--ray-workers", "2", "--multi-gpu", "dp"], "--multi-gpu dp trains in one process"),
        (
            [
                "--ray-workers",
                "2",
                *"--fault-tolerance --ft-replica-groups 2 --ft-replica-id 0 --save-dir r".split(),
            ],
            "--fault-tolerance with --ray-workers: Ray restarts lost workers itself",
        ),
        (
            ["--ray-workers", "2", "--epochs", "-1"],
            "--epochs",
        ),  # the training flags, checked before Ray starts
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_ray_flags_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_multi_gpu.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_an_address_nobody_answers_at_is_said_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main_multi_gpu.main(["--ray-workers", "2", "--ray-address", nobody]) == 2
    assert time.monotonic() - started < 10  # ray.init would retry it for minutes
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--ray-address {nobody}: no Ray cluster answers there" in err, err


def test_without_ray_the_line_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` then fails as when it is not installed
    assert main_multi_gpu.main(["--ray-workers", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "--ray-workers needs Ray Train" in err and "pip install '.[ray]'" in err
    ), err


@pytest.mark.slow
def test_more_workers_than_the_cluster_holds_is_one_line_not_a_wait(ray_head: str, tmp_path: Path) -> None:
    result = on_ray(ray_head, "--ray-workers", "3", "--save-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --ray-workers 3: the Ray cluster has 2 CPUs and 0 GPUs, and the workers need 3 CPUs (1 CPU each); "
        "give fewer workers or a larger cluster"
    )


# --- real runs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(ray_head: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Two Ray workers through the whole run, started by `launch_multi_gpu.sh --ray`: its save-dir and output."""
    save_dir = tmp_path_factory.mktemp("ray") / "run"
    args = ["--ray", "--yes", "--gpus", "0", "--nproc", "2", "--ray-address", ray_head, "--epochs", "1"]
    args += ["--batch-size", "32", "--save-dir", str(save_dir), "--", *TRAINING]
    result = launch(args, {**launcher_env(), **RAY_ENV}, cwd=REPO, timeout=RUN_TIMEOUT)
    output = ANSI.sub("", result.stdout + result.stderr)
    assert result.returncode == 0, output[-4000:]
    # What the launcher printed, saved and ran: main_multi_gpu.py --ray-workers 2 with the run's flags.
    command = f"main_multi_gpu.py --ray-workers 2 --ray-address {ray_head} --ray-gpus-per-worker 0 "
    assert (
        command in result.stdout.splitlines()[0] and command in (save_dir / "launch_command.sh").read_text()
    )
    return save_dir, output


@pytest.mark.slow
def test_two_ray_workers_train_as_torchrun_with_two_processes(
    uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    save_dir, output = uninterrupted
    reference = tmp_path / "torchrun"
    torchrun = run_cli([*RUN, "--save-dir", str(reference)], nproc=2)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert_same_weights(save_dir, reference)
    # Rank 0 alone speaks: every trainer line comes from one worker, the run's summary once.
    steps = [line.split(":")[0] for line in step_lines(output)]
    assert steps and len(steps) == len(set(steps)), output[-3000:]  # each step said once: by one worker
    assert output.count("done: best val acc") == 1, output[-3000:]
    assert "mode ddp: 2 processes, backend gloo" in output
    # The same files in the save-dir as under torchrun, besides Ray's own folder and the launcher's command.
    assert sorted(
        path.name for path in save_dir.iterdir() if path.name not in ("ray", "launch_command.sh")
    ) == sorted(path.name for path in reference.iterdir())
    assert list((save_dir / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_restarted_by_ray_and_ends_as_the_uninterrupted_run(
    ray_head: str, uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    save_dir = tmp_path / "run"
    result = on_ray(
        ray_head,
        *RUN,
        "--save-dir",
        str(save_dir),
        "--ray-max-failures",
        "1",
        env={
            "MULTIGPU_FAULT_INJECT": "1:3"
        },  # rank 1 SIGKILLs itself after step 3, on the first attempt only
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # Ray ends the group as soon as it sees the dead worker: rank 0 may or may not write its step 3 first.
    assert re.search(
        rf"resumed from {re.escape(str(save_dir))}/step-00000000[23]\.pt: epoch 1, step [23]", output
    ), output[-4000:]
    assert output.count("done: best val acc") == 1
    assert_same_weights(save_dir, uninterrupted[0])
    # Ray's and Ray Train's own lines kept to warnings; the resumed run judged from the run's first loss.
    assert not re.search(r"Traceback|PlacementGroupCleaner|\(TrainController|warning: the run", output), (
        output
    )


@pytest.mark.slow
def test_a_worker_killed_without_restarts_is_one_line_naming_it_its_exit_and_the_resume_command(
    ray_head: str, tmp_path: Path
) -> None:
    save_dir = tmp_path / "run"
    result = on_ray(ray_head, *RUN, "--save-dir", str(save_dir), env={"MULTIGPU_FAULT_INJECT": "1:3"})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    resume = shlex.join(
        ["python", "main_multi_gpu.py", "--ray-workers", "2", "--ray-address", ray_head, *RUN]
        + ["--save-dir", str(save_dir), "--resume", "auto"]
    )
    # Ray ends the group at the first failure its poll of the workers finds: rank 0's own end (it stops on
    # losing rank 1) is in Ray's failures, and so in the line, only when that poll came after it.
    assert re.fullmatch(
        r"error: the run on Ray failed: worker rank 1 \(pid \d+\) died: its process ended without an exit "
        r"status of its own \((\w+, )?killed by a signal or the OOM killer, or crashed\)"
        r"( \(rank 0 ended after it\))?; Ray gave up on it \(--ray-max-failures 0\): "
        r"continue from the newest checkpoint with: " + re.escape(resume),
        result.stderr.strip().splitlines()[-1],
    ), result.stderr[-3000:]
    # Besides rank 0's own two lines (the lost rank, its last step's checkpoint): at most Ray's own two warnings
    # of a dead worker process, no traceback, no line of Ray Train's machinery.
    assert len(result.stderr.strip().splitlines()) <= 5, result.stderr
    assert not re.search(r"Traceback|PlacementGroupCleaner|\(TrainController", output), output
    newest = max(save_dir.glob("step-*.pt"))  # rank 0 may or may not write step 3 before Ray ends it
    assert torch.load(newest, weights_only=True)["global_step"] == int(newest.stem.split("-")[1])
