"""TensorBoard output as users see it: the real tensorboard server reading a real run's log dir."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    PYTHON,
    REPO,
    RUN_TIMEOUT,
    TINY,
    assert_ok,
    cli_command,
    cli_env,
    event_files,
    file_size_limit,
    read_scalars,
    run_cli,
)

TAGS = {"train/loss", "train/lr", "train/samples_per_sec", "val/loss", "val/acc"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def wait_for_tags(base: str, server: subprocess.Popen, deadline_s: float = 90) -> dict:
    """Poll the scalars plugin until the run's tags are served (the server loads logs in the background)."""
    deadline = time.monotonic() + deadline_s
    last_error = None
    while time.monotonic() < deadline:
        assert server.poll() is None, f"tensorboard exited: {server.stderr.read() if server.stderr else ''}"
        try:
            tags = get_json(f"{base}/data/plugin/scalars/tags")
            if any(TAGS <= set(run_tags) for run_tags in tags.values()):
                return tags
        except OSError as error:  # not listening yet
            last_error = error
        time.sleep(0.5)  # polling interval of a deadline loop, not a guess at readiness
    raise AssertionError(f"tensorboard never served the tags ({last_error})")


@pytest.mark.slow
def test_tensorboard_server_serves_the_runs_scalars(tmp_path: Path):
    log_dir = tmp_path / "tb"
    assert_ok(
        run_cli(
            [
                "--mode",
                "flatten",
                "--epochs",
                "2",
                "--log-every",
                "4",
                *TINY,
                "--save-dir",
                str(tmp_path / "ckpt"),
                "--log-dir",
                str(log_dir),
            ]
        )
    )
    assert len(event_files(log_dir)) == 1
    port = free_port()
    server = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(log_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        tags = wait_for_tags(base, server)
        (run,) = tags  # one run: rank 0 is the only writer
        query = urllib.parse.urlencode({"run": run, "tag": "train/loss"})
        served = [(step, value) for _, step, value in get_json(f"{base}/data/plugin/scalars/scalars?{query}")]
        on_disk = sorted(read_scalars(log_dir)["train/loss"])
        assert len(served) == len(on_disk) == 8  # 512 samples / 32 = 16 steps, logged every 4
        assert [step for step, _ in served] == [step for step, _ in on_disk]
        assert [value for _, value in served] == [value for _, value in on_disk]
        request = urllib.request.Request(
            f"{base}/data/plugin/hparams/experiment",
            data=b'{"experimentName": ""}',
            headers={"Content-Type": "application/json"},
        )
        experiment = json.load(urllib.request.urlopen(request, timeout=10))
        names = {info["name"] for info in experiment["hparamInfos"]}
        assert {"batch_size", "grad_accum_steps", "multi_gpu", "lr"} <= names  # the config, as hparams
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_tensorboard_write_that_fails_mid_run_is_one_line_and_exit_1(tmp_path: Path):
    log_dir = tmp_path / "tb"
    # Files may not grow past 66 KiB: the 64 KiB start-up probe passes, the event file outgrows it mid-run
    # (--allow-low-disk: a checkpoint would not fit either, which the start refuses otherwise).
    result = subprocess.run(
        cli_command(
            [
                "--mode",
                "flatten",
                "--epochs",
                "1",
                "--train-size",
                "16384",
                "--val-size",
                "32",
                "--batch-size",
                "16",
                "--log-every",
                "1",
                "--no-progress",
                "--allow-low-disk",
                "--save-dir",
                str(tmp_path / "ckpt"),
                "--log-dir",
                str(log_dir),
            ]
        ),
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        preexec_fn=file_size_limit(66 * 1024),
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"could not write TensorBoard logs to {log_dir}: File too large" in line
    assert (
        read_scalars(log_dir)["train/loss"][0][0] == 1
    )  # what was written before the failure stays readable


@pytest.mark.slow
def test_a_redirected_log_gets_plain_lines_at_the_log_interval_not_the_bar(tmp_path: Path):
    """The progress bar is on by default; with stdout in a file it would leave \\r fragments and blank lines."""
    args = [arg for arg in TINY if arg != "--no-progress"]
    result = run_cli([*args, "--epochs", "1", "--log-every", "4", "--save-dir", str(tmp_path / "ckpt")])
    assert_ok(result)
    assert "\r" not in result.stdout and "" not in result.stdout.splitlines()
    assert [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("step ")] == [
        "step 4",
        "step 8",
        "step 12",
        "step 16",
    ]  # 512 samples / 32: 16 steps


# In a fresh interpreter (this one has imported TensorBoard already): the thread that imported the event file's
# module, seen by an audit hook, and whether that was done before the run's first sync point.
BACKGROUND_IMPORT = """
import sys, tempfile, threading
import torch
sys.path[:0] = [{repo!r}]
from train_multi_gpu import MultiGPUTrainer, TrainConfig
importers = []
sys.addaudithook(lambda event, args: importers.append(threading.current_thread().name)  # the module's code runs
                 if event == "exec" and getattr(args[0], "co_filename", "").endswith("event_file.py") else None)
class FirstStep:
    def on_step_end(self, trainer):
        if trainer.progress.global_step == 1:
            for thread in threading.enumerate():
                if thread.name == "import TensorBoard":
                    thread.join()
            print("imported before the first sync point:", "multigpu.monitoring.event_file" in sys.modules)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
config = TrainConfig(epochs=1, batch_size=8, log_every=4, progress=False, num_workers={workers},
                     save_dir=tempfile.mkdtemp())
MultiGPUTrainer(torch.nn.Linear(16, 4), data, None, config, callbacks=[FirstStep()]).fit()
print("imported by:", importers)
"""


@pytest.mark.slow
def test_tensorboard_is_imported_beside_the_first_steps_only_without_loader_workers():
    for workers, before, importer in ((0, True, "import TensorBoard"), (1, False, "MainThread")):
        done = subprocess.run(
            [PYTHON, "-c", BACKGROUND_IMPORT.format(repo=str(REPO), workers=workers)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            cwd=REPO,
        )
        assert_ok(done)
        assert f"imported before the first sync point: {before}" in done.stdout, done.stdout[-800:]
        assert f"imported by: {[importer]!r}" in done.stdout, done.stdout[-800:]
