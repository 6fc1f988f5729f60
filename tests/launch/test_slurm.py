"""launch_multi_gpu.sh --slurm: the job script it writes, and that script run by a real SLURM.

The dry runs check the script's text for 1 and 2 nodes. The real test submits it
to a single-node SLURM cluster of our own (the `slurm_cluster` fixture: munged,
slurmctld and slurmd as root on free ports), for 2 CPU processes (gloo): a
SIGUSR1 before the time limit checkpoints and requeues it, the requeued job
resumes; `scancel --signal=TERM` stops it with a checkpoint, and a resubmission
of the same script finishes the run.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster
from test_launch_multi_gpu import REPO, dry_run_save_dir, launch, launcher_env

DRY = ["--slurm", "--dry-run", "--yes"]
JOB_TIMEOUT = 240  # seconds for one job segment; each takes well under a minute here


def script_of(result) -> str:
    """The script a dry run printed, its continued lines joined."""
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n")
    return re.sub(r" *\\\n *", " ", result.stdout)


def test_one_gpu_node_script_asks_slurm_for_one_task_with_its_gpus_and_requeues() -> None:
    script = script_of(
        launch(
            [
                *DRY,
                "--gpus",
                "4",
                "--partition",
                "gpu",
                "--time",
                "04:00:00",
                "--account",
                "proj",
                "--max-restarts",
                "2",
                "--",
                "--amp",
                "bf16",
            ],
            launcher_env(gpus=4),
        )
    )
    for directive in [
        "--nodes=1",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--cpus-per-task=20",
        "--partition=gpu",
        "--time=04:00:00",
        "--account=proj",
        "--requeue",
        "--signal=B:USR1@120",
        f"--output={dry_run_save_dir()}/slurm-%j.out",
        "--open-mode=append",
    ]:
        assert f"\n#SBATCH {directive}\n" in script, directive
    # Every $SLURM_* is left for the job to read; the rendezvous is c10d on the allocation's first node.
    assert (
        'RDZV_ENDPOINT=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$((20000 + SLURM_JOB_ID '
        "% 20000))" in script
    )
    assert (
        '--nnodes="$SLURM_NNODES" --nproc_per_node="$PROCS_PER_NODE" --rdzv_backend=c10d '
        '--rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="$SLURM_JOB_ID" --rdzv_conf=is_host=$((SLURM_NODEID == 0)) '
        "--max_restarts=2"
    ) in script
    assert "NODES=1 GPUS_PER_NODE=4 PROCS_PER_NODE=4" in script
    assert f"{REPO}/main_multi_gpu.py --multi-gpu ddp --epochs 3 " in script
    assert script.rstrip().splitlines()[-1] == 'exit "$status"'
    assert "--resume auto --amp bf16" in script
    assert "srun --kill-on-bad-exit=1" in script
    assert "trap 'requeue=1; scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1" in script
    assert '[[ ${SLURM_GPUS_ON_NODE:-0} == "$GPUS_PER_NODE" ]] ||' in script  # pre-flight, before torchrun
    assert "shared-check" not in script  # one node: nothing to share


def test_two_node_script_checks_the_allocation_and_that_the_save_dir_is_shared(tmp_path: Path) -> None:
    script = script_of(
        launch([*DRY, "--nnodes", "2", "--gpus", "8", "--save-dir", "/shared/run1"], launcher_env())
    )  # a login node without GPUs writes for GPU nodes
    assert "\n#SBATCH --nodes=2\n" in script and "\n#SBATCH --gpus-per-node=8\n" in script
    assert "NODES=2 GPUS_PER_NODE=8 PROCS_PER_NODE=8" in script
    assert '[[ $SLURM_JOB_NUM_NODES == "$NODES" ]] ||' in script
    assert 'srun --nodes="$NODES" --ntasks-per-node=1 test -e "$marker"' in script
    assert "SAVE_DIR=/shared/run1" in script and "\n#SBATCH --output=/shared/run1/slurm-%j.out\n" in script
    pre_flight, run = script.split("run_node() {")
    assert "$SLURM_NODEID" not in pre_flight  # differs between nodes: read in run_node, on each node
    assert "is_host=$((SLURM_NODEID == 0))" in run
    assert not (tmp_path / "shared").exists()


def test_an_fsdp_script_for_two_nodes_runs_the_hybrid_layout() -> None:
    result = launch(
        [*DRY, "--multi-gpu", "fsdp", "--nnodes", "2", "--gpus", "8", "--save-dir", "/shared/run1"],
        launcher_env(),
    )
    script = script_of(result)
    assert f"{REPO}/main_multi_gpu.py --multi-gpu fsdp --dp-replicate 2 --dp-shard 8 --epochs 3 " in script
    assert "# 2 nodes x 8 GPUs, FSDP under torchrun" in script
    assert (
        "Plan: SLURM job, 2 nodes x 8 GPUs, FSDP, hybrid: mesh replicate 2 x shard 8 (shard within each node, "
        "replicate across the nodes) with c10d rendezvous on the first node"
    ) in result.stderr


def test_a_cpu_only_script_runs_gloo_processes_without_asking_for_gpus() -> None:
    script = script_of(launch([*DRY, "--gpus", "0", "--nproc", "3"], launcher_env()))
    assert "--gpus-per-node" not in script and "SLURM_GPUS_ON_NODE" not in script
    assert "NODES=1 GPUS_PER_NODE=0 PROCS_PER_NODE=3" in script and "\n#SBATCH --cpus-per-task=3\n" in script


def wait_for_output(path: Path, pattern: str, timeout: float, after: str = "") -> str:
    """Poll a job's output file until `pattern` shows up (after the last `after`, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if re.search(
            pattern, text.rsplit(after, 1)[-1] if after and after in text else ("" if after else text)
        ):
            return text
        assert time.monotonic() < deadline, f"{pattern!r} not in {path} after {timeout}s:\n{text[-3000:]}"
        time.sleep(0.3)  # polling the job's output file


