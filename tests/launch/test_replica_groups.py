"""bash launch_multi_gpu.sh --fault-tolerance (multigpu/launch/replica_groups.py): torchft's Lighthouse and the
replica groups on this machine, their verdict when every group is lost, and the SLURM job of one group per node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import PYTHON, REPO, cli_command, cli_env

LAUNCHER = REPO / "launch_multi_gpu.sh"
TINY_RUN = [
    "--mode",
    "flatten",
    "--image-shape",
    "1,4,4",
    "--train-size",
    "256",
    "--val-size",
    "16",
    "--no-progress",
]


def launch(args: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """The launcher on this CPU-only machine, unattended."""
    environment = cli_env({"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **env})
    return subprocess.run(
        ["bash", str(LAUNCHER), *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


def test_every_group_lost_ends_the_run_with_1_and_resume_auto_continues_it_without_torchft(tmp_path):
    """Both groups SIGKILLed after step 6 (torchrun restarts neither): the launcher's exit status is 1, its line
    names the newest checkpoint (step 4, written by group 0 while both trained), which a plain run continues."""
    save_dir = tmp_path / "run"
    run = [*TINY_RUN, "--save-every-steps", "4", "--dist-timeout", "10"]
    # Each quorum waits for both groups: on a loaded machine a late group was left out of one (and trained on
    # alone), where this test's subject is what follows when every group is lost.
    lost = launch(
        [
            "--fault-tolerance",
            "--replica-groups",
            "2",
            "--max-restarts",
            "0",
            "--yes",
            "--save-dir",
            str(save_dir),
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--",
            *run,
            "--ft-min-replicas",
            "2",
        ],
        timeout=300,
        MULTIGPU_FAULT_INJECT="0:6",
    )
    assert lost.returncode == 1, lost.stdout + lost.stderr
    assert "[group 0] replica group" not in lost.stdout  # both trained every step until the kill
    newest = save_dir / "step-000000004.pt"
    assert (
        f"every replica group ended without finishing the run (group 0: exit 137, group 1: exit 137): the newest "
        f"checkpoint is {newest}" in lost.stderr
    ), lost.stderr
    resumed = subprocess.run(
        cli_command(
            [*run, "--epochs", "2", "--batch-size", "8", "--save-dir", str(save_dir), "--resume", "auto"]
        ),
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {newest}: epoch 1, step 4, 64 samples into the epoch" in resumed.stdout
    assert "resuming 2 ranks' checkpoint with 1" in resumed.stdout  # the groups' data shares, now one process
    assert "done:" in resumed.stdout


def three_groups_on_slurm_nodes(gpus: int, save_dir: Path) -> list[str]:
    """The launcher's flags for a dry run of a SLURM job of 3 replica groups, one per node of `gpus` GPUs."""
    return [
        "--fault-tolerance",
        "--replica-groups",
        "3",
        "--slurm",
        "--gpus",
        str(gpus),
        "--yes",
        "--dry-run",
        "--save-dir",
        str(save_dir),
    ]


def test_the_slurm_job_runs_one_group_per_node_and_the_lighthouse_on_the_first(tmp_path):
    save_dir = tmp_path / "shared" / "run"
    job = launch([*three_groups_on_slurm_nodes(gpus=1, save_dir=save_dir), "--", "--ft-min-replicas", "2"])
    assert job.returncode == 0, job.stderr
    script = job.stdout
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=1\n" in script
    assert "export TORCHFT_LIGHTHOUSE=http://$LIGHTHOUSE_HOST:29510" in script
    assert f"{os.path.dirname(PYTHON)}/torchft_lighthouse --min_replicas 2 --bind '[::]:29510'" in script
    assert (
        "--max_restarts=3" in script
        and "--fault-tolerance --ft-replica-groups 3 --ft-min-replicas 2" in script
    )
    assert '--ft-replica-id "$SLURM_NODEID" --ft-lighthouse "$TORCHFT_LIGHTHOUSE"' in script
    assert "srun --kill-on-bad-exit=0 --nodes=3" in script
    assert "Plan: fault tolerance (torchft), 3 replica groups of one GPU, one per node" in job.stderr
    assert not save_dir.exists()  # a dry run writes nothing


def test_groups_of_several_processes_are_torchrun_jobs_here_and_on_each_slurm_node(tmp_path):
    """--gpus P (CPU processes here, --nproc the same; GPUs on a SLURM job's nodes) per replica group: each
    group a torchrun job of P processes, with --multi-gpu ddp by default or fsdp; the batch counts every
    group's."""
    here = launch(
        [
            "--fault-tolerance",
            "--replica-groups",
            "2",
            "--nproc",
            "2",
            "--oversubscribe",
            "--multi-gpu",
            "fsdp",
            "--yes",
            "--dry-run",
            "--save-dir",
            str(tmp_path / "here"),
            "--batch-size",
            "8",
        ]
    )
    assert here.returncode == 0, here.stderr
    assert "2 replica groups of 2 processes with --multi-gpu fsdp (gloo)" in here.stderr
    assert "effective batch 32 = 8 per process x 4 processes" in here.stderr
    assert (
        "--standalone --nproc_per_node=2 --max_restarts=3 main_multi_gpu.py --multi-gpu fsdp" in here.stdout
    )
    job = launch(three_groups_on_slurm_nodes(gpus=4, save_dir=tmp_path / "shared" / "run"))
    assert job.returncode == 0, job.stderr
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n" in job.stdout
    assert "#SBATCH --cpus-per-task=20" in job.stdout
    assert "--nproc_per_node=4 --max_restarts=3" in job.stdout and "--multi-gpu ddp" in job.stdout
    assert "3 replica groups of 4 GPUs with --multi-gpu ddp, one per node" in job.stderr


