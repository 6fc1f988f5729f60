"""What the launcher knows: the user's flags and answers, the devices, nodes and mesh they name, the
rendezvous port and the CPU threads, each checked through the trainer's own TrainConfig (torch-free).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from multigpu.config import TrainConfig, flag, given_fields, parse_config
from multigpu.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


TRAINER = os.path.join(REPO, "main_multi_gpu.py")


TORCHRUN = os.path.join(REPO, "multigpu", "launch", "torchrun.py")


CPU_PROCESSES = 2  # ddp on a machine without GPUs: gloo processes unless told otherwise


# The trainer options the launcher sets from its own flags; a copy after -- would win in the trainer's
# parser and make the shown batch and LR a lie.
LAUNCHER_OWNED = (
    "multi_gpu",
    "gpu_ids",
    "epochs",
    "batch_size",
    "lr",
    "lr_scaling",
    "save_dir",
    "dp_replicate",
    "dp_shard",
)


# The training questions, answered through TrainConfig's fields of the same names.
# The modes torchrun launches, one process per device (on every node): the trainer's ddp, and fsdp, which also
# shards the model over those processes.
PROCESS_PER_DEVICE = ("ddp", "fsdp")


TRAINING = ("epochs", "batch_size", "lr", "lr_scaling", "save_dir")


ADAPTERS = ("lora_r", "qlora")  # a language model folder's LoRA question, and 4-bit's (adapter_flags)


MESH = ("dp_replicate", "dp_shard")  # fsdp's device mesh, passed on as the trainer's flags of the same names


@dataclass
class Settings:
    """What the user said (flags and answers, as text; None: not said) and what the launcher found."""

    multi_gpu: str | None = None
    gpus: str | None = None
    nproc: str | None = None
    gpu_ids: str | None = None
    gpu_choice: str | None = None  # the answer to "GPUs: all, a count or ids"
    epochs: str | None = None
    batch_size: str | None = None
    lr: str | None = None
    lr_scaling: str | None = None
    save_dir: str | None = None
    dp_replicate: str | None = None
    dp_shard: str | None = None
    nnodes: str | None = None
    node_rank: str | None = None
    master_addr: str | None = None
    master_port: str | None = None
    max_restarts: str | None = None
    slurm: str | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: str | None = None
    k8s: str | None = None  # "1": write a Kubernetes TrainJob (multigpu/launch/kubernetes.py)
    image: str | None = None
    k8s_pvc: str | None = None
    ray: str | None = None  # "1": the command runs the training on Ray (multigpu/launch/ray_train.py)
    ray_address: str | None = None
    ray_max_failures: str | None = None
    oversubscribe: str | None = None  # "1": more CPU processes than cores, as the user asked
    fault_tolerance: str | None = (
        None  # "1": replica groups under torchft (multigpu/launch/replica_groups.py)
    )
    replica_groups: str | None = None
    lighthouse_port: str | None = None
    lora_r: str | None = None  # LoRA adapters' rank (asked when the model is a language model folder)
    qlora: str | None = None  # "1" or yes: the base in 4-bit; no: not
    sync_every: str | None = None  # --fault-tolerance: above 1, the trainer's --semi-sync diloco --sync-every
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
    ids: str | None  # the GPU ids chosen, "1,3"; None: the first `count`
    on_gpu: bool

    @property
    def unit(self) -> str:
        return "GPU" if self.on_gpu else "process"


def plural(n: int, word: str) -> str:
    """'1 GPU', '2 GPUs', '2 processes'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def whole(name: str, text: str | None, minimum: int, maximum: int | None = None) -> int | None:
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


def given_trainer_options(args: Sequence[str]) -> set[str]:
    """The TrainConfig fields that `args` set, as the trainer's parser reads them."""
    return set(given_fields(args))


def training_config(s: Settings, devices: Devices | None = None) -> TrainConfig:
    """The TrainConfig the command will give the trainer, checked by the trainer's own parser and rules."""
    refuse_launcher_owned(s)
    argv = trainer_flags(s, devices)
    return parse_config(argv + s.trainer_args)


def refuse_launcher_owned(s: Settings) -> None:
    """UsageError for a trainer flag after -- that the launcher sets from its own flag (every way of launching)."""
    owned = [name for name in LAUNCHER_OWNED if name in given_trainer_options(s.trainer_args)]
    if owned:
        raise UsageError(
            f"--{flag(owned[0])} after -- would override the launcher's setting; give it before -- "
            f"(see --help)"
        )


