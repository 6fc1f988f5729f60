"""What a lost process costs: --fault-tolerance's replica groups (torchft) against a restart from checkpoint (issue 52).

The same run twice, each process killed by SIGKILL (as a lost node's are) once it has finished step --kill-at:

- fault tolerance: 2 replica groups x 1 process (x --group-size processes, each group a torchrun job of
  --group-mode ddp or fsdp), gloo, a torchft Lighthouse on 127.0.0.1. Group 1 is killed (its last rank, which
  ends its torchrun job); group 0 goes on alone. Measured: the time from the kill to group 0's next committed
  step, beside its bound (--dist-timeout for a step whose all-reduce hangs, plus the Lighthouse's heartbeat
  timeout and one quorum tick before a quorum leaves the lost group out); the steps no group committed. Group
  1 is started again and heals from group 0: the time from its start to its first committed step, and, at that
  step, whether every parameter and optimizer tensor is torch.equal in both groups and their step counters
  match. With --second-kill, group 0 is then killed too, and group 1 must train on alone, lead, and write the
  run's checkpoints.
- restart from checkpoint: one torchrun job of 2 processes (DDP, the same data-parallel width) with
  --max-restarts 1 and a checkpoint every --save-every steps; rank 1 is killed, torchrun restarts both, and they
  resume from the newest checkpoint. Measured: the steps lost (trained again) and the time from the kill until
  the run trains a step beyond the one it was killed after.

    python benchmarks/fault_tolerance.py                       # both, the figures of docs/measured.md
    python benchmarks/fault_tolerance.py --tiny --second-kill  # the fault-tolerance side only, as the tests run it
    python benchmarks/fault_tolerance.py --tiny --group-size 2 --group-mode fsdp   # groups of 2 processes
    python benchmarks/fault_tolerance.py group --timeline F -- TRAINER FLAGS   # one process (the driver's)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import free_port, machine_line, markdown_table  # noqa: E402

# A tiny model on synthetic data: what is measured is the loss and the return of a process, not compute.
TRAINER = [
    "--mode",
    "flatten",
    "--image-shape",
    "1,4,4",
    "--num-classes",
    "2",
    "--train-size",
    "100000",
    "--val-size",
    "64",
    "--batch-size",
    "8",
    "--epochs",
    "1",
    "--no-progress",
    "--log-every",
    "1000",
]
WAIT_SECONDS = 240.0  # for any one thing a process should do: a hang fails the run instead of stalling it


# ---------------------------------------------------------------- one process of the run
class Timeline:
    """A callback: each step's end as a JSON line (step, committed, the quorum's groups, time), and under
    --fault-tolerance the trainer's state dumped at the step a lost group rejoined, in the group that healed
    and in the ones that kept it alive. `step_seconds` paces the steps, so that a step is as long in both runs."""

    def __init__(self, path: str, step_seconds: float):
        self.path, self.step_seconds = path, step_seconds
        self.full: bool | None = None  # whether the previous step's quorum had every group

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")

    def on_fit_start(self, trainer: Any) -> None:
        replicas = trainer.replicas
        self._write(
            {
                "event": "start",
                "pid": os.getpid(),
                "step": trainer.progress.global_step,
                "healed_at": replicas.healed_at if replicas else None,
                "time": time.time(),
            }
        )

    def on_step_end(self, trainer: Any) -> None:
        import torch

        step, replicas = trainer.progress.global_step, trainer.replicas
        live = replicas.groups.live_groups() if replicas else []
        committed = replicas.committed if replicas else True
        leads = trainer.runtime.leads
        self._write({"step": step, "committed": committed, "live": live, "leads": leads, "time": time.time()})
        if replicas is not None:
            full = len(live) == replicas.groups.groups
            if committed and (step == replicas.healed_at or (full and self.full is False)):
                state = {
                    "step": step,
                    "committed_steps": replicas.groups.committed_steps,
                    "model": local(trainer.model.state_dict()),
                    "optimizer": local(trainer.optimizer.state_dict()),
                }
                torch.save(state, f"{self.path}.step{step}.pt")
            self.full = full
        if self.step_seconds:
            time.sleep(self.step_seconds)


def local(state: Any) -> Any:
    """`state` with each fsdp DTensor as this rank's own shard (its counterpart in another group holds the
    same)."""
    if isinstance(state, dict):
        return {key: local(value) for key, value in state.items()}
    if isinstance(state, list):
        return [local(value) for value in state]
    return state.to_local() if hasattr(state, "to_local") else state


def group_main(argv: Sequence[str]) -> int:
    from multigpu.launch.runner import train_from_argv

    cut = list(argv).index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="fault_tolerance.py group", allow_abbrev=False)
    parser.add_argument("--timeline", required=True, help="its file; {rank} is the process's rank")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args(argv[:cut])
    path = args.timeline.format(rank=os.environ.get("RANK", "0"))
    return train_from_argv(argv[cut + 1 :], callbacks=[Timeline(path, args.step_seconds)])


# ---------------------------------------------------------------- the driver
def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(find: Callable[[], Any], what: str, processes: Sequence[subprocess.Popen] = ()) -> Any:
    """Poll `find` until it gives something; a process of `processes` ending first, or WAIT_SECONDS, fails."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        found = find()
        if found:
            return found
        ended = [process for process in processes if process.poll() is not None]
        if ended or time.monotonic() > deadline:
            output = "".join(_output(process) for process in ended)
            sys.exit(
                f"fault_tolerance.py: gave up waiting for {what}{' (a process ended)' if ended else ''}\n{output}"
            )
        time.sleep(0.02)


