"""The launcher's SLURM job script (`--slurm`): the devices a job asks for, its checks, and the script that
runs the launcher's torchrun command on every node through srun (torch-free).
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Iterator

from multigpu.config import TrainConfig
from multigpu.errors import HANG_EXIT_STATUS, UsageError
from multigpu.launch.answers import (
    SLURM,
    TORCHRUN,
    TRAINER,
    Devices,
    Nodes,
    Settings,
    mode_of,
    plural,
    trainer_flags,
)
from multigpu.launch.cluster_jobs import check_job, job_devices, settle_job
from multigpu.launch.command import quoted, training_plan

SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")


SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def slurm_devices(s: Settings) -> Devices:
    """Per node for --slurm: --gpus asks SLURM for that many GPUs; 0 (or none here, by default) runs
    --nproc CPU processes (gloo)."""
    devices = job_devices(s, SLURM)
    for name, pattern in (("partition", SLURM_NAME), ("account", SLURM_NAME), ("time", SLURM_TIME)):
        value = getattr(s, name)
        if value is not None and not pattern.fullmatch(value):
            example = "04:00:00 or 1-12:00:00" if name == "time" else "gpu"
            raise UsageError(f"--{name} {value!r}: not a SLURM {name} (e.g. {example})")
    return devices


def check_slurm_job(s: Settings, nodes: Nodes, config: TrainConfig) -> None:
    """What a SLURM job needs beyond a run here: its own resuming, a --save-dir every node sees, and one its
    output path can name."""
    check_job(s, nodes, config, SLURM)
    assert config.save_dir is not None  # settled by launch_rules.check before (its set:save-dir)
    if re.search(r"\s", config.save_dir):
        raise UsageError(
            f"--save-dir {config.save_dir!r}: SLURM's output path cannot hold spaces; choose another"
        )


def slurm(s: Settings) -> Iterator[tuple[str, str]]:
    """The plan and the job script for --slurm."""
    s.slurm = "1"
    job = settle_job(s, slurm_devices(s), check_slurm_job)
    config = job.config
    yield (
        "plan",
        f"Plan: SLURM job, {plural(job.nodes.count, 'node')} x {job.what}, {job.layout} with c10d rendezvous on "
        f"the first node",
    )
    yield from training_plan(s, config, job.devices, job.nodes)
    script = os.path.join(job.save_dir, "launch_slurm.sbatch")
    yield "plan", f"  job script {script}; its output in {job.save_dir}/slurm-<job id>.out"
    yield "save-dir", job.save_dir
    yield "script-file", script
    yield "script", slurm_script(s, job.nodes, job.gpus, job.procs, job.cpus, config)


def slurm_script(s: Settings, nodes: Nodes, gpus: int, procs: int, cpus: int, config: TrainConfig) -> str:
    """The sbatch script: one task per node, each a torchrun of `procs` processes, joined by c10d.

    Every $SLURM_* variable stays literal, read when the job runs; those that differ
    between nodes ($SLURM_NODEID) are read inside run_node, on each node.
    """
    assert (
        config.save_dir is not None
    )  # settled by launch_rules.check before (its set:save-dir), or refused by check_slurm_job
    directives = ["--job-name=multigpu", f"--nodes={nodes.count}", "--ntasks-per-node=1"]
    if gpus:
        directives.append(f"--gpus-per-node={gpus}")
    directives.append(f"--cpus-per-task={cpus}")
    directives += [
        f"--{name}={getattr(s, name)}" for name in ("partition", "time", "account") if getattr(s, name)
    ]
    directives += [
        f"--chdir={os.getcwd()}",
        f"--output={config.save_dir}/slurm-%j.out",
        "--open-mode=append",
        "--requeue",
        "--signal=B:USR1@120",
    ]
    trainer = [
        TRAINER,
        *trainer_flags(s, Devices(mode_of(s) or "ddp", procs, None, gpus > 0)),
        "--resume",
        "auto",
        *s.trainer_args,
    ]
    restarts = f" --max_restarts={nodes.max_restarts}" if nodes.max_restarts is not None else ""
    port = str(nodes.port) if nodes.port else "$((20000 + SLURM_JOB_ID % 20000))"
    processes = plural(gpus, "GPU") if gpus else plural(procs, "CPU process")
    shape = f"{plural(nodes.count, 'node')} x {processes}, {(mode_of(s) or 'ddp').upper()} under torchrun"
    # torchrun's c10d rendezvous is hosted by the allocation's first node.
    host = "--rdzv_conf=is_host=$((SLURM_NODEID == 0))"
    gpu_check = (
        ""
        if not gpus
        else """
