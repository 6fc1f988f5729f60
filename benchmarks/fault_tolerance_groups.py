"""Which replica groups of several processes torchft trains on gloo (issue 52): the check behind the table of
docs/fault-tolerance.md. --fault-tolerance itself runs one process per group; this tries the shapes a group of
several could take.

2 replica groups x 2 processes, gloo, a torchft Lighthouse on 127.0.0.1; each group a process group of its own
(torch.distributed, its own store), each rank with torchft's Manager (its group rank, the group's store):

- ddp: DDP inside the group (gloo), then each gradient averaged over the groups by the Manager's all-reduce (rank
  r of every group together), the optimizer stepped when `should_commit()`;
- hsdp: FSDP2 inside the group (parameters sharded over its 2 processes), the replicas' gradients averaged by
  FSDP's all-reduce hook over torchft's ManagedProcessGroup, as torchtitan does (HSDP with a fault-tolerant
  replicate dimension).

Each trains --steps steps on its own data; a shape works when every rank of both groups ends with the same whole
weights (torch.equal), and those moved. Then group 1 is killed and started again: it must heal (the state sent by
group 0's ranks through torchft's state callbacks, each rank its own part) and end equal too.

    python benchmarks/fault_tolerance_groups.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import free_port, machine_line, markdown_table  # noqa: E402

GROUP_SIZE = 2


def rank_main(kind: str, group: int, steps: int, lighthouse: str, out: str) -> None:
    """One rank of one group: train `steps` committed steps, then save its whole weights."""
    os.environ.setdefault("RUST_LOG", "warn")
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.process_group import ManagedProcessGroup

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def state() -> dict:
        return {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": optimizer.state_dict(),
        }

    def load(saved: dict) -> None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        print(f"healed: group {group} rank {rank}", flush=True)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load,
        state_dict=state,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        rank=rank,
        world_size=GROUP_SIZE,
        lighthouse_addr=lighthouse,
        replica_id=f"groups_{group}",
    )
    trained: torch.nn.Module
    if kind == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        replicate = ManagedProcessGroup(manager)
        replicate.register("dp_replicate")
        sharded = fully_shard(model, mesh=init_device_mesh("cpu", (GROUP_SIZE,)))

        def all_reduce_hook(output: torch.Tensor) -> None:
            dist.all_reduce(output, group=replicate, op=dist.ReduceOp.AVG)

        sharded.set_all_reduce_hook(all_reduce_hook)
        trained = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(group * GROUP_SIZE + rank)
    # Until `steps`, and then on until both groups are in the quorum again (a killed group back and healed).
    while manager.current_step() < steps or manager.num_participants() < 2:
        manager.start_quorum()
        inputs = torch.randn(4, 8, generator=data)
        trained(inputs).square().mean().backward()
        if kind == "ddp":  # the group's average, then the groups'
            for param in model.parameters():
                manager.allreduce(param.grad).wait()
        if manager.should_commit():
            optimizer.step()
        optimizer.zero_grad()
        Path(f"{out}.step").write_text(f"{manager.current_step()} {os.getpid()}")  # for the driver's kill
        time.sleep(0.02)
    whole = {
        name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
        for name, value in model.state_dict().items()
    }
    torch.save({"weights": whole, "step": manager.current_step()}, out)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def start_group(
    kind: str, group: int, steps: int, lighthouse: str, folder: Path, attempt: int
) -> subprocess.Popen:
    """One group: torchrun's 2 processes, each a rank_main."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={GROUP_SIZE}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        __file__,
        "rank",
        kind,
        str(group),
        str(steps),
        lighthouse,
        str(folder / f"{kind}-g{group}-a{attempt}"),
    ]
    log = open(folder / f"{kind}-g{group}-a{attempt}.log", "w")  # noqa: SIM115  # closed with the process
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn"}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def outcome(kind: str, folder: Path, attempts: dict[int, int]) -> dict:
    """Whether every rank of both groups ended with equal whole weights that moved from the start."""
    import torch

    saved = []
    for group, attempt in attempts.items():
        for rank in range(GROUP_SIZE):
            path = folder / f"{kind}-g{group}-a{attempt}-r{rank}.pt"
            if not path.exists():
                log = (folder / f"{kind}-g{group}-a{attempt}.log").read_text()
                errors = [line for line in log.splitlines() if "Error" in line or "error" in line]
                return {"works": False, "why": (errors[-1] if errors else log[-300:]).strip()[:300]}
            saved.append(torch.load(path, weights_only=False))
    first = saved[0]["weights"]
    equal = all(torch.equal(first[name], other["weights"][name]) for other in saved[1:] for name in first)
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).state_dict()
    moved = not all(torch.equal(start[name], first[name]) for name in first)
    healed = attempts[1] == 0 or "healed: group 1" in (folder / f"{kind}-g1-a1.log").read_text()
    return {
        "works": equal and moved and healed,
        "equal": equal,
        "moved": moved,
        "healed": healed,
        "steps": [s["step"] for s in saved],
    }


def _step_and_pid(path: Path) -> tuple[int, int]:
    """A rank's last committed step and its process id, as it wrote them (-1 until it has)."""
    try:
        step, pid = path.read_text().split()
        return int(step), int(pid)
    except (OSError, ValueError):  # not written yet, or being written
        return -1, -1


def check(kind: str, steps: int, lighthouse: str, folder: Path, heal: bool) -> dict:
    folder.mkdir(parents=True)
    groups = {group: start_group(kind, group, steps, lighthouse, folder, 0) for group in range(2)}
    attempts = {0: 0, 1: 0}
    if heal:  # once group 1 trained a while, and well before the end, so that it comes back to a live peer
        progress = [folder / f"{kind}-g1-a0-r{rank}.pt.step" for rank in range(GROUP_SIZE)]
        ranks = [_step_and_pid(path) for path in progress]
        while not all(step >= steps // 10 for step, _ in ranks):
            time.sleep(0.05)
            ranks = [_step_and_pid(path) for path in progress]
        groups[1].kill()  # torchrun, then its ranks (each in a session of its own), by their process ids
        for _, pid in ranks:
            os.kill(pid, signal.SIGKILL)
        groups[1].wait()
        groups[1] = start_group(kind, 1, steps, lighthouse, folder, 1)
        attempts[1] = 1
    for process in groups.values():
        try:
            process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
    return outcome(kind, folder, attempts)


def main() -> int:
    if sys.argv[1:2] == ["rank"]:
        kind, group, steps, lighthouse, out = sys.argv[2:7]
        rank_main(kind, int(group), int(steps), lighthouse, f"{out}-r{os.environ['RANK']}.pt")
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kinds", default="ddp,hsdp", help="which group shapes, of ddp and hsdp")
    parser.add_argument(
        "--heal", choices=("both", "only", "no"), default="both", help="also kill and heal group 1"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    import tempfile

    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse's own log: its warnings only
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    lighthouse = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    results = {}
    with tempfile.TemporaryDirectory(prefix="ft-groups-") as temporary:
        for kind in args.kinds.split(","):
            for heal in {"both": (False, True), "only": (True,), "no": (False,)}[args.heal]:
                label = f"{kind}{', group 1 killed and healed' if heal else ''}"
                results[label] = check(
                    kind, args.steps, lighthouse, Path(temporary) / label.replace(" ", "_"), heal
                )
                print(label, results[label], flush=True)
    server.shutdown()
    print(machine_line())
    rows = [
        [label, "yes" if r["works"] else "no", r.get("why", f"equal {r['equal']}, steps {r['steps']}")]
        for label, r in results.items()
    ]
    print(markdown_table(["2 groups x 2 processes, gloo", "works", "detail"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
