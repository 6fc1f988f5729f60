"""torchft's Lighthouse lost mid-run (multigpu/parallel/lighthouse_watch.py, multigpu/engine/replicas.py): the
replica groups, each a real torchrun job of 2 processes, say it in one line each within seconds (their quorum
timeout, --dist-timeout, is 60 s) and end with exit status 1, the newest checkpoint whole. The Lighthouse here
is one of this test's own, not the session's shared one (tests/conftest.py's `lighthouse`): it is killed."""

from __future__ import annotations

import hashlib
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import LIGHTHOUSE_HEARTBEAT_MS, REPO, RUN_TIMEOUT, cli_command, cli_env

QUORUM_TIMEOUT = 60  # --dist-timeout: torchft's quorum timeout, which the line must come well within


def group_command(group: int, lighthouse: str, save_dir: Path) -> list[str]:
    """Replica group `group` of 2, a torchrun job of 2 processes (ddp), training for longer than the test lasts."""
    args = [
        *("--fault-tolerance", "--ft-replica-groups", "2", "--ft-replica-id", str(group)),
        *("--ft-lighthouse", lighthouse, "--save-dir", str(save_dir), "--multi-gpu", "ddp"),
        *("--model", "mlp", "--mode", "flatten", "--image-shape", "1,4,4", "--train-size", "20000"),
        *("--val-size", "32"),
        *("--batch-size", "8", "--epochs", "1", "--no-progress", "--dist-timeout", str(QUORUM_TIMEOUT)),
        *("--save-every-steps", "4", "--log-every", "4"),
    ]
    return cli_command(args, nproc=2, torchrun_args=["--max-restarts=0"])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_lighthouse_killed_mid_run_is_said_in_one_line_by_each_group_and_the_newest_checkpoint_is_whole(
    tmp_path,
):
    pytest.importorskip("torchft", reason="the [ft] extra is not installed: bash scripts/ensure_env.sh ft")
    from multigpu.launch.replica_groups import start_lighthouse

    lighthouse, address = start_lighthouse(
        0, 1, heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_MS, quorum_tick_ms=100, join_timeout_ms=1000
    )
    save_dir = tmp_path / "run"
    logs = [(tmp_path / f"group{group}.out", tmp_path / f"group{group}.err") for group in (0, 1)]
    groups = [
        subprocess.Popen(
            group_command(group, address, save_dir),
            cwd=REPO,
            env=cli_env(),
            stdout=out.open("w"),
            stderr=err.open("w"),
        )
        for group, (out, err) in enumerate(logs)
    ]
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while "step 12:" not in logs[0][0].read_text():  # both groups train: steps commit with both
            assert time.monotonic() < deadline and all(g.poll() is None for g in groups), logs[0][
                1
            ].read_text()
            time.sleep(0.1)  # polling the group's log for its progress
        lighthouse.kill()
        killed = time.monotonic()
        statuses = [group.wait(timeout=QUORUM_TIMEOUT) for group in groups]
        took = time.monotonic() - killed
        checkpoints = {path: sha256(path) for path in save_dir.glob("step-*.pt")}
    finally:
        for group in groups:
            if group.poll() is None:
                group.send_signal(signal.SIGKILL)
                group.wait()
        lighthouse.kill()
        lighthouse.wait()
    assert statuses == [1, 1] and took < QUORUM_TIMEOUT / 4, (statuses, took)
    newest = max(checkpoints)
    for group, (_, err) in enumerate(logs):
        said = [line for line in err.read_text().splitlines() if "lost the Lighthouse" in line]
        assert len(said) == 1, err.read_text()  # rank 0 of the group says it; its rank 1 ends quietly
        assert re.fullmatch(
            rf"error: replica group {group}: lost the Lighthouse at {re.escape(address)}: Connection refused "
            rf"for 3 s while waiting for the quorum of step \d+; the newest checkpoint is {re.escape(str(newest))}: "
            r"start the Lighthouse again, then every group with the same command, and the run continues from it",
            said[0],
        ), said[0]
        assert "SIGTERM while" not in err.read_text()  # its other rank ended without a word
    # Whole: it loads as it was written, at the step its name says, and nothing wrote to it after the ending.
    state = torch.load(newest, weights_only=True)
    assert state["global_step"] == int(newest.stem.split("-")[1])
    assert {path: sha256(path) for path in save_dir.glob("step-*.pt")} == checkpoints