def _output(process: subprocess.Popen) -> str:
    """The end of what a process the driver started wrote (its log, named when it was started)."""
    log = getattr(process, "log_path", None)
    return f"--- {log} (status {process.poll()}):\n{Path(log).read_text()[-3000:]}\n" if log else ""


def start(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "a") as file:  # the process keeps its own copy of the descriptor
        process = subprocess.Popen(
            command,
            stdout=file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
            cwd=REPO,
        )
    process.log_path = log  # type: ignore[attr-defined]  # for _output
    return process


def group_command(
    timeline: Path, step_seconds: float, trainer: list[str], torchrun: Sequence[str] = ()
) -> list[str]:
    script = [str(Path(__file__).resolve()), "group", "--timeline", str(timeline)]
    script += ["--step-seconds", str(step_seconds), "--", *trainer]
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", *torchrun, *script]
    return [sys.executable, *script]


def kill_after(timeline: Path, step: int, processes: Sequence[subprocess.Popen]) -> tuple[int, float]:
    """SIGKILL the process that wrote `timeline` once it has finished `step`: (its last step, the kill's time)."""
    entries = wait_for(
        lambda: [entry for entry in read(timeline) if entry.get("step", -1) >= step and "event" not in entry],
        f"step {step} in {timeline.name}",
        processes,
    )
    pid = [entry for entry in read(timeline) if entry.get("event") == "start"][-1]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    done = [entry for entry in read(timeline) if "event" not in entry]
    return max(entry["step"] for entry in done) if done else entries[0]["step"], killed


def first_after(timeline: Path, moment: float, after_step: int = -1, without: int | None = None) -> Any:
    """The first committed step of `timeline` written after `moment`, beyond `after_step`, and (`without`) by a
    quorum that left that group out: a step already under way at the kill may still have had it."""
    for entry in read(timeline):
        if "event" in entry or entry["time"] <= moment or entry["step"] <= after_step:
            continue
        if entry["committed"] and without not in entry["live"]:
            return entry
    return None


def median_step_seconds(entries: list[dict[str, Any]]) -> float:
    times = [entry["time"] for entry in entries if "event" not in entry]
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def compare_ranks(pairs: Sequence[tuple[Path, Path]]) -> dict[str, Any]:
    """compare_dumps of each rank's pair (rank r of one group, rank r of the other), summed up."""
    each = [compare_dumps(*pair) for pair in pairs]
    return {
        "tensors_compared": sum(one["tensors_compared"] for one in each),
        "all_equal": all(one["all_equal"] for one in each),
        "steps": sorted({step for one in each for step in one["steps"]}),
        "committed_steps": sorted({step for one in each for step in one["committed_steps"]}),
    }


