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
from multigpu.errors import UsageError  # noqa: E402

LIGHTHOUSE_PORT = 29510  # torchft's own default
LIGHTHOUSE_BINARY = "torchft_lighthouse"
# How the Lighthouse decides (torchft's flags): a group is dead after HEARTBEAT_TIMEOUT_MS without a heartbeat;
# quorums are checked every QUORUM_TICK_MS; a group heartbeating but not yet asking is waited for JOIN_TIMEOUT_MS.
HEARTBEAT_TIMEOUT_MS = 5000
QUORUM_TICK_MS = 100
JOIN_TIMEOUT_MS = 60000
STARTUP_SECONDS = 30.0  # for the Lighthouse to listen


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
    return [
        lighthouse_binary(),
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


def start_lighthouse(port: int = 0, min_replicas: int = 1, **timing: int) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on this machine at `port` (0: a free one), running and listening; its process and
    the address the groups give as --ft-lighthouse. `timing`: lighthouse_command's milliseconds."""
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
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:  # until it accepts a connection: the groups' first call must find it
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise UsageError(
                    f"torchft's Lighthouse did not start on port {port} (its status {process.wait()}): is the "
                    f"port in use? give another with --lighthouse-port"
                ) from None
            time.sleep(0.05)
    return process, f"http://127.0.0.1:{port}"  # the groups of a local run are on this machine


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
) -> int:
    """Run `groups` replica groups of `command` against the Lighthouse at `lighthouse` and wait for them; a
    SIGTERM or Ctrl-C here reaches every group (each stops cleanly). The exit status as the module's doc says."""
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="replica_groups", allow_abbrev=False)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--lighthouse-port", type=int, default=LIGHTHOUSE_PORT)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    parser.add_argument("--devices", default="", help="comma-separated: group I's CUDA_VISIBLE_DEVICES")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each group")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    try:
        lighthouse, address = start_lighthouse(
            args.lighthouse_port, args.min_replicas, heartbeat_timeout_ms=args.heartbeat_timeout_ms
        )
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    print(f"torchft Lighthouse at {address} (min {args.min_replicas} live groups per step)", flush=True)
    try:
        devices = [device for device in args.devices.split(",") if device]
        return supervise(command, args.groups, args.save_dir, address, devices, args.threads)
    finally:
        lighthouse.terminate()
        lighthouse.wait()


if __name__ == "__main__":
    sys.exit(main())