def trainer_flags(s: Settings, devices: Devices | None) -> list[str]:
    """The trainer flags the launcher sets: the mode, dp's GPUs, and the training answers given."""
    argv = []
    if devices is not None:
        argv += ["--multi-gpu", devices.mode]
        if devices.mode == "dp" and devices.ids:
            argv += ["--gpu-ids", devices.ids]
    for name in (*MESH, *TRAINING):
        if getattr(s, name) is not None:
            argv += [f"--{flag(name)}", getattr(s, name)]
    return argv + adapter_flags(s)


YES = ("1", "y", "yes", "true")


def adapter_flags(s: Settings) -> list[str]:
    """--lora-r and --qlora as the launcher's flags or answers gave them (--lora-r 0, every weight, says nothing)."""
    if s.qlora is not None and s.qlora.lower() not in (*YES, "n", "no", "false", "0"):
        raise UsageError(f"--qlora: answer yes or no, got {s.qlora!r}")
    argv = ["--lora-r", s.lora_r] if s.lora_r not in (None, "0") else []
    return argv + (["--qlora"] if s.qlora is not None and s.qlora.lower() in YES else [])


def asks_about_adapters(s: Settings, config: TrainConfig) -> bool:
    """Whether the launcher asks about LoRA: a language model folder fine-tunes (--model hf --model-path, not a
    classifier), and no --lora-r was given, to the launcher or after --."""
    language_model = (
        config.model_name == "hf" and config.model_path is not None and not config.text_classification
    )
    return language_model and s.lora_r is None and "lora_r" not in given_trainer_options(s.trainer_args)


def settle_mesh(s: Settings, devices: Devices, nodes: Nodes) -> tuple[int, int] | None:
    """fsdp's device mesh (replicate, shard) by the trainer's own rule (TrainConfig.mesh_shape): --dp-replicate
    and --dp-shard, or with several nodes the hybrid layout, shard within a node and replicate across the nodes.
    A hybrid mesh is named in the command, so it runs as planned; None: not fsdp."""
    given = [name for name in MESH if getattr(s, name) is not None]
    if devices.mode != "fsdp":
        if given:
            raise UsageError(
                f"--{flag(given[0])} shapes the device mesh of --multi-gpu fsdp; add --multi-gpu fsdp"
            )
        return None
    replicate, shard = training_config(s, devices).mesh_shape(devices.count * nodes.count, nodes.count)
    if given or replicate > 1:
        s.dp_replicate, s.dp_shard = str(replicate), str(shard)
    return replicate, shard


def mesh_phrase(mesh: tuple[int, int] | None, nodes: Nodes, devices: Devices) -> str:
    """', hybrid: replicate 2 x shard 4 (...)' for a hybrid mesh; nothing otherwise."""
    if mesh is None or mesh[0] == 1:
        return ""
    where = (
        " (shard within each node, replicate across the nodes)"
        if mesh == (nodes.count, devices.count)
        else ""
    )
    return f", hybrid: mesh replicate {mesh[0]} x shard {mesh[1]}{where}"


def mode_of(s: Settings) -> str | None:
    """--multi-gpu (or its alias --mode), with the old name 'single' for none."""
    if s.multi_gpu is None:
        return None
    mode = "none" if s.multi_gpu == "single" else s.multi_gpu
    if mode not in (*PROCESS_PER_DEVICE, "dp", "none"):
        raise UsageError(f"--multi-gpu must be one of ddp, fsdp, dp, none; got {s.multi_gpu!r}")
    return mode  # dp without GPUs runs, as the trainer runs it: on the one device there is (devices_of)


def check_gpu_ids(text: str, found: list[str], mode: str | None) -> str:
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


def check_gpu_count(text: str, found: list[str], mode: str | None) -> int:
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


def devices_of(s: Settings, mode: str | None) -> Devices:
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
    elif mode == "none" or (
        mode == "dp" and not found
    ):  # the trainer's rule: dp with no GPU trains on the CPU
        count = 1
        ids = found[0] if len(found) > 1 else None  # several GPUs: say which one, the first
    else:
        count = len(found) or default_cpu_processes()
    if not found and count > cores_here() and not s.oversubscribe:
        raise UsageError(
            f"--gpus {count}: more processes than this machine's {plural(cores_here(), 'CPU core')}, "
            f"which they would only share; give at most {cores_here()}, or add --oversubscribe"
        )
    if mode == "dp" and ids is None and count < len(found):
        ids = ",".join(found[:count])  # DataParallel is told its GPUs: the first `count`
    return Devices(mode, count, ids, bool(found))


