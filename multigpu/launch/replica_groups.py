"""--fault-tolerance's launch (docs/fault-tolerance.md): torchft's Lighthouse and the run's replica groups, on this
machine (`supervise`, what `bash launch_multi_gpu.sh --fault-tolerance --replica-groups N` runs) or across the
nodes of a SLURM job (`slurm_script`: one group per node, the Lighthouse on the first). Torch-free.

    python -m multigpu.launch.replica_groups --groups 2 --save-dir DIR [--port 29510] -- GROUP COMMAND...

starts the Lighthouse, then GROUP COMMAND once per group with `--ft-replica-id I --ft-lighthouse URL` added
(each group's output prefixed `[group I]`), and waits for them. A group that dies is left out by the others,
which train on; torchrun restarts it (--max-restarts) and it heals from a live peer. Exit status: 0 when some
group finished the run; when every group ended without finishing, one line naming the newest checkpoint, and
the groups' status (2 for bad input in all of them, else 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

if __package__ in (None, ""):  # run as a file: make the repository importable, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from multigpu.checkpoints import run_folders  # noqa: E402
from multigpu.config import DEFAULT_SAVE_ROOT, TrainConfig, flag, parse_config  # noqa: E402
from multigpu.errors import UsageError  # noqa: E402
from multigpu.launch.answers import (  # noqa: E402
    REPO,
    SLURM,
    TORCHRUN,
    TRAINER,
    Devices,
    Nodes,
    Settings,
    check_save_dir,
    cores_here,
    devices_of,
    given_trainer_options,
    omp_threads,
    plural,
    port_is_free,
    refuse_launcher_owned,
    settle_training,
    trainer_flags,
    whole,
)
from multigpu.launch.cluster_jobs import job_devices  # noqa: E402
from multigpu.launch.command import effective_batch_text, lr_text, quoted, shown  # noqa: E402

LIGHTHOUSE_PORT = 29510  # torchft's own default
LIGHTHOUSE_BINARY = "torchft_lighthouse"
# How the Lighthouse decides (torchft's flags): a group is dead after HEARTBEAT_TIMEOUT_MS without a heartbeat;
# quorums are checked every QUORUM_TICK_MS; a group heartbeating but not yet asking is waited for JOIN_TIMEOUT_MS.
HEARTBEAT_TIMEOUT_MS = 5000
QUORUM_TICK_MS = 100
JOIN_TIMEOUT_MS = 60000
STARTUP_SECONDS = 60.0  # for the Lighthouse to listen


def lighthouse_binary() -> str:
    """torchft's Lighthouse program: beside this Python (a virtual environment's bin/), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), LIGHTHOUSE_BINARY)
    found = beside if os.access(beside, os.X_OK) else shutil.which(LIGHTHOUSE_BINARY)
    if not found:
        raise UsageError(
            f"--fault-tolerance needs torchft's {LIGHTHOUSE_BINARY}: pip install 'multigpu[ft]' (or pip install "
            f"torchft) into {sys.executable}'s environment"
        )
    return found


def lighthouse_command(
    port: int,
    min_replicas: int,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    quorum_tick_ms: int = QUORUM_TICK_MS,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
) -> list[str]:
    """torchft's Lighthouse with these settings, through multigpu/launch/lighthouse.py: torchft_lighthouse's own
    main, started in a tenth of a second instead of seconds."""
    lighthouse_binary()  # torchft is installed, or the one line that says how
    return [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "lighthouse.py"),
        "--min_replicas",
        str(min_replicas),
        "--bind",
        f"[::]:{port}",
        "--heartbeat_timeout_ms",
        str(heartbeat_timeout_ms),
        "--quorum_tick_ms",
        str(quorum_tick_ms),
        "--join_timeout_ms",
        str(join_timeout_ms),
    ]