def compare_dumps(first: Path, second: Path) -> dict[str, Any]:
    """Whether two groups' dumps at the same step hold equal tensors (torch.equal) and step counters."""
    import torch

    one, two = torch.load(first, weights_only=False), torch.load(second, weights_only=False)
    tensors = [(one["model"][name], two["model"][name]) for name in one["model"]]
    for index, state in one["optimizer"]["state"].items():
        tensors += [(value, two["optimizer"]["state"][index][key]) for key, value in state.items()]
    return {
        "tensors_compared": len(tensors),
        "all_equal": all(torch.equal(a, b) for a, b in tensors),
        "steps": [one["step"], two["step"]],
        "committed_steps": [one["committed_steps"], two["committed_steps"]],
    }


def fault_tolerance_run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from multigpu.launch.replica_groups import start_lighthouse

    lighthouse = None
    address = args.lighthouse
    if address is None:
        lighthouse, address = start_lighthouse(
            0, 1, heartbeat_timeout_ms=args.heartbeat_ms, quorum_tick_ms=args.tick_ms, join_timeout_ms=1000
        )
    save_dir = folder / "ft-run"
    trainer = [
        *TRAINER,
        "--fault-tolerance",
        "--ft-replica-groups",
        "2",
        "--ft-lighthouse",
        address,
        "--save-dir",
        str(save_dir),
        "--dist-timeout",
        str(args.dist_timeout),
        "--save-every-steps",
        str(args.save_every),
    ]
    ranks = range(args.group_size)
    timelines = [[folder / f"ft-group{group}-rank{rank}.jsonl" for rank in ranks] for group in range(2)]
    leaders = [timelines[group][0] for group in range(2)]  # each group's rank 0
    last_ranks = [timelines[group][-1] for group in range(2)]  # the process killed in each group

    def launch(group: int) -> subprocess.Popen:
        return start(group_run(args, folder, group, trainer), folder / f"ft-group{group}.log")

    groups = [launch(0), launch(1)]
    try:
        killed_after, killed = kill_after(last_ranks[1], args.kill_at, groups)
        back = wait_for(
            lambda: first_after(leaders[0], killed, without=1), "group 0's next commit", groups[:1]
        )
        before = [entry for entry in read(leaders[0]) if entry.get("time", 0) < killed]
        uncommitted = [entry["step"] for entry in read(leaders[0]) if entry.get("committed") is False]
        groups[1].wait(timeout=WAIT_SECONDS)  # a torchrun job ends its other processes when one dies
        restarted = time.time()
        groups[1] = launch(1)

        def started_again() -> list[dict[str, Any]]:
            return [e for e in read(leaders[1]) if e.get("event") == "start" and e["time"] > restarted]

        healed = wait_for(started_again, "group 1's start after its restart", groups)[0]
        rejoined = wait_for(lambda: first_after(leaders[1], restarted), "group 1's first commit", groups)
        dumps = [
            (
                Path(f"{timelines[0][rank]}.step{rejoined['step']}.pt"),
                Path(f"{timelines[1][rank]}.step{rejoined['step']}.pt"),
            )
            for rank in ranks
        ]
        wait_for(
            lambda: all(dump.exists() for pair in dumps for dump in pair),
            "both groups' state at the rejoin",
            groups,
        )
        result = {
            "group_size": args.group_size,
            "group_mode": args.group_mode if args.group_size > 1 else "none",
            "kill_after_step": killed_after,
            "normal_step_seconds": median_step_seconds(before),
            "kill_to_next_commit_seconds": back["time"] - killed,
            "next_commit_step": back["step"],
            "next_commit_live_groups": back["live"],
            "uncommitted_steps": uncommitted,
            "stall_bound_seconds": args.dist_timeout + (args.heartbeat_ms + args.tick_ms) / 1000,
            "restart_to_first_commit_seconds": rejoined["time"] - restarted,
            "healed_at": healed["healed_at"],
            "rejoined_step": rejoined["step"],
            "rejoined_live_groups": rejoined["live"],
            "at_rejoin": compare_ranks(dumps),
        }
        if args.second_kill:
            result["second_kill"] = second_kill(
                args, leaders, last_ranks, groups, rejoined["step"] + 2, save_dir
            )
        for process in groups:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # a clean stop: the leading group saves last.pt
        result["exit_statuses"] = [process.wait(timeout=WAIT_SECONDS) for process in groups]
        result["group_output"] = [(folder / f"ft-group{group}.log").read_text() for group in range(2)]
        return result
    finally:
        for process in groups:
            if process.poll() is None:
                process.kill()
        if lighthouse is not None:
            lighthouse.terminate()


