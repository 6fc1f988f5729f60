"""A real single-node SLURM cluster for tests: munged, slurmctld and slurmd on a temporary configuration.

Debian's `slurm-wlm` and `munge` (scripts/setup_slurm.sh installs them) run as root
here, so one machine is a whole cluster: the controller and the node daemon on
free ports of 127.0.0.1, MUNGE on a socket of its own, all state in one
temporary folder, nothing under /etc touched. Tests use it through the
`slurm_cluster` fixture (tests/conftest.py), which cancels what a test left
queued; the daemons are stopped by PID at the end of the session.

What a single node needs, found by running it (Slurm 22.05): SlurmctldHost is
this host's short name with address 127.0.0.1; the node line is `slurmd -C`'s
own (its real CPUs, sockets and memory, else slurmd refuses to register);
ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups in a
container); SelectType=select/cons_tres; ReturnToService=2, so the node comes up
idle; StateSaveLocation and SlurmdSpoolDir in the temporary folder; no
accounting. A requeued job may start again only once its launch credential
expired (120 s by default): cred_expire=5 and a scheduler that looks every
second make that a few seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel")
START_TIMEOUT = 30  # seconds for the node to come up idle
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def why_not_available() -> str | None:
    """None when a cluster can start here, else the reason (for a pytest skip)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} missing): bash scripts/setup_slurm.sh installs "
            f"Debian's slurm-wlm and munge"
        )
    if os.geteuid() != 0:
        return "the single-node SLURM test runs its daemons as root, and this is not root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """munged, slurmctld and slurmd of our own, started in `root`; `env` points the SLURM commands at them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: dict[str, subprocess.Popen] = {}
        self.submitted: list[str] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    # ------------------------------------------------------------------ daemons
    def start(self) -> SlurmCluster:
        for folder in ("state", "spool", "munge", "log"):
            (self.root / folder).mkdir(mode=0o755, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._write_config()
        munge = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge / 'munge.socket'}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        self._wait_for(lambda: (munge / "munge.socket").exists(), "munged to open its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.env["SLURM_CONF"]])
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.env["SLURM_CONF"], "-N", self.node])
        self._wait_for(lambda: self.node_state() == "idle", "the node to come up idle")
        return self

    def _write_config(self) -> None:
        self.node = socket.gethostname().split(".")[0]
        hardware = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
        node_line = next(line for line in hardware.splitlines() if line.startswith("NodeName="))
        node_line = re.sub(r"^NodeName=\S+", f"NodeName={self.node} NodeAddr=127.0.0.1", node_line)
        root = self.root
        (root / "slurm.conf").write_text(f"""\
ClusterName=tests
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root / "munge" / "munge.socket"},cred_expire=5
CryptoType=crypto/munge
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{node_line} State=UNKNOWN
PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115  (closed with the process)
        self.processes[name] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

    def _wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not condition():
            dead = [name for name, process in self.processes.items() if process.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"SLURM test cluster: waiting for {what} failed ({', '.join(dead) or 'timeout'}"
                    f" ); logs in {self.root / 'log'}:\n{self.logs()}"
                )
            time.sleep(0.2)  # polling the daemons' state

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text()[-2000:]}" for path in sorted((self.root / "log").iterdir())
        )

    def stop(self) -> None:
        """Stop the daemons by PID, node first: SIGTERM, then SIGKILL for one that does not go."""
        for name in reversed(DAEMONS):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    # ------------------------------------------------------------------ jobs
    def run(self, *command: str) -> str:
        result = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
        return result.stdout

    def node_state(self) -> str:
        try:
            return self.run("sinfo", "-h", "-n", self.node, "-o", "%T").strip()
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""

    def submit(self, script: Path, *options: str, cwd: Path | None = None) -> str:
        """sbatch [options] `script`; the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script)],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=cwd,
            timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {result.stderr.strip()}")
        return self.track(result.stdout.strip().split(";")[0])

    def track(self, job: str) -> str:
        """Remember a job submitted some other way (e.g. by the launcher), to cancel it if a test leaves it."""
        self.submitted.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, ExitCode, Restarts, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: str, timeout: float, until: frozenset = frozenset(FINISHED)) -> dict[str, str]:
        """Poll until the job's state is one of `until`; fail with its output past `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job)
            if fields.get("JobState") in until:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} still {fields.get('JobState')} after {timeout}s")
            time.sleep(0.5)  # polling slurmctld

    def wait_array(self, job: str, timeout: float) -> list[str]:
        """Poll until every task of job array `job` has finished; their states, in task order."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [
                line for line in self.run("scontrol", "show", "job", "-o", job).splitlines() if line.strip()
            ]
            states = [dict(re.findall(r"(\w+)=(\S*)", line)).get("JobState", "") for line in lines]
            if states and all(state in FINISHED for state in states):
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"job array {job} still {states} after {timeout}s")
            time.sleep(0.5)  # polling slurmctld

    def signal(self, job: str, name: str, batch: bool = False) -> None:
        """scancel --signal=NAME: to the job's steps, or with `batch` to its batch script only."""
        self.run("scancel", f"--signal={name}", *(["--batch"] if batch else []), job)

    def cancel_left_over(self) -> None:
        for job in self.submitted:
            subprocess.run(["scancel", job], capture_output=True, env=self.env, timeout=60)
        self.submitted.clear()