def start_lighthouse(
    port: int = 0, min_replicas: int = 1, wait: bool = True, **timing: int
) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on this machine at `port` (0: a free one), and the address the groups give as
    --ft-lighthouse; listening once this returns (`wait`), else see `wait_listening`. `timing`: lighthouse_command's
    milliseconds."""
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    process = subprocess.Popen(
        lighthouse_command(port, min_replicas, **timing),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
    )
    if wait:
        wait_listening(process, port)
    return process, f"http://127.0.0.1:{port}"  # the groups of a local run are on this machine


def wait_listening(process: subprocess.Popen, port: int) -> None:
    """Until the Lighthouse accepts a connection (its program imports torch first: seconds); UsageError when it
    ends instead, or takes longer than STARTUP_SECONDS."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise UsageError(
                    f"torchft's Lighthouse did not start on port {port} (its status {process.wait()}): is the "
                    f"port in use? give another with --lighthouse-port"
                ) from None
            time.sleep(0.05)


def group_command(command: Sequence[str], replica_id: int, lighthouse: str) -> list[str]:
    """One group's command: the run's, as group `replica_id` of the run at `lighthouse`."""
    return [*command, "--ft-replica-id", str(replica_id), "--ft-lighthouse", lighthouse]


def _relay(stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line)
            out.flush()