def group_run(args: argparse.Namespace, folder: Path, group: int, trainer: list[str]) -> list[str]:
    """Replica group `group`'s command: one process, or a torchrun job of --group-size processes (no restarts:
    the driver starts it again)."""
    timeline = folder / f"ft-group{group}-rank{{rank}}.jsonl"
    flags = [*trainer, "--ft-replica-id", str(group)]
    if args.group_size == 1:
        return group_command(timeline, args.step_seconds, flags)
    torchrun = ["--standalone", f"--nproc_per_node={args.group_size}", "--max-restarts=0"]
    return group_command(timeline, args.step_seconds, [*flags, "--multi-gpu", args.group_mode], torchrun)


def second_kill(
    args: argparse.Namespace,
    leaders: list[Path],
    last_ranks: list[Path],
    groups: list[subprocess.Popen],
    step: int,
    save_dir: Path,
) -> dict[str, Any]:
    """Group 0 killed after the heal: group 1 must commit on alone, lead, and write the run's checkpoints."""
    killed_after, killed = kill_after(last_ranks[0], step, groups)
    back = wait_for(lambda: first_after(leaders[1], killed, without=0), "group 1's next commit", groups[1:])
    saved = wait_for(
        lambda: [
            entry
            for entry in read(leaders[1])
            if entry.get("time", 0) > killed and entry["step"] % args.save_every == 0 and entry["leads"]
        ],
        "a checkpoint step of group 1 alone",
        groups[1:],
    )[0]
    checkpoint = save_dir / f"step-{saved['step']:09d}.pt"
    wait_for(checkpoint.exists, f"{checkpoint.name} written by group 1", groups[1:])
    return {
        "kill_after_step": killed_after,
        "kill_to_next_commit_seconds": back["time"] - killed,
        "next_commit_live_groups": back["live"],
        "leads_after": back["leads"],
        "checkpoint": str(checkpoint),
    }