[[ ${SLURM_GPUS_ON_NODE:-0} == "$GPUS_PER_NODE" ]] ||
    fail "written for $GPUS_PER_NODE GPUs per node, SLURM gave ${SLURM_GPUS_ON_NODE:-0} on $(hostname);" \\
        "check the partition's GPUs (sinfo -o '%P %G')"
"""
    )
    shared_check = (
        ""
        if nodes.count == 1
        else """
# Rank 0 (on any node) writes the checkpoints that every node resumes from: all must see one --save-dir.
marker=$SAVE_DIR/.shared-check-$SLURM_JOB_ID
touch "$marker" || fail "cannot write to --save-dir $SAVE_DIR"
srun --nodes="$NODES" --ntasks-per-node=1 test -e "$marker" ||
    fail "--save-dir $SAVE_DIR is not shared: some node does not see it; use storage all nodes mount"
rm -f "$marker"
"""
    )
    restart_env = " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" if nodes.count > 1 and nodes.max_restarts else ""
    return f"""#!/bin/bash
# SLURM job written by launch_multi_gpu.sh on {time.strftime("%Y-%m-%d %H:%M:%S")}:
# {shape}, c10d rendezvous on the allocation's first node.
# Submit: sbatch {shlex.quote(os.path.join(config.save_dir, "launch_slurm.sbatch"))}
# Submitting it again, or a requeue, continues from the newest checkpoint (--resume auto).
{chr(10).join("#SBATCH " + d for d in directives)}

set -uo pipefail
NODES={nodes.count} GPUS_PER_NODE={gpus} PROCS_PER_NODE={procs}
SAVE_DIR={shlex.quote(config.save_dir)}
export PROCS_PER_NODE SAVE_DIR

fail() {{ echo "launch_slurm.sbatch: $*" >&2; exit 2; }}

# --- pre-flight: the allocation must be the one this script was written for
[[ $SLURM_JOB_NUM_NODES == "$NODES" ]] ||
    fail "written for $NODES node(s), SLURM gave $SLURM_JOB_NUM_NODES ($SLURM_JOB_NODELIST); do not override --nodes"
[[ ${{SLURM_NTASKS_PER_NODE:-1}} == 1 ]] ||
    fail "written for one task per node (torchrun starts the processes), SLURM gave $SLURM_NTASKS_PER_NODE"
{gpu_check}{shared_check}
# --- rendezvous: torchrun's c10d store on the allocation's first node, one id per job
RDZV_ENDPOINT=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):{port}
export RDZV_ENDPOINT

# --- on every node (one task each): what differs between nodes, as which one hosts the rendezvous, is read there
run_node() {{
    local threads=$((SLURM_CPUS_PER_TASK / PROCS_PER_NODE))
    exec env OMP_NUM_THREADS=$((threads > 0 ? threads : 1)){restart_env} \\
        {shlex.quote(s.python)} {shlex.quote(TORCHRUN)} --log-file "$SAVE_DIR/torchrun-$(hostname).log" \\
        --nnodes="$SLURM_NNODES" --nproc_per_node="$PROCS_PER_NODE" --rdzv_backend=c10d \\
        --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="$SLURM_JOB_ID" {host}{restarts} \\
        {quoted(trainer)}
}}
export -f run_node

# --- preemption: SIGUSR1 (120 s before the time limit) stops the training cleanly (a checkpoint, exit 0)
# and requeues the job, which resumes. SIGTERM (preemption, scancel) reaches the training directly.
requeue=0
# (scancel, not kill: srun takes a SIGTERM as "end the step now")
trap 'requeue=1; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
trap ':' TERM
job_started=$(date +%s)
srun --kill-on-bad-exit=1 --nodes="$NODES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" \\
    bash -c run_node &
srun_pid=$!
while true; do
    wait "$srun_pid"
    status=$?
    kill -0 "$srun_pid" 2>/dev/null || break  # a trap interrupted the wait: wait again
done
# --- a hang: the watchdog wrote its report (and a checkpoint when it could); a requeue would hang again unseen
report=$SAVE_DIR/hang_report.txt
if ((status != 0)) && [[ -f $report ]] && (($(stat -c %Y "$report") >= job_started)); then
    echo "launch_slurm.sbatch: hang: see $report; not requeueing (fix the cause, then submit again: it resumes)" >&2
    exit {HANG_EXIT_STATUS}
fi
if ((requeue && status == 0)); then
    echo "launch_slurm.sbatch: stopped before the time limit with a checkpoint; requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""
