"""The launcher's rule set: launch_multi_gpu.sh asks and runs, this module decides.

The launcher keeps the conversation (questions, re-asking, confirmation), finds
the GPUs and runs the command. Every check of a flag or an answer, and every
number it shows (effective batch, scaled LR, the command and its flags, the
SLURM script), comes from here, through the trainer's own parser, TrainConfig
and LR rule: the launcher cannot accept what the trainer refuses, nor show an
LR the trainer will not use. It imports no torch, so a call takes milliseconds.

    python -m multigpu.launch.launch_rules STEP [--SETTING VALUE ...] [-- TRAINER ARGS]

STEP is `check` (validate what is known so far; give the questions' defaults),
`plan` (the command, the plan lines and the rendezvous port) or `slurm` (also
the SLURM job script). SETTINGs are the launcher's flags, by their names
(`--epochs 3`), plus what the launcher found (`--found-gpus 0,1`, `--python`).
The answer is NUL-terminated KEY=VALUE records, the last `ok=1`, or
`error=ONE LINE` with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import re
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

from multigpu.checkpoints import run_folders
from multigpu.config import AUTO, DEFAULT_SAVE_ROOT, FIELDS, TrainConfig, flag, given_fields, parse_config
from multigpu.errors import HANG_EXIT_STATUS, UsageError
from multigpu.lr_scaling import effective_batch, scaled_lr

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(REPO, "main_multi_gpu.py")
TORCHRUN = os.path.join(REPO, "multigpu", "launch", "torchrun.py")
CPU_PROCESSES = 2  # ddp on a machine without GPUs: gloo processes unless told otherwise
# The trainer options the launcher sets from its own flags; a copy after -- would win in the trainer's
# parser and make the shown batch and LR a lie.
LAUNCHER_OWNED = ("multi_gpu", "gpu_ids", "epochs", "batch_size", "lr", "lr_scaling", "save_dir", "dp_replicate",
                  "dp_shard")
# The training questions, answered through TrainConfig's fields of the same names.
# The modes torchrun launches, one process per device (on every node): the trainer's ddp, and fsdp, which also
# shards the model over those processes.
PROCESS_PER_DEVICE = ("ddp", "fsdp")
TRAINING = ("epochs", "batch_size", "lr", "lr_scaling", "save_dir")
MESH = ("dp_replicate", "dp_shard")  # fsdp's device mesh, passed on as the trainer's flags of the same names
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")
SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass
class Settings:
    """What the user said (flags and answers, as text; None: not said) and what the launcher found."""

    multi_gpu: Optional[str] = None
    gpus: Optional[str] = None
    nproc: Optional[str] = None
    gpu_ids: Optional[str] = None
    gpu_choice: Optional[str] = None  # the answer to "GPUs: all, a count or ids"
    epochs: Optional[str] = None
    batch_size: Optional[str] = None
    lr: Optional[str] = None
    lr_scaling: Optional[str] = None
    save_dir: Optional[str] = None
    dp_replicate: Optional[str] = None
    dp_shard: Optional[str] = None
    nnodes: Optional[str] = None
    node_rank: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[str] = None
    max_restarts: Optional[str] = None
    slurm: Optional[str] = None
    partition: Optional[str] = None
    time: Optional[str] = None
    account: Optional[str] = None
    cpus_per_task: Optional[str] = None
    oversubscribe: Optional[str] = None  # "1": more CPU processes than cores, as the user asked
    found_gpus: str = ""  # GPU ids found on this machine, "0,1,2,3"; empty: none
    default_port: str = "29500"
    python: str = sys.executable
    trainer_args: list[str] = field(default_factory=list)

    @property
    def found(self) -> list[str]:
        return [i for i in self.found_gpus.split(",") if i]


@dataclass
class Devices:
    """How the run uses this machine (each node, for several)."""

    mode: str  # ddp, dp or none: the trainer's --multi-gpu
    count: int  # processes per node (ddp), GPUs (dp), 1 (none)
    ids: Optional[str]  # the GPU ids chosen, "1,3"; None: the first `count`
    on_gpu: bool

    @property
    def unit(self) -> str:
        return "GPU" if self.on_gpu else "process"


# --------------------------------------------------------------------------- numbers and names

def plural(n: int, word: str) -> str:
    """'1 GPU', '2 GPUs', '2 processes'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def whole(name: str, text: Optional[str], minimum: int, maximum: Optional[int] = None) -> Optional[int]:
    """A launcher flag that is a whole number, in the words TrainConfig uses for its own."""
    if text is None:
        return None
    if not re.fullmatch(r"[+-]?\d{1,9}", text.strip()):
        raise UsageError(f"--{flag(name)} must be a whole number, got {text!r}")
    value = int(text)
    if value < minimum:
        raise UsageError(f"--{flag(name)} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise UsageError(f"--{flag(name)} must be at most {maximum}, got {value}")
    return value


# --------------------------------------------------------------------------- the trainer's rules

def given_trainer_options(args: Sequence[str]) -> set[str]:
    """The TrainConfig fields that `args` set, as the trainer's parser reads them."""
    return set(given_fields(args))


def training_config(s: Settings, devices: Optional[Devices] = None) -> TrainConfig:
    """The TrainConfig the command will give the trainer, checked by the trainer's own parser and rules."""
    owned = [name for name in LAUNCHER_OWNED if name in given_trainer_options(s.trainer_args)]
    if owned:
        raise UsageError(f"--{flag(owned[0])} after -- would override the launcher's setting; give it before -- "
                         f"(see --help)")
    argv = trainer_flags(s, devices)
    return parse_config(argv + s.trainer_args)


def trainer_flags(s: Settings, devices: Optional[Devices]) -> list[str]:
    """The trainer flags the launcher sets: the mode, dp's GPUs, and the training answers given."""
    argv = []
    if devices is not None:
        argv += ["--multi-gpu", devices.mode]
        if devices.mode == "dp" and devices.ids:
            argv += ["--gpu-ids", devices.ids]
    for name in (*MESH, *TRAINING):
        if getattr(s, name) is not None:
            argv += [f"--{flag(name)}", getattr(s, name)]
    return argv


def settle_mesh(s: Settings, devices: Devices, nodes: "Nodes") -> Optional[tuple[int, int]]:
    """fsdp's device mesh (replicate, shard) by the trainer's own rule (TrainConfig.mesh_shape): --dp-replicate
    and --dp-shard, or with several nodes the hybrid layout, shard within a node and replicate across the nodes.
    A hybrid mesh is named in the command, so it runs as planned; None: not fsdp."""
    given = [name for name in MESH if getattr(s, name) is not None]
    if devices.mode != "fsdp":
        if given:
            raise UsageError(f"--{flag(given[0])} shapes the device mesh of --multi-gpu fsdp; add --multi-gpu fsdp")
        return None
    replicate, shard = training_config(s, devices).mesh_shape(devices.count * nodes.count, nodes.count)
    if given or replicate > 1:
        s.dp_replicate, s.dp_shard = str(replicate), str(shard)
    return replicate, shard


def mesh_phrase(mesh: Optional[tuple[int, int]], nodes: "Nodes", devices: Devices) -> str:
    """', hybrid: replicate 2 x shard 4 (...)' for a hybrid mesh; nothing otherwise."""
    if mesh is None or mesh[0] == 1:
        return ""
    where = (" (shard within each node, replicate across the nodes)" if mesh == (nodes.count, devices.count) else "")
    return f", hybrid: mesh replicate {mesh[0]} x shard {mesh[1]}{where}"


# --------------------------------------------------------------------------- devices

def mode_of(s: Settings) -> Optional[str]:
    """--multi-gpu (or its alias --mode), with the old name 'single' for none."""
    if s.multi_gpu is None:
        return None
    mode = "none" if s.multi_gpu == "single" else s.multi_gpu
    if mode not in (*PROCESS_PER_DEVICE, "dp", "none"):
        raise UsageError(f"--multi-gpu must be one of ddp, fsdp, dp, none; got {s.multi_gpu!r}")
    return mode  # dp without GPUs runs, as the trainer runs it: on the one device there is (devices_of)


def check_gpu_ids(text: str, found: list[str], mode: Optional[str]) -> str:
    """--gpu-ids: GPUs that exist, each once ('3,' is one id, told apart from a count)."""
    if not found:
        raise UsageError(f"--gpu-ids {text}: no GPU found, so there are no GPU ids to choose")
    if not re.fullmatch(r"\d+(,\d+)*,?", text):
        raise UsageError(f"--gpu-ids {text}: expected GPU ids separated by commas, e.g. 0,2")
    ids = text.rstrip(",").split(",")
    for position, gpu in enumerate(ids):
        if gpu not in found:
            raise UsageError(f"--gpu-ids {text}: no GPU with id {gpu} (found: {','.join(found)})")
        if gpu in ids[:position]:
            raise UsageError(f"--gpu-ids {text}: GPU {gpu} is listed twice")
    if mode == "none" and len(ids) != 1:
        raise UsageError(f"--gpu-ids {text}: --multi-gpu none uses one GPU; give one id")
    return ",".join(ids)


def check_gpu_count(text: str, found: list[str], mode: Optional[str]) -> int:
    count = whole("gpus", text, 1)
    assert count is not None
    if found and count > len(found):
        raise UsageError(f"--gpus {count}: only {plural(len(found), 'GPU')} found (ids {','.join(found)})")
    if mode == "none" and count != 1:
        raise UsageError(f"--gpus {count}: --multi-gpu none uses one device")
    return count


def apply_gpu_choice(s: Settings) -> None:
    """The GPU question's answer: 'all', a count (the first N) or ids ('0,2'; one id as '3,')."""
    choice, s.gpu_choice = s.gpu_choice, None
    if choice is None or choice == "all":
        return
    if "," in choice:
        s.gpu_ids = choice
    else:
        s.gpus = choice


def devices_of(s: Settings, mode: Optional[str]) -> Devices:
    """The devices per node from --gpus/--nproc/--gpu-ids and what was found; `mode` None: ddp."""
    found = s.found
    if s.nproc is not None and s.gpus is not None and s.nproc != s.gpus:
        raise UsageError("give --gpus or --nproc, not both")
    count_text = s.gpus if s.gpus is not None else s.nproc
    if count_text is not None and s.gpu_ids is not None:
        raise UsageError("give --gpus or --gpu-ids, not both")
    mode = mode or "ddp"
    ids = check_gpu_ids(s.gpu_ids, found, mode) if s.gpu_ids is not None else None
    if ids is not None:
        count = len(ids.split(","))
    elif count_text is not None:
        count = check_gpu_count(count_text, found, mode)
    elif mode == "none" or (mode == "dp" and not found):  # the trainer's rule: dp with no GPU trains on the CPU
        count = 1
        ids = found[0] if len(found) > 1 else None  # several GPUs: say which one, the first
    else:
        count = len(found) or default_cpu_processes()
    if not found and count > cores_here() and not s.oversubscribe:
        raise UsageError(f"--gpus {count}: more processes than this machine's {plural(cores_here(), 'CPU core')}, "
                         f"which they would only share; give at most {cores_here()}, or add --oversubscribe")
    if mode == "dp" and ids is None and count < len(found):
        ids = ",".join(found[:count])  # DataParallel is told its GPUs: the first `count`
    return Devices(mode, count, ids, bool(found))


# --------------------------------------------------------------------------- nodes and ports

@dataclass
class Nodes:
    """Several machines: torchrun's c10d rendezvous, hosted by node 0 (or SLURM's first node)."""

    count: int = 1
    rank: int = 0
    master_addr: Optional[str] = None
    port: Optional[int] = None  # --master-port; None: choose
    max_restarts: Optional[int] = None


def nodes_of(s: Settings, mode: Optional[str]) -> Nodes:
    nodes = Nodes(count=whole("nnodes", s.nnodes, 1) or 1, max_restarts=whole("max_restarts", s.max_restarts, 0),
                  port=whole("master_port", s.master_port, 1, 65535), master_addr=s.master_addr)
    rank = whole("node_rank", s.node_rank, 0)
    if s.slurm:
        for name in ("node_rank", "master_addr"):
            if getattr(s, name) is not None:
                raise UsageError(f"--{flag(name)} is SLURM's to decide; leave it out with --slurm")
        return nodes
    if nodes.count > 1:
        if mode not in (None, *PROCESS_PER_DEVICE):
            raise UsageError(f"--nnodes {nodes.count} needs --multi-gpu ddp or fsdp")
        if rank is None:
            raise UsageError(f"--nnodes {nodes.count} needs --node-rank: 0 on the master node, 1 to "
                             f"{nodes.count - 1} on the others")
        if rank >= nodes.count:
            raise UsageError(f"--node-rank {rank}: must be below --nnodes {nodes.count}")
        if not s.master_addr:
            raise UsageError(f"--nnodes {nodes.count} needs --master-addr (the address of node 0)")
        nodes.rank = rank
    elif rank:
        raise UsageError(f"--node-rank {rank} needs --nnodes above 1")
    return nodes


def port_is_free(port: int) -> bool:
    """Bindable on all IPv4 and IPv6 addresses, as torchrun's TCP store will bind it."""
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
        except OSError as error:
            if family == socket.AF_INET or error.errno == errno.EADDRINUSE:
                return False
        finally:
            sock.close()
    return True


def rendezvous_port(s: Settings, nodes: Nodes) -> tuple[int, str]:
    """(port, note): the port the command names; busy ones are refused or stepped over, said in `note`."""
    default = whole("default_port", s.default_port, 1, 65535)
    assert default is not None
    if nodes.count > 1:
        # Every node must name the same port, so it cannot be picked; node 0 hosts it and can check it.
        port = nodes.port or default
        if nodes.rank == 0 and not port_is_free(port):
            raise UsageError(f"port {port} is busy on this machine (node 0); choose a free one with --master-port, "
                             f"the same on every node")
        return port, ""
    if nodes.port is not None:
        if not port_is_free(nodes.port):
            raise UsageError(f"--master-port {nodes.port}: the port is busy; choose another or leave it out to pick "
                             f"a free one")
        return nodes.port, ""
    for port in range(default, min(default + 100, 65536)):
        if port_is_free(port):
            break
    else:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
    return port, "" if port == default else f"Port {default} is busy: using port {port} for the rendezvous."


# --------------------------------------------------------------------------- the command

def shown(path: str) -> str:
    """A path as printed: relative when under the current directory (commands run from there)."""
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def quoted(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(word) for word in words)


def omp_threads(cores: int, processes: int) -> int:
    """Threads per worker: the cores shared by the processes on one machine, at least 1."""
    return max(1, cores // max(1, processes))


def cores_here() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_cpu_processes() -> int:
    """ddp on a machine without GPUs: CPU_PROCESSES, or fewer where there are fewer cores."""
    return min(CPU_PROCESSES, cores_here())


def torchrun_log(save_dir: str, nodes: Nodes) -> str:
    name = "torchrun.log" if nodes.count == 1 else f"torchrun-node{nodes.rank}.log"
    return os.path.join(save_dir, name)


def command(s: Settings, devices: Devices, nodes: Nodes, port: int, config: TrainConfig) -> list[str]:
    """The command line, environment assignments first: exactly what runs, and what launch_command.sh repeats."""
    env = []
    if devices.ids and devices.mode != "dp":
        env.append(f"CUDA_VISIBLE_DEVICES={devices.ids}")
    trainer = shown(TRAINER)
    if devices.mode in PROCESS_PER_DEVICE:
        env.append(f"OMP_NUM_THREADS={omp_threads(cores_here(), devices.count)}")
        words = [shown(s.python), shown(TORCHRUN), "--log-file", torchrun_log(config.save_dir, nodes),
                 f"--nproc_per_node={devices.count}"]
        if nodes.count > 1:
            # c10d: node 0 hosts the store at --master-addr:port (said, not guessed from the address);
            # the id only has to be the same on every node, as the port is.
            host = f"[{nodes.master_addr}]" if ":" in str(nodes.master_addr) else nodes.master_addr
            words += [f"--nnodes={nodes.count}", "--rdzv_backend=c10d", f"--rdzv_endpoint={host}:{port}",
                      f"--rdzv_id=multigpu-{port}", f"--rdzv_conf=is_host={int(nodes.rank == 0)}"]
        else:
            if nodes.master_addr:
                words.append(f"--master_addr={nodes.master_addr}")
            words.append(f"--master_port={port}")
        if nodes.max_restarts is not None:
            words.append(f"--max_restarts={nodes.max_restarts}")
        words.append(trainer)
    else:
        words = [shown(s.python), trainer]
    words += trainer_flags(s, devices) + s.trainer_args
    return env + words


# --------------------------------------------------------------------------- what is shown

def devices_per_step(devices: Devices, nodes: Nodes) -> int:
    """The devices whose batches make one step: every process on every node under DDP, dp's GPUs, or one."""
    return devices.count * nodes.count if devices.mode in PROCESS_PER_DEVICE else devices.count


def per_device_batch(config: TrainConfig, devices: Devices) -> Optional[int]:
    """--batch-size as the run will use it: None where --batch-size auto will find it on the GPUs at start, the
    trainer's default where auto has no CUDA to measure (the trainer says so too)."""
    if config.batch_size != AUTO:
        return config.batch_size
    return None if devices.on_gpu else FIELDS["batch_size"].default


def effective_batch_text(config: TrainConfig, devices: Devices, nodes: Nodes) -> str:
    total, batch = devices_per_step(devices, nodes), per_device_batch(config, devices)
    tail = f" x {plural(total, devices.unit)} x {plural(config.grad_accum_steps, 'accumulation step')}"
    if batch is None:
        return f"the largest batch that fits per GPU, found at start (--batch-size auto){tail}"
    auto = " (--batch-size auto needs CUDA)" if config.batch_size == AUTO else ""
    return f"{effective_batch(replace(config, batch_size=batch), total)} = {batch} per {devices.unit}{auto}{tail}"


def lr_text(s: Settings, config: TrainConfig, devices: Devices, nodes: Nodes) -> str:
    batch = per_device_batch(config, devices)
    if config.lr_scaling == "none":
        return f"lr {config.lr!r} (not scaled)"
    if batch is None:
        return f"lr {s.lr} x {config.lr_scaling}(effective batch/{config.lr_base_batch}), once the batch is found"
    total = effective_batch(replace(config, batch_size=batch), devices_per_step(devices, nodes))
    lr = scaled_lr(config.lr, config.lr_scaling, total, config.lr_base_batch)
    return f"lr {lr!r} = {s.lr} x {config.lr_scaling}({total}/{config.lr_base_batch})"


def device_phrase(devices: Devices, nodes: Nodes) -> str:
    """'DDP with 4 GPUs', 'DataParallel over GPUs 0,2', 'one CPU process', ..."""
    if devices.ids:
        what = f"GPU{'s' if ',' in devices.ids else ''} {devices.ids}"
    elif devices.on_gpu:
        what = plural(devices.count, "GPU")
    else:
        what = f"{plural(devices.count, 'CPU process')} (gloo)"
    phrase = {"ddp": f"DDP with {what}", "fsdp": f"FSDP (the model sharded) over {what}",
              "dp": f"DataParallel over {what}"}.get(devices.mode)
    if devices.mode == "dp" and not devices.on_gpu:
        phrase = "one CPU process (--multi-gpu dp needs 2 or more GPUs and none were found: the trainer falls back)"
    if phrase is None:
        phrase = f"one GPU{f' (id {devices.ids})' if devices.ids else ''}" if devices.on_gpu else "one CPU process"
    if nodes.count > 1:
        phrase += f" per node x {nodes.count} nodes (this is node {nodes.rank})"
    return phrase


# --------------------------------------------------------------------------- steps

def check(s: Settings) -> Iterator[tuple[str, str]]:
    """Validate what is known so far; give the normalised settings ("set:" records) and the questions' defaults."""
    mode = mode_of(s)
    apply_gpu_choice(s)
    nodes = nodes_of(s, mode)
    devices = slurm_devices(s) if s.slurm else devices_of(s, mode)
    config = training_config(s)
    if not (s.slurm and nodes.count > 1):  # several nodes need a --save-dir they all share: said below
        yield from settle_save_dir(s, config)
        config = training_config(s)
    if s.slurm:
        check_slurm_job(s, nodes, config)
    check_save_dir(config.save_dir)
    settle_mesh(s, devices, nodes)
    if not s.slurm and devices.mode in PROCESS_PER_DEVICE and (nodes.port is not None or nodes.count > 1):
        rendezvous_port(s, nodes)  # a port the user named must be free before anything is asked
    # The settings as the launcher should keep them: the mode by its name, the GPU answer as a count or ids.
    if mode is not None:
        yield "set:multi-gpu", mode
    if s.gpu_ids is not None and not s.slurm:
        yield "set:gpu-ids", devices.ids or ""
    for name in ("gpus", *TRAINING):
        if getattr(s, name) is not None:
            yield f"set:{flag(name)}", getattr(s, name)
    defaults = parse_config([])
    for name in TRAINING:
        yield f"default-{flag(name)}", str(getattr(defaults, name))
    yield "default-processes", str(default_cpu_processes())
    yield "lr-base-batch", str(config.lr_base_batch)
    yield "effective-batch", effective_batch_text(config, devices, nodes)


def settle_training(s: Settings, config: TrainConfig) -> None:
    """Name every training value in the command, defaults too: it then reads, and repeats, the same anywhere."""
    for name in TRAINING:
        if getattr(s, name) is None:
            value = getattr(config, name)
            setattr(s, name, repr(value) if isinstance(value, float) else str(value))


def settle_save_dir(s: Settings, config: TrainConfig) -> Iterator[tuple[str, str]]:
    """The save-dir the command names (launch_command.sh goes there too).

    Without --save-dir: a new run folder under checkpoints/ (with --resume auto,
    the newest with the same settings), as the trainer would choose. A --save-dir holding another run's
    checkpoints, with neither --resume nor --overwrite, is reported
    ("save-dir-holds") with a fresh folder beside it, for the launcher to ask.
    """
    if s.save_dir is None:
        continued = run_folders.run_to_continue(DEFAULT_SAVE_ROOT, config) if config.resume == "auto" else None
        s.save_dir = continued[0] if continued else run_folders.next_run_dir(DEFAULT_SAVE_ROOT)
        yield "set:save-dir", s.save_dir
    elif config.resume is None and not config.overwrite and os.path.isdir(s.save_dir):
        held = run_folders.checkpoint_files(s.save_dir)
        if held:
            yield "save-dir-holds", ", ".join(os.path.basename(path) for path in held)
            yield "new-save-dir", run_folders.sibling_dir(s.save_dir)


def check_save_dir(save_dir: str) -> None:
    """The launcher writes launch_command.sh (or the SLURM script) there: a folder, or nothing yet."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise UsageError(f"--save-dir {save_dir} is a file, not a folder; choose another path")


def plan(s: Settings) -> Iterator[tuple[str, str]]:
    """The command and what it will do, for a run on this machine."""
    mode = mode_of(s)
    apply_gpu_choice(s)
    devices = devices_of(s, mode)
    nodes = nodes_of(s, mode)
    mesh = settle_mesh(s, devices, nodes)
    yield from settle_save_dir(s, training_config(s, devices))
    config = training_config(s, devices)
    check_save_dir(config.save_dir)
    settle_training(s, config)
    port, note = rendezvous_port(s, nodes) if devices.mode in PROCESS_PER_DEVICE else (0, "")
    yield "plan", f"Plan: {device_phrase(devices, nodes)}{mesh_phrase(mesh, nodes, devices)}"
    if not devices.on_gpu and devices.count > cores_here():
        yield "plan", f"  --oversubscribe: {plural(devices.count, 'process')} share {plural(cores_here(), 'CPU core')}"
    yield "plan", f"  epochs {config.epochs}; effective batch {effective_batch_text(config, devices, nodes)}"
    yield "plan", f"  {lr_text(s, config, devices, nodes)}"
    yield "plan", f"  checkpoints and launch_command.sh in {config.save_dir}/"
    if devices.mode in PROCESS_PER_DEVICE:
        yield "plan", f"  torchrun's own messages go to {torchrun_log(config.save_dir, nodes)}"
    if nodes.count > 1:
        yield "plan", ("  checkpoints come from global rank 0, which c10d may place on any node: use a --save-dir "
                       "all nodes share")
    if note:
        yield "plan", f"  {note}"
    yield "save-dir", config.save_dir
    yield "command", quoted(command(s, devices, nodes, port, config))


# --------------------------------------------------------------------------- SLURM

def slurm_devices(s: Settings) -> Devices:
    """Per node for --slurm: --gpus asks SLURM for that many GPUs; 0 (or none here, by default) runs
    --nproc CPU processes (gloo)."""
    gpus = whole("gpus", s.gpus, 0)
    if gpus is None:
        gpus = len(s.found)
    nproc = whole("nproc", s.nproc, 1)
    if gpus and nproc is not None and nproc != gpus:
        raise UsageError(f"--nproc {nproc} with --gpus {gpus}: on GPU nodes there is one process per GPU")
    if s.gpu_ids is not None:
        raise UsageError("--gpu-ids is SLURM's to decide; give --gpus (per node) with --slurm")
    if s.multi_gpu not in (None, *PROCESS_PER_DEVICE):
        raise UsageError("--slurm runs --multi-gpu ddp or fsdp (one process per GPU on every node)")
    for name, pattern in (("partition", SLURM_NAME), ("account", SLURM_NAME), ("time", SLURM_TIME)):
        value = getattr(s, name)
        if value is not None and not pattern.fullmatch(value):
            example = "04:00:00 or 1-12:00:00" if name == "time" else "gpu"
            raise UsageError(f"--{name} {value!r}: not a SLURM {name} (e.g. {example})")
    return Devices(mode_of(s) or "ddp", gpus or nproc or CPU_PROCESSES, None, gpus > 0)


def check_slurm_job(s: Settings, nodes: Nodes, config: TrainConfig) -> None:
    """What a SLURM job needs beyond a run here: its own resuming, and a --save-dir every node sees."""
    given = given_trainer_options(s.trainer_args)
    if "resume" in given:
        raise UsageError("--resume after -- with --slurm: the job script continues with --resume auto by itself")
    if "overwrite" in given:
        raise UsageError("--overwrite after -- with --slurm: the job continues its --save-dir with --resume auto "
                         "(a requeue must not start over); give a new --save-dir instead")
    if nodes.count > 1 and s.save_dir is None:
        raise UsageError(f"--nnodes {nodes.count} needs --save-dir on storage every node shares (e.g. /shared/run1): "
                         f"global rank 0, which writes the checkpoints, may be on any node")
    if re.search(r"\s", config.save_dir):
        raise UsageError(f"--save-dir {config.save_dir!r}: SLURM's output path cannot hold spaces; choose another")
    check_save_dir(config.save_dir)


def slurm(s: Settings) -> Iterator[tuple[str, str]]:
    """The plan and the job script for --slurm."""
    s.slurm = "1"
    devices = slurm_devices(s)
    gpus, procs = (devices.count if devices.on_gpu else 0), devices.count
    nodes = nodes_of(s, "ddp")
    mesh = settle_mesh(s, devices, nodes)
    config = training_config(s, devices)
    check_slurm_job(s, nodes, config)
    cpus = whole("cpus_per_task", s.cpus_per_task, 1) or procs * (5 if gpus else 1)
    settle_training(s, config)
    what = plural(gpus, "GPU") if gpus else f"{plural(procs, 'CPU process')} (gloo)"
    yield "plan", (f"Plan: SLURM job, {plural(nodes.count, 'node')} x {what}, {devices.mode.upper()}"
                   f"{mesh_phrase(mesh, nodes, devices)} with c10d rendezvous on the first node")
    yield "plan", f"  epochs {config.epochs}; effective batch {effective_batch_text(config, devices, nodes)}"
    yield "plan", f"  {lr_text(s, config, devices, nodes)}"
    script = os.path.join(config.save_dir, "launch_slurm.sbatch")
    yield "plan", f"  job script {script}; its output in {config.save_dir}/slurm-<job id>.out"
    yield "save-dir", config.save_dir
    yield "script-file", script
    yield "script", slurm_script(s, nodes, gpus, procs, cpus, config)


def slurm_script(s: Settings, nodes: Nodes, gpus: int, procs: int, cpus: int, config: TrainConfig) -> str:
    """The sbatch script: one task per node, each a torchrun of `procs` processes, joined by c10d.

    Every $SLURM_* variable stays literal, read when the job runs; those that differ
    between nodes ($SLURM_NODEID) are read inside run_node, on each node.
    """
    directives = ["--job-name=multigpu", f"--nodes={nodes.count}", "--ntasks-per-node=1"]
    if gpus:
        directives.append(f"--gpus-per-node={gpus}")
    directives.append(f"--cpus-per-task={cpus}")
    directives += [f"--{name}={getattr(s, name)}" for name in ("partition", "time", "account") if getattr(s, name)]
    directives += [f"--chdir={os.getcwd()}", f"--output={config.save_dir}/slurm-%j.out", "--open-mode=append",
                   "--requeue", "--signal=B:USR1@120"]
    trainer = [TRAINER, *trainer_flags(s, Devices(mode_of(s) or "ddp", procs, None, gpus > 0)), "--resume", "auto",
               *s.trainer_args]
    restarts = f" --max_restarts={nodes.max_restarts}" if nodes.max_restarts is not None else ""
    port = str(nodes.port) if nodes.port else "$((20000 + SLURM_JOB_ID % 20000))"
    gpu_check = "" if not gpus else """
[[ ${SLURM_GPUS_ON_NODE:-0} == "$GPUS_PER_NODE" ]] ||
    fail "written for $GPUS_PER_NODE GPUs per node, SLURM gave ${SLURM_GPUS_ON_NODE:-0} on $(hostname);" \\
        "check the partition's GPUs (sinfo -o '%P %G')"
"""
    shared_check = "" if nodes.count == 1 else """
# Rank 0 (on any node) writes the checkpoints that every node resumes from: all must see one --save-dir.
marker=$SAVE_DIR/.shared-check-$SLURM_JOB_ID
touch "$marker" || fail "cannot write to --save-dir $SAVE_DIR"
srun --nodes="$NODES" --ntasks-per-node=1 test -e "$marker" ||
    fail "--save-dir $SAVE_DIR is not shared: some node does not see it; use storage all nodes mount"
rm -f "$marker"
"""
    restart_env = " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" if nodes.count > 1 and nodes.max_restarts else ""
    return f"""#!/bin/bash
# SLURM job written by launch_multi_gpu.sh on {time.strftime('%Y-%m-%d %H:%M:%S')}:
# {plural(nodes.count, 'node')} x {plural(gpus, 'GPU') if gpus else plural(procs, 'CPU process')}, {(mode_of(s) or 'ddp').upper()} under torchrun, c10d rendezvous on the allocation's first node.
# Submit: sbatch {shlex.quote(os.path.join(config.save_dir, 'launch_slurm.sbatch'))}
# Submitting it again, or a requeue, continues from the newest checkpoint (--resume auto).
{chr(10).join('#SBATCH ' + d for d in directives)}

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
        --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="$SLURM_JOB_ID" --rdzv_conf=is_host=$((SLURM_NODEID == 0)){restarts} \\
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


# --------------------------------------------------------------------------- the command line of this module

STEPS = {"check": check, "plan": plan, "slurm": slurm}


def parse(argv: Sequence[str]) -> tuple[str, Settings]:
    if "--" in argv:
        cut = list(argv).index("--")
        argv, trainer_args = list(argv[:cut]), list(argv[cut + 1:])
    else:
        argv, trainer_args = list(argv), []
    parser = argparse.ArgumentParser(prog="launch_rules", add_help=False, allow_abbrev=False)
    parser.add_argument("step", choices=sorted(STEPS))
    for f in dataclasses.fields(Settings):
        if f.name != "trainer_args":
            parser.add_argument(f"--{flag(f.name)}", dest=f.name)
    namespace = vars(parser.parse_args(argv))
    step = namespace.pop("step")
    values = {name: value for name, value in namespace.items() if value is not None}
    return step, Settings(**values, trainer_args=trainer_args)


def records(step: str, s: Settings) -> Iterator[str]:
    for key, value in STEPS[step](s):
        yield f"{key}={value}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    step, s = parse(sys.argv[1:] if argv is None else argv)
    out = sys.stdout
    try:
        answer = list(records(step, s))
    except UsageError as error:
        out.write(f"error={error}\0")
        return error.exit_code
    out.write("".join(record + "\0" for record in answer) + "ok=1\0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
