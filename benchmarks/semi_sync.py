"""Training across a slow link: DDP against --semi-sync (torchft's LocalSGD and DiLoCo) between two replica groups
that sit in two network namespaces joined by a veth pair, shaped by `tc` (issue 60).

Each group is one process in its own network namespace (`ip netns`), with its own host name; the two are joined by
a veth pair whose both ends are rate-limited by a `tbf` qdisc (--rate, e.g. 100mbit), so every byte between the
groups crosses the shaped link: the gradients or outer gradients, the Lighthouse's quorums (it runs in the first
namespace) and the groups' stores. `netem` (delay) is added only where the kernel has it. The same runs then go
over the veth unshaped (--fast: a link as fast as this machine's loopback). Per run: the wall time of the training,
the bytes between groups per step as the run counted them and as the veth carried them (its tx counters: every
packet, headers and quorums included), and the validation loss after the same number of steps and tokens.

- ddp: torchrun across the two namespaces (--nnodes 2), every step's gradients all-reduced over the link;
- local-sgd, diloco (--sync-every H) and diloco with --fragments 2: --fault-tolerance --semi-sync, a torchft
  Lighthouse in the first namespace.

The model: the built-in character-level GPT (--model gpt) shaped by --n-layer/--n-head/--n-embd (GPT-2 small's
12/12/768 by default), on the text of this checkout's guide (its .md files). It needs root (namespaces, tc); where
it cannot make them it says so in one line and runs the unshaped link only, on 127.0.0.1.

    sudo python benchmarks/semi_sync.py                                   # GPT-2 small's shape, 100 Mbit/s
    python benchmarks/semi_sync.py --n-layer 6 --n-head 6 --n-embd 384 --steps 32 --output results/semi_sync.md
    python benchmarks/semi_sync.py run --summary F -- TRAINER FLAGS       # one process (the driver's)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_common import machine_line, write_markdown  # noqa: E402

METHODS = ("ddp", "local-sgd", "diloco", "diloco, 2 fragments")
SUBNET = "10.60.{}"  # the veth pair's addresses: .1 and .2 of a /24 named by this process's id
RUN_SECONDS = 3600.0  # the most one run may take


# ---------------------------------------------------------------- one process of a run
class TrainingClock:
    """A callback: the seconds from training's start (after the groups' first quorum, or DDP's set-up) to the
    last step's end (its sync included), without the processes' start or the final evaluation."""

    def __init__(self) -> None:
        self.started = 0.0
        self.last_step_end = 0.0

    def on_fit_start(self, trainer: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, trainer: Any) -> None:
        self.last_step_end = time.perf_counter()


def run_main(argv: Sequence[str]) -> int:
    """One process: train on TRAINER FLAGS and write fit's summary and the training's seconds to --summary (rank 0
    of a DDP run; each group's own under --fault-tolerance)."""
    from multigpu.launch.runner import train_from_argv

    cut = list(argv).index("--")
    parser = argparse.ArgumentParser(prog="semi_sync.py run", allow_abbrev=False)
    parser.add_argument("--summary", required=True)
    args = parser.parse_args(argv[:cut])
    clock = TrainingClock()

    def write(summary: dict[str, Any]) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            numbers = {key: value for key, value in summary.items() if isinstance(value, (int, float))}
            numbers["train_seconds"] = clock.last_step_end - clock.started
            Path(args.summary).write_text(json.dumps(numbers))

    return train_from_argv(argv[cut + 1 :], on_summary=write, callbacks=[clock])


# ---------------------------------------------------------------- the link
@dataclass
class Side:
    """One end of the link: a network namespace (None: this one), its host name and address, its veth."""

    namespace: str | None
    host: str
    address: str
    device: str | None

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this side's namespace, under its own host name (so that torchft's and gloo's
        addresses, which come from the host name, are this side's)."""
        if self.namespace is None:
            return list(argv)
        inner = 'hostname "$0" && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "sh",
            "-c",
            inner,
            self.host,
            *argv,
        ]

    def sent_bytes(self) -> int | None:
        """What this side's veth has sent (its tx counter); None on the loopback."""
        if self.namespace is None:
            return None
        counter = f"/sys/class/net/{self.device}/statistics/tx_bytes"
        read = subprocess.run(
            ["ip", "netns", "exec", self.namespace, "cat", counter], capture_output=True, text=True
        )
        return int(read.stdout)