@pytest.mark.slow
def test_a_real_slurm_job_trains_requeues_stops_with_a_checkpoint_and_resumes(
    tmp_path: Path, slurm_cluster: SlurmCluster
) -> None:
    env = launcher_env(SLURM_CONF=slurm_cluster.env["SLURM_CONF"])
    args = [
        "--slurm",
        "--submit",
        "--yes",
        "--gpus",
        "0",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--save-dir",
        "run",
        "--",
        "--train-size",
        "4000",
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
        "50",
    ]
    submitted = launch(args, env, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job = slurm_cluster.track(submitted.stdout.splitlines()[-1])
    out = tmp_path / "run" / f"slurm-{job}.out"
    assert "Saved as run/launch_slurm.sbatch" in submitted.stderr

    # SLURM's warning before the time limit (SIGUSR1 to the batch script): checkpoint, requeue, resume.
    wait_for_output(out, r"step \d+: loss", JOB_TIMEOUT)
    slurm_cluster.signal(job, "USR1", batch=True)
    text = wait_for_output(out, r"step \d+: loss", JOB_TIMEOUT, after="resumed from run/last.pt")
    assert "requeueing job" in text and re.search(
        r"stopped by SIGTERM at step \d+; checkpoint run/last.pt written", text
    )
    assert slurm_cluster.job(job)["Restarts"] == "1"

    # scancel --signal=TERM mid-run: every process gets it (torchrun forwards it too); one clean stop, exit 0.
    stops = text.count("stopped by SIGTERM")
    slurm_cluster.signal(job, "TERM")
    fields = slurm_cluster.wait(job, JOB_TIMEOUT)
    text = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-3000:]
    assert text.count("stopped by SIGTERM") == stops + 1 and "second SIGTERM" not in text
    assert "Traceback" not in text and "done:" not in text

    # The same script again continues from that checkpoint and finishes.
    again = slurm_cluster.submit(tmp_path / "run" / "launch_slurm.sbatch", cwd=tmp_path)
    fields = slurm_cluster.wait(again, JOB_TIMEOUT)
    text = (tmp_path / "run" / f"slurm-{again}.out").read_text()
    assert fields["JobState"] == "COMPLETED", text[-3000:]
    assert "resumed from run/last.pt" in text and "done: best val acc" in text and "Traceback" not in text
    assert (tmp_path / "run" / "best.pt").is_file()
    assert (tmp_path / "run" / f"torchrun-{slurm_cluster.node}.log").is_file()


def test_the_pre_flight_check_refuses_an_allocation_the_script_was_not_written_for(
    tmp_path: Path, slurm_cluster: SlurmCluster
) -> None:
    env = launcher_env(SLURM_CONF=slurm_cluster.env["SLURM_CONF"])
    written = launch(
        ["--slurm", "--yes", "--nnodes", "2", "--gpus", "0", "--save-dir", str(tmp_path / "run")],
        env,
        cwd=tmp_path,
    )
    assert written.returncode == 0, written.stderr
    job = slurm_cluster.submit(tmp_path / "run" / "launch_slurm.sbatch", "--nodes=1", cwd=tmp_path)
    fields = slurm_cluster.wait(job, JOB_TIMEOUT)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0"
    assert (tmp_path / "run" / f"slurm-{job}.out").read_text() == (
        f"launch_slurm.sbatch: written for 2 node(s), SLURM gave 1 ({slurm_cluster.node}); do not override --nodes\n"
    )
