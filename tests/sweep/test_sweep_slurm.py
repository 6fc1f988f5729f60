"""--slurm: the job-array script's text, its array tasks run as SLURM would start them, and --submit."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, RUN_TIMEOUT, TINY_SWEEP_RUN, assert_ok, cli_env, run_sweep

SHELLCHECK = REPO / ".venv" / "bin" / "shellcheck"
RUN = [*TINY_SWEEP_RUN, "--epochs", "1"]


def write_script(
    sweep_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return run_sweep(
        [
            "--sweep-dir",
            str(sweep_dir),
            "--num-seeds",
            "2",
            "--grid",
            "lr=1e-3,3e-3",
            "--slurm",
            *flags,
            "--",
            *RUN,
        ],
        env=env,
    )


def sbatch_lines(script: Path) -> list[str]:
    return [
        line.removeprefix("#SBATCH ")
        for line in script.read_text().splitlines()
        if line.startswith("#SBATCH ")
    ]


def test_cpu_array_script(tmp_path):
    result = write_script(tmp_path, "--shards", "2", "--workers", "1", "--sbatch-arg=--time=00:10:00")
    assert_ok(result)
    script = tmp_path / "sweep.sbatch"
    assert f"wrote {script}: 4 experiments in 2 array tasks" in result.stdout
    assert sbatch_lines(script) == [
        "--job-name=sweep-" + tmp_path.name,
        "--array=0-1",
        "--ntasks=1",
        "--cpus-per-task=1",
        f"--output={tmp_path}/slurm/%A_%a.out",
        "--time=00:10:00",
    ]
    command = script.read_text().splitlines()[-1]
    assert command.startswith(
        f"exec {PYTHON} {REPO / 'sweep_multi_gpu.py'} --sweep-dir {tmp_path} --seeds 0,1 "
    )
    assert '--workers 1 --shard "${SLURM_ARRAY_TASK_ID}/2" -- ' + " ".join(RUN) in command
    assert (tmp_path / "slurm").is_dir() and (tmp_path / "sweep.json").exists()  # SLURM does not create dirs
    assert_ok(
        subprocess.run([str(SHELLCHECK), "--severity=style", str(script)], capture_output=True, text=True)
    )


def test_gpu_array_script_keeps_within_max_gpus(tmp_path):
    assert_ok(write_script(tmp_path, "--max-gpus", "4", "--gpus-per-run", "2"))
    script = tmp_path / "sweep.sbatch"
    lines = sbatch_lines(script)
    assert "--array=0-3%2" in lines and "--gres=gpu:2" in lines  # one task per experiment, 2 x 2 GPUs at once
    command = script.read_text().splitlines()[-1]
    assert "--gpus-per-run 2" in command and "--max-gpus" not in command and "--workers" not in command
    assert_ok(
        subprocess.run([str(SHELLCHECK), "--severity=style", str(script)], capture_output=True, text=True)
    )


@pytest.mark.slow
def test_array_tasks_share_one_sweep_dir_and_merge_their_results(tmp_path):
    """Both tasks of a 2-task array at once, started the way SLURM starts them: the script, with the task id."""
    assert_ok(write_script(tmp_path, "--shards", "2", "--workers", "1"))
    tasks = [
        subprocess.Popen(
            ["bash", str(tmp_path / "sweep.sbatch")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(
                {
                    "CUDA_VISIBLE_DEVICES": "",
                    "SLURM_ARRAY_TASK_ID": str(task),
                    "SLURM_ARRAY_TASK_COUNT": "2",
                    "SLURM_ARRAY_TASK_MIN": "0",
                }
            ),
        )
        for task in range(2)
    ]
    outputs = [task.communicate(timeout=RUN_TIMEOUT) for task in tasks]
    for task, (_stdout, stderr) in zip(tasks, outputs):
        assert task.returncode == 0, stderr
    shards = {}
    for task in range(2):
        lines = (tmp_path / f"results.shard-{task}-of-2.jsonl").read_text().splitlines()
        shards[task] = {json.loads(line)["experiment"] for line in lines}
        assert f"shard {task}/2: 2 of them" in outputs[task][0]
    # Every other experiment of the list: each shard holds one seed of each grid point.
    assert shards == {0: {"lr=0.001/seed-0", "lr=0.003/seed-0"}, 1: {"lr=0.001/seed-1", "lr=0.003/seed-1"}}
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(row["point"], row["done"]) for row in rows] == [("lr=0.001", "2"), ("lr=0.003", "2")]
    assert not (tmp_path / "results.jsonl").exists()


# Shell code a value could smuggle into the job script; each would create a file INJECTED if it ran.
INJECTIONS = {
    "command substitution": "$(touch INJECTED)",
    "a second command": "; touch INJECTED",
    "backquotes": "`touch INJECTED`",
    "a newline": "\ntouch INJECTED",
}


@pytest.mark.parametrize("name", INJECTIONS)
def test_no_value_reaches_the_job_script_as_shell_code(name, tmp_path):
    """The injection through every value that reaches the script: --sweep-dir, --sbatch-arg, --grid, a training
    flag and the working directory (the script cds there). A newline in --sweep-dir or --sbatch-arg, which land in
    comment lines where no quoting helps, is refused in one line; everywhere else the value is quoted."""
    text = INJECTIONS[name]
    newline = "\n" in text
    workdir = tmp_path / f"work{text}"
    workdir.mkdir()
    sweep_dir = tmp_path / f"sweep{text}"
    flags = ["--sweep-dir", str(sweep_dir), "--sbatch-arg", f"--comment=c{text}"]
    if newline:
        for refused in ([flags[0], flags[1]], flags[2:]):
            result = run_sweep([*refused, "--slurm", "--", *RUN], cwd=workdir)
            assert result.returncode == 2 and "holds a newline or another control character" in result.stderr
            assert len(result.stderr.splitlines()) == 1, result.stderr
        assert not sweep_dir.exists()
        sweep_dir, flags = tmp_path / "sweep", ["--sweep-dir", str(tmp_path / "sweep")]
    assert_ok(
        run_sweep(
            [*flags, "--grid", f"gpu_ids=0{text}", "--slurm", "--", *RUN, "--data-dir", f"d{text}"],
            cwd=workdir,
        )
    )
    script = sweep_dir / "sweep.sbatch"
    assert_ok(subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True))
    # The words bash reads are the values as given: each value one quoted word.
    words = shlex.split(script.read_text(), comments=True)
    assert words[words.index("cd") + 1] == str(workdir)
    assert words[words.index("--sweep-dir") + 1] == str(sweep_dir)
    assert words[words.index("--data-dir") + 1] == f"d{text}"
    directives = [
        word for line in sbatch_lines(script) for word in shlex.split(line)
    ]  # sbatch reads quotes so too
    assert f"--output={sweep_dir}/slurm/%A_%a.out" in directives
    assert newline or f"--comment=c{text}" in directives
    # Run as an array task starts it: bash runs every line, the sweep starts and refuses task 99 (no such shard).
    task = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env=cli_env({"SLURM_ARRAY_TASK_ID": "99"}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert task.returncode == 2 and "error: --shard must be I/N with 0 <= I < N" in task.stderr, task.stderr
    assert not list(tmp_path.rglob("INJECTED"))  # where bash started, nor where the script cds to


def test_submit_hands_the_script_to_sbatch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = (
        bin_dir / "sbatch"
    )  # stands in for SLURM's sbatch: records its arguments, answers like --parsable
    sbatch.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "4242;cluster"\n')
    sbatch.chmod(0o755)
    result = write_script(tmp_path / "sweep", "--submit", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert_ok(result)
    assert "submitted job array 4242" in result.stdout
    assert (bin_dir / "args").read_text().split() == ["--parsable", str(tmp_path / "sweep" / "sweep.sbatch")]


def test_submit_without_sbatch_is_one_line(tmp_path):
    result = write_script(tmp_path, "--submit", env={"PATH": str(tmp_path / "empty")})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --submit: sbatch not found"), result.stderr
    assert (tmp_path / "sweep.sbatch").exists()  # written, to be submitted where SLURM runs


@pytest.mark.slow
def test_a_real_slurm_job_array_runs_the_shards_into_one_merged_summary(tmp_path, slurm_cluster):
    """The generated array script submitted to a real single-node SLURM (tests/slurm_cluster.py): 4 experiments
    in 2 array tasks, both writing into one sweep dir, whose summary merges them."""
    sweep_dir = tmp_path / "sweep"
    assert_ok(
        run_sweep(
            [
                "--sweep-dir",
                str(sweep_dir),
                "--num-seeds",
                "2",
                "--grid",
                "lr=1e-3,3e-3",
                "--slurm",
                "--shards",
                "2",
                "--workers",
                "1",
                "--",
                *RUN,
            ],
            env=slurm_cluster.env,
        )
    )
    job = slurm_cluster.submit(sweep_dir / "sweep.sbatch", cwd=tmp_path)
    states = slurm_cluster.wait_array(job, RUN_TIMEOUT)
    outputs = "\n".join(path.read_text() for path in sorted((sweep_dir / "slurm").glob("*.out")))
    assert states == ["COMPLETED", "COMPLETED"], outputs[-3000:]
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(row["point"], row["done"], row["failed"]) for row in rows] == [
        ("lr=0.001", "2", "0"),
        ("lr=0.003", "2", "0"),
    ]
    assert len((sweep_dir / "results.shard-0-of-2.jsonl").read_text().splitlines()) == 2
    assert len((sweep_dir / "results.shard-1-of-2.jsonl").read_text().splitlines()) == 2