class Link:
    """Two network namespaces joined by a veth pair, each end shaped to `rate` (None: unshaped); made on entry,
    removed on exit, their /etc/netns hosts files too."""

    def __init__(self, rate: str | None, delay_ms: float):
        tag = os.getpid() % 250 + 1
        self.rate = rate
        self.delay_ms = delay_ms
        self.names = [f"semisync{tag}a", f"semisync{tag}b"]
        subnet = SUBNET.format(tag)
        self.sides = [
            Side(self.names[index], f"semi-sync-{index}", f"{subnet}.{index + 1}", f"ss{tag}{'ab'[index]}")
            for index in range(2)
        ]
        self.delay = "off"

    def __enter__(self) -> Link:
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        first = self.sides[0]
        second = self.sides[1]
        for side in self.sides:
            run(["ip", "netns", "add", side.namespace])
            hosts = Path("/etc/netns") / str(side.namespace) / "hosts"
            hosts.parent.mkdir(parents=True, exist_ok=True)
            names = "".join(f"{other.address} {other.host}\n" for other in self.sides)
            hosts.write_text(f"127.0.0.1 localhost\n{names}")
        run(["ip", "link", "add", first.device, "type", "veth", "peer", "name", second.device])
        for side in self.sides:
            run(["ip", "link", "set", side.device, "netns", side.namespace])
            inside = ["ip", "netns", "exec", side.namespace]
            run([*inside, "ip", "addr", "add", f"{side.address}/24", "dev", side.device])
            run([*inside, "ip", "link", "set", side.device, "up"])
            run([*inside, "ip", "link", "set", "lo", "up"])
            if self.rate:
                shape = ["tc", "qdisc", "add", "dev", side.device, "root"]
                if self.delay_ms and has_netem(inside, side.device):
                    run([*inside, *shape, "handle", "1:", "netem", "delay", f"{self.delay_ms / 2:g}ms"])
                    shape = ["tc", "qdisc", "add", "dev", side.device, "parent", "1:1", "handle", "10:"]
                    self.delay = f"{self.delay_ms:g} ms round trip (netem)"
                run([*inside, *shape, "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"])

    def __exit__(self, *exc: Any) -> None:
        for side in self.sides:
            subprocess.run(["ip", "netns", "del", str(side.namespace)], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / str(side.namespace), ignore_errors=True)

    def sent_bytes(self) -> int:
        return sum(side.sent_bytes() or 0 for side in self.sides)


def has_netem(inside: list[str], device: str | None) -> bool:
    """Whether this kernel has netem (many have tbf and htb only)."""
    probe = subprocess.run(
        [*inside, "tc", "qdisc", "add", "dev", str(device), "root", "netem", "delay", "1ms"],
        capture_output=True,
    )
    if probe.returncode:
        return False
    subprocess.run([*inside, "tc", "qdisc", "del", "dev", str(device), "root"], capture_output=True)
    return True


class Loopback:
    """Both groups on this machine's loopback, in this namespace (no veth to count)."""

    rate = None
    delay = "off"

    def __init__(self) -> None:
        host = socket.gethostname()
        self.sides = [Side(None, host, "127.0.0.1", None), Side(None, host, "127.0.0.1", None)]

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def sent_bytes(self) -> int | None:
        return None


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"{' '.join(command)}: {(done.stderr or done.stdout).strip()}")