def supervise(
    command: Sequence[str],
    groups: int,
    save_dir: str,
    lighthouse: str,
    devices: Sequence[str] = (),
    threads: int | None = None,
    lighthouse_up: Any = None,
) -> int:
    """Run `groups` replica groups of `command` against the Lighthouse at `lighthouse` and wait for them; a
    SIGTERM or Ctrl-C here reaches every group (each stops cleanly). `lighthouse_up`: called once they started,
    raises UsageError when the Lighthouse did not come up (the groups are then stopped). The exit status as the
    module's doc says."""
    lock, relays, processes = threading.Lock(), [], []
    for replica_id in range(groups):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if devices:  # on GPUs each group has its own
            env["CUDA_VISIBLE_DEVICES"] = devices[replica_id]
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        words = group_command(command, replica_id, lighthouse)
        print(f"[group {replica_id}] {' '.join(words)}", flush=True)
        process = subprocess.Popen(
            words, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        processes.append(process)
        relay = threading.Thread(
            target=_relay, args=(process.stdout, f"[group {replica_id}] ", sys.stdout, lock), daemon=True
        )
        relay.start()
        relays.append(relay)

    def forward(signum: int, _frame: Any) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        if lighthouse_up is not None:
            try:
                lighthouse_up()
            except UsageError as error:
                forward(signal.SIGKILL, None)
                print(f"error: {error}", file=sys.stderr, flush=True)
                return error.exit_code
        statuses = [process.wait() for process in processes]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for relay in relays:
        relay.join(timeout=5)
    return verdict(statuses, save_dir)


def verdict(statuses: Sequence[int], save_dir: str) -> int:
    """The run's exit status from its groups' (Popen's: -N for a kill by signal N), with its line."""
    shown = ", ".join(f"group {index}: {_status_text(status)}" for index, status in enumerate(statuses))
    if all(status == 0 for status in statuses):
        return 0
    if any(status == 0 for status in statuses):
        print(f"replica groups: the run finished; some groups did not ({shown})", flush=True)
        return 0
    newest = run_folders.resumable_files(save_dir)
    where = f"the newest checkpoint is {newest[0]}" if newest else f"no checkpoint in {save_dir} yet"
    print(
        f"every replica group ended without finishing the run ({shown}): {where}; run the same command again to "
        f"continue (or without --fault-tolerance, with --resume auto)",
        file=sys.stderr,
        flush=True,
    )
    return UsageError.exit_code if all(status == UsageError.exit_code for status in statuses) else 1


def _status_text(status: int) -> str:
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit {status}"


# ---------------------------------------------------------------- the launcher's rules (launch_rules.py asks)
DEFAULT_GROUPS = 2
DEFAULT_RESTARTS = 3  # torchrun restarts a group's process this often: each time it rejoins and heals
# The trainer flags the launcher sets for each group; a copy after -- would contradict them.
FT_OWNED = ("fault_tolerance", "ft_replica_groups", "ft_replica_id", "ft_lighthouse", "multi_gpu")
NOT_FOR_GROUPS = (
    "gpu_ids",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "dp_replicate",
    "dp_shard",
)
GROUP_MODES = ("ddp", "fsdp")  # a group of several processes: the model replicated or sharded within it


def settle(s: Settings) -> tuple[Devices, Nodes]:
    """--fault-tolerance's layout, checked: --replica-groups groups, each one process or a torchrun job of
    --gpus processes (one GPU each, or CPU processes) that replicate (ddp) or shard (fsdp) the model within
    the group. As the batch and LR arithmetic sees them: the groups as the nodes, a group's processes as each
    node's."""
    if not s.fault_tolerance:
        named = next(
            f"--{flag(name)}"
            for name in ("replica_groups", "lighthouse_port", "sync_every")
            if getattr(s, name) is not None
        )
        raise UsageError(f"{named} is for --fault-tolerance; add --fault-tolerance (or drop {named})")
    groups = whole("replica_groups", s.replica_groups, 1) or DEFAULT_GROUPS
    whole("lighthouse_port", s.lighthouse_port, 1, 65535)
    owned = [name for name in FT_OWNED if name in given_trainer_options(s.trainer_args)]
    if owned:
        raise UsageError(
            f"--{flag(owned[0])} after -- is the launcher's to set with --fault-tolerance; leave it out"
        )
    refuse_launcher_owned(s)  # --epochs, --batch-size ... after --: refused as a plain launch refuses them
    for name in NOT_FOR_GROUPS:
        if getattr(s, name) is not None:
            raise UsageError(
                f"--{flag(name)} with --fault-tolerance: each replica group is one process or one torchrun "
                f"job on one machine, and the groups are the replicas; --replica-groups N says how many"
            )
    devices = _group_devices(s)
    per_group = devices.count
    on_gpu = devices.on_gpu
    mode = _group_mode(s, per_group)
    processes = groups * per_group
    if not s.slurm and on_gpu and processes > len(s.found):
        raise UsageError(
            f"--replica-groups {groups} of {plural(per_group, 'GPU')}: {processes} GPUs, and "
            f"{plural(len(s.found), 'GPU')} were found here"
        )
    if not s.slurm and not on_gpu and processes > cores_here() and not s.oversubscribe:
        raise UsageError(
            f"--replica-groups {groups} of {plural(per_group, 'process')}: more processes than this "
            f"machine's {plural(cores_here(), 'CPU core')}, which they would only share; give fewer, or add "
            f"--oversubscribe"
        )
    restarts = whole("max_restarts", s.max_restarts, 0)
    return Devices(mode, per_group, None, on_gpu), Nodes(count=groups, max_restarts=restarts)


def _group_devices(s: Settings) -> Devices:
    """One group's devices, by the launcher's own rules for a node's (--gpus, or --nproc, the same; a SLURM
    job's CPU nodes: --gpus 0 and --nproc); one process, on a GPU where there are GPUs, unless given."""
    if s.gpus is None and s.nproc is None:
        return Devices("none", 1, None, bool(s.found))
    return job_devices(s, SLURM) if s.slurm else devices_of(s, "ddp")


def _group_mode(s: Settings, per_group: int) -> str:
    """How a group's processes share the model: --multi-gpu ddp (the default) or fsdp; one process: none."""
    if per_group == 1:
        if s.multi_gpu not in (None, "none", "single"):
            raise UsageError(
                f"--multi-gpu {s.multi_gpu} with --fault-tolerance and groups of one process: give each "
                f"group several with --gpus P (CPU processes without GPUs), or leave --multi-gpu out"
            )
        return "none"
    if s.multi_gpu in (None, *GROUP_MODES):
        return s.multi_gpu or "ddp"
    raise UsageError(
        f"--multi-gpu {s.multi_gpu} with --fault-tolerance: a replica group of several processes trains with "
        f"--multi-gpu ddp (the default) or fsdp"
    )


def group_argv(s: Settings, devices: Devices, groups: int) -> list[str]:
    """The trainer flags of every group; each adds its --ft-replica-id and --ft-lighthouse."""
    return [
        *trainer_flags(s, devices),
        "--fault-tolerance",
        "--ft-replica-groups",
        str(groups),
        *semi_sync_flags(s),
        *s.trainer_args,
    ]


def semi_sync_flags(s: Settings) -> list[str]:
    """--sync-every H (the launcher's question): above 1, the trainer's --semi-sync diloco --sync-every H
    (docs/fault-tolerance.md, "Training across slow links"); the trainer's own --semi-sync after -- is the other
    way to say it, not both."""
    steps = whole("sync_every", s.sync_every, 1)
    if steps is None:
        return []
    given = [name for name in ("semi_sync", "sync_every") if name in given_trainer_options(s.trainer_args)]
    if given:
        raise UsageError(
            f"--sync-every {steps} and --{flag(given[0])} after --: say how the groups sync once, with the "
            f"launcher's --sync-every H (DiLoCo) or the trainer's --semi-sync METHOD --sync-every H after --"
        )
    return ["--semi-sync", "diloco", "--sync-every", str(steps)] if steps > 1 else []


def sync_every_asked(s: Settings) -> bool:
    """Whether the launcher asks how often the groups sync: not when the trainer's flags after -- say it."""
    return not {"semi_sync", "sync_every"} & set(given_trainer_options(s.trainer_args))


def group_config(s: Settings) -> TrainConfig:
    """The TrainConfig of group 0, by the trainer's own parser: --fault-tolerance's refusals included (before the
    save-dir is settled, as if it were the default root)."""
    devices, nodes = settle(s)
    argv = [*group_argv(s, devices, nodes.count), "--ft-replica-id", "0"]
    return parse_config(argv if s.save_dir else [*argv, "--save-dir", DEFAULT_SAVE_ROOT])


def lighthouse_port(s: Settings) -> tuple[int, str]:
    """The Lighthouse's port here: --lighthouse-port, free, or the first free one from LIGHTHOUSE_PORT up."""
    if s.lighthouse_port is not None:
        port = int(s.lighthouse_port)
        if not port_is_free(port):
            raise UsageError(f"--lighthouse-port {port}: the port is busy; choose another or leave it out")
        return port, ""
    port = next((port for port in range(LIGHTHOUSE_PORT, LIGHTHOUSE_PORT + 100) if port_is_free(port)), 0)
    if not port:
        raise UsageError(f"ports {LIGHTHOUSE_PORT}-{LIGHTHOUSE_PORT + 99} are busy: give --lighthouse-port")
    return (
        port,
        "" if port == LIGHTHOUSE_PORT else f"Port {LIGHTHOUSE_PORT} is busy: the Lighthouse uses {port}.",
    )


def group_text(devices: Devices) -> str:
    """What one replica group is, in the plan's words."""
    backend = "" if devices.on_gpu else " (gloo)"
    if devices.count == 1:
        return f"one {devices.unit}{backend}"
    return f"{plural(devices.count, devices.unit)} with --multi-gpu {devices.mode}{backend}"


def plan_lines(s: Settings, devices: Devices, nodes: Nodes, config: Any, where: str) -> list[str]:
    restarts = DEFAULT_RESTARTS if nodes.max_restarts is None else nodes.max_restarts
    each = group_text(devices)
    return [
        f"Plan: fault tolerance (torchft), {nodes.count} replica groups of {each}, {where}",
        f"  epochs {config.epochs}; effective batch {effective_batch_text(config, devices, nodes)} (all groups)",
        f"  {lr_text(s, config, devices, nodes)}",
        f"  a lost group's share of the data is skipped while the others train on; torchrun restarts the "
        f"group (up to {restarts} times) and it heals from a live peer",
        *([f"  {sync_text(config)}"] if config.semi_sync else []),
        f"  checkpoints (written by the lowest live group) and launch files in {config.save_dir}/",
    ]


def sync_text(config: TrainConfig) -> str:
    """The plan's line of --semi-sync: how often the groups sync, and what that saves."""
    return (
        f"the groups sync every {config.sync_every} steps (--semi-sync {config.semi_sync}): about "
        f"{config.sync_every} times fewer bytes between them than every step's gradients"
    )


def plan(s: Settings, settle_save_dir: Any) -> Any:
    """The plan and the command of a fault-tolerant run on this machine: the supervisor, which starts the
    Lighthouse and the groups. `settle_save_dir`: launch_rules' own choice of the save-dir."""
    devices, nodes = settle(s)
    yield from settle_save_dir(s, group_config(s))
    config = group_config(s)
    save_dir = _named(config)
    check_save_dir(save_dir)
    settle_training(s, config)
    argv = group_argv(s, devices, nodes.count)
    port, note = lighthouse_port(s)
    restarts = DEFAULT_RESTARTS if nodes.max_restarts is None else nodes.max_restarts
    group = [
        shown(s.python),
        shown(TORCHRUN),
        "--log-file",
        os.path.join(save_dir, "torchrun.log"),
        "--standalone",
        f"--nproc_per_node={devices.count}",
        f"--max_restarts={restarts}",
        shown(TRAINER),
        *argv,
    ]
    supervisor = [
        shown(s.python),
        shown(os.path.abspath(__file__)),
        "--groups",
        str(nodes.count),
        "--min-replicas",
        str(config.ft_min_replicas),
        "--save-dir",
        save_dir,
        "--lighthouse-port",
        str(port),
        "--threads",
        str(omp_threads(cores_here(), nodes.count * devices.count)),
        *(["--devices", group_devices(s.found, nodes.count, devices.count)] if devices.on_gpu else []),
        "--",
        *group,
    ]
    for line in plan_lines(s, devices, nodes, config, f"the Lighthouse on this machine at port {port}"):
        yield "plan", line
    if note:
        yield "plan", f"  {note}"
    yield "save-dir", save_dir
    yield "command", quoted(supervisor)


def group_devices(found: Sequence[str], groups: int, per_group: int) -> str:
    """Each group's CUDA_VISIBLE_DEVICES, ';' between the groups: '0,1;2,3'."""
    return ";".join(",".join(found[group * per_group : (group + 1) * per_group]) for group in range(groups))


def _named(config: TrainConfig) -> str:
    """The save-dir of a group's config: always named (--fault-tolerance needs it; group_config names one)."""
    assert config.save_dir is not None
    return config.save_dir


def slurm(s: Settings) -> Any:
    """The plan and the SLURM job script of a fault-tolerant run: one replica group per node, the Lighthouse on
    the first node beside its group."""
    s.slurm = "1"
    devices, nodes = settle(s)
    config = group_config(s)
    if s.save_dir is None:
        raise UsageError(
            f"--fault-tolerance --slurm needs --save-dir on storage every node shares (e.g. /shared/run1): the "
            f"{nodes.count} groups resume from and write to it"
        )
    save_dir = _named(config)
    check_save_dir(save_dir)
    settle_training(s, config)
    argv = group_argv(s, devices, nodes.count)
    port = whole("lighthouse_port", s.lighthouse_port, 1, 65535) or LIGHTHOUSE_PORT
    for line in plan_lines(
        s, devices, nodes, config, f"one per node, the Lighthouse on the first (port {port})"
    ):
        yield "plan", line
    script = os.path.join(save_dir, "launch_slurm.sbatch")
    yield "plan", f"  job script {script}; its output in {save_dir}/slurm-<job id>.out"
    yield "save-dir", save_dir
    yield "script-file", script
    yield "script", slurm_script(s, nodes, devices, port, argv, config)


def slurm_script(s: Settings, nodes: Nodes, devices: Devices, port: int, argv: list[str], config: Any) -> str:
    """The sbatch script: the Lighthouse on the first node, then one task per node, each a replica group (a
    torchrun of the group's processes, restarted --max-restarts times) numbered by $SLURM_NODEID; a failed
    group ends nothing else. The job succeeds when some group finished the run."""
    per_group = devices.count
    directives = ["--job-name=multigpu-ft", f"--nodes={nodes.count}", "--ntasks-per-node=1"]
    directives += [f"--gpus-per-node={per_group}"] if devices.on_gpu else []
    cpus = whole("cpus_per_task", s.cpus_per_task, 1) or (5 * per_group if devices.on_gpu else per_group)
    directives.append(f"--cpus-per-task={cpus}")
    directives += [
        f"--{name}={getattr(s, name)}" for name in ("partition", "time", "account") if getattr(s, name)
    ]
    directives += [f"--chdir={os.getcwd()}", f"--output={config.save_dir}/slurm-%j.out", "--open-mode=append"]
    restarts = DEFAULT_RESTARTS if nodes.max_restarts is None else nodes.max_restarts
    min_replicas = config.ft_min_replicas
    lighthouse = [
        os.path.join(os.path.dirname(s.python), LIGHTHOUSE_BINARY),
        "--min_replicas",
        str(min_replicas),
    ]
    lighthouse += ["--bind", f"[::]:{port}", "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]
    group = [
        s.python,
        TORCHRUN,
        "--standalone",
        f"--nproc_per_node={per_group}",
        f"--max_restarts={restarts}",
        TRAINER,
        *argv,
    ]
    # The group's status goes through safe_files, which never writes through a link planted at its name.
    status_writer = ["env", f"PYTHONPATH={REPO}", s.python, "-m", "multigpu.safe_files", "write"]
    return f"""#!/bin/bash
# SLURM job written by launch_multi_gpu.sh on {time.strftime("%Y-%m-%d %H:%M:%S")}: fault tolerance (torchft),
# {nodes.count} replica groups, one per node ({group_text(devices)} each), the Lighthouse on the first node.
# A group whose process dies is restarted by its torchrun (up to {restarts} times) and heals from a live peer;
# a lost node's group is left out while the others train on. Submitting it again continues the run.
# Submit: sbatch {shlex.quote(os.path.join(config.save_dir, "launch_slurm.sbatch"))}
{chr(10).join("#SBATCH " + d for d in directives)}

set -uo pipefail
SAVE_DIR={shlex.quote(config.save_dir)}
LIGHTHOUSE_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export TORCHFT_LIGHTHOUSE=http://$LIGHTHOUSE_HOST:{port} SAVE_DIR

# --- the Lighthouse, on the first node beside its group, until the job ends
srun --nodes=1 --ntasks=1 --nodelist="$LIGHTHOUSE_HOST" --overlap --cpus-per-task=1 {quoted(lighthouse)} &
lighthouse=$!
for _ in $(seq 300); do  # until it listens: the groups' first call must find it
    (exec 3<>"/dev/tcp/$LIGHTHOUSE_HOST/{port}") 2>/dev/null && break
    sleep 0.1
done

# --- on every node, one replica group: its number is the node's; its status kept for the verdict below
run_group() {{
    env OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK" {quoted(group)} \
        --ft-replica-id "$SLURM_NODEID" --ft-lighthouse "$TORCHFT_LIGHTHOUSE" \
        2>&1 | sed -u "s/^/[group $SLURM_NODEID] /"
    status=${{PIPESTATUS[0]}}
    echo "$status" | {quoted(status_writer)} "$SAVE_DIR/.group-$SLURM_NODEID.status"
}}
export -f run_group
rm -f "$SAVE_DIR"/.group-*.status
srun --kill-on-bad-exit=0 --nodes={nodes.count} --ntasks-per-node=1 bash -c run_group
kill "$lighthouse" 2>/dev/null
# --- the run finished when some group finished it
grep -qx 0 "$SAVE_DIR"/.group-*.status 2>/dev/null && exit 0
echo "launch_slurm.sbatch: every replica group ended without finishing the run; submit again to continue" >&2
exit 1
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="replica_groups", allow_abbrev=False)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--lighthouse-port", type=int, default=LIGHTHOUSE_PORT)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    parser.add_argument("--devices", default="", help="each group's CUDA_VISIBLE_DEVICES, ';' between groups")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each group")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    try:
        lighthouse, address = start_lighthouse(
            args.lighthouse_port,
            args.min_replicas,
            wait=False,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except UsageError as error:  # no torchft_lighthouse
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    print(f"torchft Lighthouse at {address} (min {args.min_replicas} live groups per step)", flush=True)
    try:
        devices = [device for device in args.devices.split(";") if device]
        # The groups start beside it: each takes seconds to reach its first call, which waits for it meanwhile.
        return supervise(
            command,
            args.groups,
            args.save_dir,
            address,
            devices,
            args.threads,
            lambda: wait_listening(lighthouse, args.lighthouse_port),
        )
    finally:
        lighthouse.terminate()
        lighthouse.wait()


if __name__ == "__main__":
    sys.exit(main())