def test_fault_tolerance_flags_that_do_not_fit_are_one_line_and_exit_2():
    for args, refusal in (
        (["--replica-groups", "2"], "--replica-groups is for --fault-tolerance; add --fault-tolerance"),
        (
            ["--fault-tolerance", "--gpus", "2", "--nproc", "3"],
            "give --gpus or --nproc, not both",
        ),
        (
            ["--fault-tolerance", "--replica-groups", "3"],
            "--replica-groups 3 of 1 process: more processes than this machine's",
        ),
        (
            ["--fault-tolerance", "--gpus", "2"],
            "--replica-groups 2 of 2 processes: more processes than this machine's",
        ),
        (
            ["--fault-tolerance", "--multi-gpu", "fsdp"],
            "--multi-gpu fsdp with --fault-tolerance and groups of one process: give each group several",
        ),
        (
            ["--fault-tolerance", "--nproc", "2", "--oversubscribe", "--multi-gpu", "dp"],
            "--multi-gpu dp with --fault-tolerance: a replica group of several processes trains with "
            "--multi-gpu ddp (the default) or fsdp",
        ),
        (
            ["--fault-tolerance", "--nnodes", "2"],
            "--nnodes with --fault-tolerance: each replica group is one process or one torchrun job on one "
            "machine",
        ),
        (
            ["--fault-tolerance", "--", "--ft-replica-id", "1"],
            "--ft-replica-id after -- is the launcher's to set",
        ),
        (
            ["--fault-tolerance", "--k8s"],
            "--fault-tolerance runs its replica groups here or with --slurm, not with --k8s",
        ),
        (
            ["--fault-tolerance", "--ray"],
            "--fault-tolerance runs its replica groups here or with --slurm, not with --ray",
        ),
    ):
        refused = launch(["--yes", "--dry-run", *args])
        assert refused.returncode == 2, (args, refused.stderr)
        assert refusal in refused.stderr and len(refused.stderr.strip().splitlines()[-1:]) == 1, (
            refused.stderr
        )


def answered_at_a_terminal(args: list[str], answers: list[tuple[str, str]], timeout: float = 120) -> str:
    """The launcher at a terminal (a pseudo-terminal), each answer typed once its prompt (a regex) shows; what the
    terminal showed."""
    import pty
    import re
    import select
    import time

    environment = cli_env({"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "TERM": "dumb"})
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the launcher, its stdin a terminal
        os.chdir(REPO)
        os.execvpe("bash", ["bash", str(LAUNCHER), *args], environment)
    shown = ""
    pending = list(answers)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([terminal], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(terminal, 4096).decode(errors="replace")
                except OSError:  # the launcher ended
                    break
                if not chunk:
                    break
                shown += chunk
            if pending and re.search(pending[0][0], shown):
                os.write(terminal, (pending.pop(0)[1] + "\n").encode())
                shown += "\n"  # the prompt is matched once
    finally:
        os.close(terminal)
        os.waitpid(pid, 0)
    return shown.replace("\r", "")


def test_the_launcher_asks_how_often_the_groups_sync_and_turns_an_answer_above_1_into_diloco():
    """--fault-tolerance at a terminal: after the training questions, "Sync the replica groups every how many
    steps (1 = every step ...)"; 8 makes the groups' command --semi-sync diloco --sync-every 8 and the plan says
    it; 1 keeps every step's gradients. --sync-every gives it without the question; a second way of saying it
    (the trainer's --semi-sync after --) or --sync-every without --fault-tolerance is one line, exit 2."""
    for answer, flags in (("8", " --semi-sync diloco --sync-every 8\n"), ("", " --ft-replica-groups 2\n")):
        shown = answered_at_a_terminal(
            ["--fault-tolerance", "--dry-run"],
            [
                (r"Epochs \[\d+\]: $", "1"),
                (r"Batch size per process \[\d+\]: $", ""),
                (r"Base learning rate .*\]: $", ""),
                (r"Scale the LR .*\]: $", ""),
                (r"Sync the replica groups every how many steps \(1 = every step.*\[1\]: $", answer),
            ],
        )
        assert shown.count("Sync the replica groups every how many steps") == 1, shown
        assert flags in shown, shown
        assert ("the groups sync every 8 steps (--semi-sync diloco)" in shown) == (answer == "8"), shown
    given = launch(["--fault-tolerance", "--sync-every", "4", "--dry-run", "--", *TINY_RUN])
    assert given.returncode == 0 and given.stdout.rstrip().endswith(
        "--semi-sync diloco --sync-every 4 " + " ".join(TINY_RUN)
    ), given
    for args, refusal in (
        (["--sync-every", "4"], "--sync-every is for --fault-tolerance; add --fault-tolerance"),
        (["--fault-tolerance", "--sync-every", "0"], "--sync-every must be at least 1, got 0"),
        (
            ["--fault-tolerance", "--sync-every", "4", "--", "--semi-sync", "local-sgd", "--sync-every", "4"],
            "--sync-every 4 and --semi-sync after --: say how the groups sync once",
        ),
    ):
        refused = launch(["--dry-run", *args])
        assert refused.returncode == 2 and refusal in refused.stderr, refused.stderr