def why_no_namespaces() -> str | None:
    """Why this machine cannot make the shaped link (not root, no ip or tc), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    return None


# ---------------------------------------------------------------- the runs
def trainer_flags(args: argparse.Namespace, corpus: Path, save_dir: Path) -> list[str]:
    return [
        "--dataset",
        "text",
        "--data-file",
        str(corpus),
        "--model",
        "gpt",
        "--n-layer",
        str(args.n_layer),
        "--n-head",
        str(args.n_head),
        "--n-embd",
        str(args.n_embd),
        "--block-size",
        str(args.block_size),
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.steps),
        "--epochs",
        "1",
        "--log-every",
        str(args.steps),
        "--no-progress",
        "--save-dir",
        str(save_dir),
    ]


def method_flags(method: str, args: argparse.Namespace, lighthouse: str) -> list[str]:
    semi = {
        "local-sgd": ["--semi-sync", "local-sgd", "--sync-every", str(args.sync_every)],
        "diloco": ["--semi-sync", "diloco", "--sync-every", str(args.sync_every)],
        "diloco, 2 fragments": [
            "--semi-sync",
            "diloco",
            "--sync-every",
            str(args.sync_every),
            "--fragments",
            "2",
        ],
    }[method]
    return [
        "--fault-tolerance",
        "--ft-replica-groups",
        "2",
        "--ft-min-replicas",
        "2",
        "--ft-lighthouse",
        lighthouse,
        *semi,
    ]


def one_run(
    method: str, link: Any, args: argparse.Namespace, corpus: Path, folder: Path, port: int
) -> dict[str, Any]:
    """Train `method` over `link` (its rendezvous or Lighthouse at `port` on the first side): the groups' (or DDP's
    ranks') processes, the first's summary, the veth's bytes."""
    run_folder = folder / method.replace(", ", "-").replace(" ", "-")
    run_folder.mkdir(parents=True)
    flags = trainer_flags(args, corpus, run_folder / "run")
    summaries = [run_folder / f"summary{index}.json" for index in range(2)]
    scripts = [
        [sys.executable, str(Path(__file__).resolve()), "run", "--summary", str(summary), "--"]
        for summary in summaries
    ]
    first = link.sides[0]
    lighthouse = None
    commands = []
    if method == "ddp":
        for rank, side in enumerate(link.sides):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
            torchrun += [f"--node_rank={rank}", f"--master_addr={first.address}", f"--master_port={port}"]
            commands.append(side.command([*torchrun, *scripts[rank][1:], *flags, "--multi-gpu", "ddp"]))
    else:
        from multigpu.launch.replica_groups import lighthouse_command

        lighthouse = subprocess.Popen(
            first.command(lighthouse_command(port, 2)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        address = f"http://{first.address}:{port}"
        for group, side in enumerate(link.sides):
            group_flags = [*flags, *method_flags(method, args, address), "--ft-replica-id", str(group)]
            commands.append(side.command([*scripts[group], *group_flags]))
    sent_before = link.sent_bytes()
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    processes = []
    for index, command in enumerate(commands):
        log = open(run_folder / f"process{index}.log", "w")
        environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
        if link.sides[index].device:
            environment["GLOO_SOCKET_IFNAME"] = str(link.sides[index].device)
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment))
    try:
        statuses = [process.wait(timeout=RUN_SECONDS) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        if lighthouse is not None:
            lighthouse.send_signal(signal.SIGTERM)
            lighthouse.wait()
    seconds = time.perf_counter() - started
    sent = link.sent_bytes()
    if any(statuses) or not summaries[0].exists():
        logs = "".join((run_folder / f"process{index}.log").read_text()[-2000:] for index in range(2))
        sys.exit(f"semi_sync.py: {method} failed (exit statuses {statuses}):\n{logs}")
    result = json.loads(summaries[0].read_text())
    result["process_seconds"] = seconds
    result["load_average"] = [load_before, os.getloadavg()[0]]
    result["wire_bytes_per_step"] = None if sent is None else (sent - sent_before) / 2 / args.steps
    return result


def free_port_on(side: Side, run_index: int) -> int:
    """A port free in `side`'s namespace: a fresh namespace has nothing bound (one port a run, none reused)."""
    if side.namespace is not None:
        return 29400 + run_index
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------- the table
def text_bytes(count: float | None) -> str:
    from multigpu.parallel.semi_sync import byte_text

    return "-" if count is None else byte_text(count)


def rows_of(results: dict[tuple[str, str], dict[str, Any]], args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for (link, method), result in results.items():
        ddp = results[(link, "ddp")]
        counted = result.get("bytes_between_groups_per_step")
        if counted is None:  # DDP counts nothing itself: it all-reduces every gradient every step
            counted = results[(link, "diloco")]["ddp_bytes_per_step"]
        rows.append(
            [
                link,
                method if method == "ddp" else f"{method}, H={args.sync_every}",
                f"{result['train_seconds']:.1f} s",
                f"{ddp['train_seconds'] / result['train_seconds']:.2f}x",
                text_bytes(counted),
                text_bytes(result["wire_bytes_per_step"]),
                f"{result['val_loss']:.4f}",
                f"{result['val_loss'] - ddp['val_loss']:+.4f}",
                "-".join(f"{load:.0f}" for load in result.get("load_average", [])),
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return run_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rate", default="100mbit", help="the shaped link's rate each way (tc tbf)")
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="a round trip's delay, where netem exists"
    )
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps of every run")
    parser.add_argument("--sync-every", type=int, default=8, help="H of local-sgd and diloco")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="windows per group (per DDP rank) per step")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--links", default="shaped,fast", help="which links: shaped, fast (unshaped)")
    parser.add_argument("--output", help="also write the table here (Markdown, and CSV beside it)")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="semi-sync-bench-") as temporary:
        folder = Path(temporary)
        corpus = folder / "guide.txt"
        guide = [*sorted(REPO.glob("*.md")), *sorted((REPO / "docs").glob("*.md"))]
        corpus.write_text("".join(path.read_text() for path in guide))
        why_not = why_no_namespaces()
        results: dict[tuple[str, str], dict[str, Any]] = {}
        load_before = os.getloadavg()[0]
        delay = "off"
        for link_name in args.links.split(","):
            if why_not is not None and link_name == "shaped":
                print(f"semi_sync.py: the shaped link skipped: {why_not}", flush=True)
                continue
            rate = args.rate if link_name == "shaped" else None
            link = Loopback() if why_not is not None else Link(rate, args.delay_ms if rate else 0)
            label = f"{args.rate} veth" if rate else ("veth, unshaped" if why_not is None else "loopback")
            with link:
                delay = link.delay if rate else delay
                for index, method in enumerate(METHODS):
                    port = free_port_on(link.sides[0], index)
                    result = one_run(method, link, args, corpus, folder / link_name, port)
                    results[(label, method)] = result
                    print(f"{label}, {method}: {json.dumps(result)}", flush=True)
        load_after = os.getloadavg()[0]
    header = [
        "link",
        "method",
        "training time",
        "vs DDP",
        "between groups per step (counted)",
        "on the wire",
        "val loss",
        "vs DDP",
        "load average",
    ]
    params = 12 * args.n_layer * args.n_embd**2
    notes = [
        machine_line(),
        f"load average {load_before:.1f} before, {load_after:.1f} after, and at each run's start and end in the "
        f"last column: the machine is shared with other jobs, whose load moves the times by tens of percent",
        f"--model gpt, {args.n_layer} layers, {args.n_head} heads, width {args.n_embd} (about {params / 1e6:.1f}M "
        f"parameters in its blocks), windows of {args.block_size} characters of this checkout's guide, "
        f"{args.batch_size} windows per group per step, {args.steps} steps; 2 replica groups of one process "
        f"(gloo), {args.threads} thread each",
        f"the shaped link: tc tbf {args.rate} each way; delay {delay}",
        "training time: from the first step's start (after the groups' first quorum) to the last step's end, its "
        "sync included (group 0's; DDP's rank 0); not the processes' start nor the final evaluation",
        "between groups per step (counted): what each rank all-reduces with the other group (the run's own count; "
        "for DDP its every gradient); on the wire: what each veth end sent per step (headers, quorums, the "
        "Lighthouse and the stores included)",
    ]
    title = "Training across a slow link: DDP against --semi-sync (python benchmarks/semi_sync.py)"
    if args.output:
        write_markdown(Path(args.output), f"## {title}", header, rows_of(results, args), notes)
    else:
        from bench_common import markdown_table

        print(markdown_table(header, rows_of(results, args)))
        print("\n".join(f"- {note}" for note in notes))
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{link}: {method}": result for (link, method), result in results.items()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