@dataclass(frozen=True)
class Engine:
    """A cluster engine that starts the processes on nodes it chooses: what the launcher writes or runs for it."""

    flag: str  # the launcher's flag: --slurm, --k8s, --ray
    name: str  # in the user's words: SLURM, Kubernetes, Ray
    # What goes on with --resume auto by itself after a restart ("the job script continues"), and the restart
    # ("a requeue"); None: the user's own flags (Ray: multigpu/launch/ray_train.py).
    resumes: str | None
    restart: str | None


SLURM = Engine("--slurm", "SLURM", "the job script continues", "a requeue")
KUBERNETES = Engine("--k8s", "Kubernetes", "every pod continues", "a restarted pod")
RAY = Engine("--ray", "Ray", None, None)


def engine_of(s: Settings) -> Engine | None:
    """The cluster engine the flags name (one at most), or None for a run on this machine."""
    named = [engine for engine, on in ((SLURM, s.slurm), (KUBERNETES, s.k8s), (RAY, s.ray)) if on]
    if len(named) > 1:
        raise UsageError(
            f"give one of {named[0].flag} and {named[1].flag}: each starts the run on its own cluster"
        )
    if named and named[0] is not SLURM and s.fault_tolerance:
        raise UsageError(
            f"--fault-tolerance runs its replica groups here or with --slurm, not with {named[0].flag}"
        )
    return named[0] if named else None


@dataclass
class Nodes:
    """Several machines: torchrun's c10d rendezvous, hosted by node 0 (or SLURM's first node)."""

    count: int = 1
    rank: int = 0
    master_addr: str | None = None
    port: int | None = None  # --master-port; None: choose
    max_restarts: int | None = None


def nodes_of(s: Settings, mode: str | None) -> Nodes:
    nodes = Nodes(
        count=whole("nnodes", s.nnodes, 1) or 1,
        max_restarts=whole("max_restarts", s.max_restarts, 0),
        port=whole("master_port", s.master_port, 1, 65535),
        master_addr=s.master_addr,
    )
    rank = whole("node_rank", s.node_rank, 0)
    engine = engine_of(s)
    if engine is RAY:
        for name in ("nnodes", "node_rank", "master_addr", "master_port", "max_restarts"):
            if getattr(s, name) is not None:
                raise UsageError(
                    f"--{flag(name)}: Ray places the workers on its nodes and restarts them itself; leave it out "
                    f"with --ray (the workers: --gpus, or --nproc; restarts: --ray-max-failures)"
                )
        return nodes
    if engine is not None:
        for name in ("node_rank", "master_addr"):
            if getattr(s, name) is not None:
                raise UsageError(
                    f"--{flag(name)} is {engine.name}'s to decide; leave it out with {engine.flag}"
                )
        return nodes
    if nodes.count > 1:
        if mode not in (None, *PROCESS_PER_DEVICE):
            raise UsageError(f"--nnodes {nodes.count} needs --multi-gpu ddp or fsdp")
        if rank is None:
            raise UsageError(
                f"--nnodes {nodes.count} needs --node-rank: 0 on the master node, 1 to "
                f"{nodes.count - 1} on the others"
            )
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
            raise UsageError(
                f"port {port} is busy on this machine (node 0); choose a free one with --master-port, "
                f"the same on every node"
            )
        return port, ""
    if nodes.port is not None:
        if not port_is_free(nodes.port):
            raise UsageError(
                f"--master-port {nodes.port}: the port is busy; choose another or leave it out to pick "
                f"a free one"
            )
        return nodes.port, ""
    for port in range(default, min(default + 100, 65536)):
        if port_is_free(port):
            break
    else:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
    return port, "" if port == default else f"Port {default} is busy: using port {port} for the rendezvous."


def omp_threads(cores: int, processes: int) -> int:
    """Threads per worker: the cores shared by the processes on one machine, at least 1."""
    return max(1, cores // max(1, processes))


def cores_here() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_cpu_processes() -> int:
    """ddp on a machine without GPUs: CPU_PROCESSES, or fewer where there are fewer cores."""
    return min(CPU_PROCESSES, cores_here())


def settle_training(s: Settings, config: TrainConfig) -> None:
    """Name every training value in the command, defaults too: it then reads, and repeats, the same anywhere."""
    for name in TRAINING:
        if getattr(s, name) is None:
            value = getattr(config, name)
            setattr(s, name, repr(value) if isinstance(value, float) else str(value))


def check_save_dir(save_dir: str) -> None:
    """The launcher writes launch_command.sh (or the SLURM script) there: a folder, or nothing yet."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise UsageError(f"--save-dir {save_dir} is a file, not a folder; choose another path")