def restart_run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The same run as one torchrun job of 2 processes, --max-restarts 1, rank 1 killed after --kill-at."""
    trainer = [
        *TRAINER,
        "--multi-gpu",
        "ddp",
        "--save-dir",
        str(folder / "restart-run"),
        "--dist-timeout",
        str(args.dist_timeout),
        "--save-every-steps",
        str(args.save_every),
    ]
    timeline = str(folder / "restart-rank{rank}.jsonl")
    torchrun = [
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
    ]
    job = start(group_command(Path(timeline), args.step_seconds, trainer, torchrun), folder / "restart.log")
    ranks = [Path(timeline.format(rank=rank)) for rank in range(2)]
    try:
        killed_after, killed = kill_after(ranks[1], args.kill_at, [job])
        back = wait_for(
            lambda: first_after(ranks[0], killed, after_step=killed_after), "a step beyond the kill", [job]
        )
        resumed = [
            entry for entry in read(ranks[0]) if entry.get("event") == "start" and entry["time"] > killed
        ][0]
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=WAIT_SECONDS)
        return {
            "kill_after_step": killed_after,
            "resumed_from_step": resumed["step"],
            "steps_lost": killed_after - resumed["step"],
            "kill_to_next_new_step_seconds": back["time"] - killed,
            "normal_step_seconds": median_step_seconds(
                [e for e in read(ranks[0]) if e.get("time", 0) < killed]
            ),
        }
    finally:
        if job.poll() is None:
            job.kill()


def table(ft: dict[str, Any], restart: dict[str, Any] | None, args: argparse.Namespace) -> str:
    lost = len([step for step in ft["uncommitted_steps"] if step > ft["kill_after_step"] - 1])
    rows = [
        [
            "killed (SIGKILL) after step",
            restart["kill_after_step"] if restart else "-",
            ft["kill_after_step"],
        ],
        [
            "steps lost (trained again, or not committed)",
            restart["steps_lost"] if restart else "-",
            f"{lost} not committed",
        ],
        [
            "from the kill to the next new step",
            f"{restart['kill_to_next_new_step_seconds']:.2f} s" if restart else "-",
            f"{ft['kill_to_next_commit_seconds']:.2f} s (bound {ft['stall_bound_seconds']:.1f} s)",
        ],
        [
            "the lost process's share of the data",
            "trained again after the restart",
            f"skipped from step {ft['kill_after_step'] + 1} until it rejoined at step {ft['rejoined_step']}",
        ],
        [
            "the restarted process: start to first committed step",
            "-",
            f"{ft['restart_to_first_commit_seconds']:.2f} s (healed, no checkpoint read)",
        ],
        [
            "at its first commit: tensors torch.equal, step counters",
            "-",
            f"{ft['at_rejoin']['all_equal']} ({ft['at_rejoin']['tensors_compared']} tensors), "
            f"{ft['at_rejoin']['steps']} / {ft['at_rejoin']['committed_steps']}",
        ],
        [
            "a normal step",
            f"{restart['normal_step_seconds'] * 1000:.0f} ms" if restart else "-",
            f"{ft['normal_step_seconds'] * 1000:.0f} ms",
        ],
    ]
    header = [
        "",
        f"restart from checkpoint (torchrun --max-restarts 1, a checkpoint every {args.save_every} steps)",
        f"--fault-tolerance (2 replica groups x {args.group_size} "
        f"process{'es' if args.group_size > 1 else ''}, torchft)",
    ]
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["group"]:
        return group_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kill-at", type=int, default=30, help="the step after which a process is killed")
    parser.add_argument("--save-every", type=int, default=20, help="--save-every-steps of both runs")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="each step paced to at least this")
    parser.add_argument(
        "--dist-timeout", type=float, default=10.0, help="--dist-timeout (the process groups')"
    )
    parser.add_argument("--heartbeat-ms", type=int, default=1000, help="the Lighthouse's heartbeat timeout")
    parser.add_argument("--tick-ms", type=int, default=100, help="the Lighthouse's quorum tick")
    parser.add_argument("--lighthouse", help="an address of a running Lighthouse to use (default: start one)")
    parser.add_argument("--second-kill", action="store_true", help="then kill group 0 too (the tests' check)")
    parser.add_argument(
        "--tiny", action="store_true", help="the fault-tolerance run only (no restart baseline)"
    )
    parser.add_argument("--group-size", type=int, default=1, help="processes per replica group (torchrun)")
    parser.add_argument(
        "--group-mode", choices=["ddp", "fsdp"], default="ddp", help="--multi-gpu within a group of several"
    )
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--folder", help="keep the runs' files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ft-bench-") as temporary:
        folder = Path(args.folder or temporary)
        folder.mkdir(parents=True, exist_ok=True)
        load_before = os.getloadavg()[0]
        ft = fault_tolerance_run(args, folder)
        restart = None if args.tiny else restart_run(args, folder)
        load_after = os.getloadavg()[0]
    print(machine_line())
    print(
        f"load average {load_before:.1f} before, {load_after:.1f} after (2 groups and a restart share the cores)"
    )
    print(table(ft, restart, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"fault_tolerance": ft, "restart": restart}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
