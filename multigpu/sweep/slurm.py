"""--slurm: the sbatch job-array script that runs a sweep's shards on a SLURM cluster, and --submit.

Array task I of N runs `sweep_multi_gpu.py` with the same flags and `--shard I/N`. Every task writes
into the one sweep dir (its own results file), and each one that ends rewrites the merged summary. A grid's task
runs every N-th experiment; a search's task is a driver of the one study (DIR/study.journal), drawing trials
until the study holds --trials (multigpu/sweep/search.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

from multigpu import safe_files
from multigpu.errors import UsageError
from multigpu.sweep.options import MAX_ARRAY_TASKS, SweepOptions, to_argv

SCRIPT_NAME = "sweep.sbatch"
ENTRY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "sweep_multi_gpu.py"
)


def array_size(count: int, options: SweepOptions) -> tuple[int, int | None]:
    """(N array tasks, at most P at once or None): one task per experiment of a grid (trial of a search, `count`
    of them) unless --shards says otherwise; P keeps the GPUs in use at once within --max-gpus."""
    tasks = options.shards or max(1, min(count, MAX_ARRAY_TASKS))
    if tasks > MAX_ARRAY_TASKS:
        raise UsageError(f"--shards {tasks}: SLURM arrays hold at most {MAX_ARRAY_TASKS} tasks by default")
    if options.max_gpus is None:
        return tasks, None
    if options.max_gpus < options.gpus_per_run:
        raise UsageError(f"--max-gpus {options.max_gpus} is fewer than --gpus-per-run {options.gpus_per_run}")
    return tasks, options.max_gpus // options.gpus_per_run


def script(
    sweep_dir: str, count: int, what: str, options: SweepOptions, train_argv: list[str], workdir: str
) -> str:
    """The text of the sbatch script of a sweep of `count` `what` (experiments, trials); bash, passes
    shellcheck."""
    tasks, parallel = array_size(count, options)
    limit = f"%{parallel}" if parallel else ""
    on_cpu = options.workers is not None
    per_task = (
        options.workers * options.gpus_per_run * options.threads_per_run if options.workers is not None else 0
    )
    resources = f"--cpus-per-task={per_task}" if on_cpu else f"--gres=gpu:{options.gpus_per_run}"
    sweep_flags = shlex.join([sys.executable, ENTRY, *to_argv(options, for_task=True)])
    # The shard count is written here, not read from SLURM_ARRAY_TASK_COUNT: resubmitting only some
    # tasks (sbatch --array=3,5) must still cut the list into the same shards.
    shard = f'--shard "${{SLURM_ARRAY_TASK_ID}}/{tasks}"'

    # Every value from the user is shell-quoted, #SBATCH lines too (sbatch reads their quotes as a shell does);
    # a newline, which no quoting keeps inside a comment, was refused with the flags (options.py).
    directives = [
        f"--job-name=sweep-{os.path.basename(sweep_dir)}",
        f"--array=0-{tasks - 1}{limit}",
        "--ntasks=1",
        resources,
        f"--output={os.path.join(sweep_dir, 'slurm', '%A_%a.out')}",
        *options.sbatch_args,
    ]
    shares = (
        [
            f"# Array task I drives the one study with shard I/{tasks}: each draws trials until it holds {count};",
            "# submitting it again continues the search: ended trials are not run again.",
        ]
        if what == "trials"
        else [
            f"# Array task I runs shard I/{tasks} of the experiment list, into the one sweep dir;",
            "# submitting it again continues the sweep: finished experiments are skipped.",
        ]
    )
    lines = [
        "#!/bin/bash",
        f"# Sweep {shlex.quote(sweep_dir)}: {count} {what} in {tasks} array tasks"
        f"{f', at most {parallel} at a time' if parallel else ''}.",
        f"# Written by sweep_multi_gpu.py --slurm. Submit: sbatch {shlex.quote(script_path(sweep_dir))}",
        *shares,
        *[f"#SBATCH {shlex.quote(directive)}" for directive in directives],
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        f"exec {sweep_flags} {shard} -- {shlex.join(train_argv)}".rstrip(),
    ]
    return "\n".join(lines) + "\n"


def script_path(sweep_dir: str) -> str:
    return os.path.join(sweep_dir, SCRIPT_NAME)


def write_script(sweep_dir: str, count: int, what: str, options: SweepOptions, train_argv: list[str]) -> str:
    """Write DIR/sweep.sbatch (and DIR/slurm/ for the tasks' output: SLURM does not create it); return its path."""
    path = script_path(sweep_dir)
    safe_files.make_folder(os.path.join(sweep_dir, "slurm"), inside=sweep_dir)
    safe_files.write_atomically(path, script(sweep_dir, count, what, options, train_argv, os.getcwd()), 0o755)
    return path


def submit(path: str) -> str:
    """sbatch the script; return the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UsageError(
            f"--submit: sbatch not found (not a SLURM machine?); the script is written: submit it "
            f"where SLURM runs with: sbatch {shlex.quote(path)}"
        )
    result = subprocess.run([sbatch, "--parsable", path], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        said = (
            result.stderr.strip() or result.stdout.strip() or f"exit status {result.returncode}"
        ).splitlines()
        raise UsageError(f"--submit: sbatch refused {path}: {said[0]}")
    return result.stdout.strip().split(";")[0]
