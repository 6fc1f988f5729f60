"""The launcher's Kubernetes job (`--k8s`): a Kubeflow Trainer `TrainJob` (trainer.kubeflow.org/v1alpha1) on the
runtime `torch-distributed`, written as YAML without any Kubernetes library (torch-free).

Kubeflow Trainer's torch plugin gives every pod PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR
and PET_MASTER_PORT, which torchrun reads as its own --nnodes, --nproc_per_node, --node_rank, --master_addr and
--master_port (torch/distributed/run.py: every option's default is the variable PET_<OPTION>). So the container's
command is the launcher's torchrun (multigpu/launch/torchrun.py) with no rendezvous flag at all: node 0's pod
hosts it, and global rank 0 runs there. The training flags are the launcher's, with --resume auto: a pod started
again continues from the newest checkpoint in --save-dir, which `--k8s-pvc NAME` puts on a volume every pod
mounts at that path. The node count reaches the node-aware defaults as under SLURM: fsdp's hybrid mesh is named
in the command, and torchrun tells the trainer its nodes (GROUP_WORLD_SIZE) from PET_NNODES.

Kubernetes expands `$(NAME)` in a container's command from its environment, and `$$` is a literal `$`: every `$`
of the user's words is written doubled, so a save-dir holding `$(...)` reaches the trainer as written (the log
file's `$(PET_NODE_RANK)` is the one reference meant to expand).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Iterator
from typing import Any

from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.launch.answers import (
    KUBERNETES,
    Devices,
    Nodes,
    Settings,
    plural,
    trainer_flags,
)
from multigpu.launch.cluster_jobs import Job, check_job, job_devices, settle_job
from multigpu.launch.command import training_plan

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for torchrun jobs
# The image that holds this repository as its working directory (docs/launcher.md, "Kubernetes", builds it).
DEFAULT_IMAGE = "multigpu-train:latest"
NODE = "node"  # the torch-distributed runtime's replicated job and its container
MANAGER = "launch_multi_gpu.sh"  # who owns the runtime patch (the volumes), in Kubeflow Trainer's terms
VOLUME = "save-dir"
SHM_VOLUME = (
    "dshm"  # /dev/shm: a container's default is 64 MB, and DataLoader workers pass batches through it
)
# Memory a pod asks for: per GPU its process, its 4 loader workers and the pinned batches and CPU copies of the
# weights a save makes; per CPU process (gloo) the process alone. /dev/shm, memory-backed, counts within it.
MEMORY_GIB_PER_GPU = 16
MEMORY_GIB_PER_CPU_PROCESS = 2
FILE_NAME = "trainjob.yaml"
# A container image reference: registry/name:tag or @digest; no spaces, quotes or shell characters.
IMAGE = re.compile(r"^[a-z0-9][A-Za-z0-9._/:@-]*$")
PVC = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a claim's name: a DNS subdomain
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
NAME_LENGTH = 40  # the TrainJob's name; its pods are named <name>-node-0-<n>-<suffix>


def k8s_devices(s: Settings) -> Devices:
    """Per pod (node): --gpus GPUs, or with --gpus 0 (or none here) --nproc CPU processes (gloo)."""
    devices = job_devices(s, KUBERNETES)
    if s.image is not None and not IMAGE.fullmatch(s.image):
        raise UsageError(
            f"--image {s.image!r}: not a container image name (e.g. ghcr.io/you/multigpu-train:1.0); "
            f"lowercase, no spaces or quotes"
        )
    if s.k8s_pvc is not None and not PVC.fullmatch(s.k8s_pvc):
        raise UsageError(
            f"--k8s-pvc {s.k8s_pvc!r}: not a PersistentVolumeClaim name (lowercase letters, digits, - and .)"
        )
    return devices


def check_k8s_job(s: Settings, nodes: Nodes, config: TrainConfig) -> None:
    """What a TrainJob needs beyond a run here: its own resuming, and with several pods a volume they share."""
    check_job(s, nodes, config, KUBERNETES)
    assert config.save_dir is not None  # settled by launch_rules.check before (its set:save-dir)
    if nodes.count > 1 and s.k8s_pvc is None:
        raise UsageError(
            f"--nnodes {nodes.count} needs --k8s-pvc NAME: a volume every pod mounts at --save-dir (ReadWriteMany), "
            f"where rank 0 writes the checkpoints every pod resumes from"
        )
    if s.k8s_pvc is not None and not os.path.isabs(config.save_dir):
        raise UsageError(
            f"--k8s-pvc mounts the volume at --save-dir, a path in the pod: give an absolute one (e.g. /runs/exp1), "
            f"not {config.save_dir!r}"
        )


def kubernetes(s: Settings) -> Iterator[tuple[str, str]]:
    """The plan and the TrainJob for --k8s."""
    s.k8s = "1"
    job = settle_job(s, k8s_devices(s), check_k8s_job)
    config = job.config
    yield (
        "plan",
        f"Plan: Kubernetes TrainJob (Kubeflow Trainer, runtime {RUNTIME}), {plural(job.nodes.count, 'pod')} x "
        f"{job.what}, {job.layout}; torchrun's rendezvous from the pods' PET_* variables",
    )
    yield from training_plan(s, config, job.devices, job.nodes)
    file = os.path.join(job.save_dir, FILE_NAME)
    yield "plan", f"  image {s.image or DEFAULT_IMAGE}; TrainJob {job_name(job.save_dir)} in {file}"
    if s.k8s_pvc:
        yield (
            "plan",
            f"  checkpoints in {job.save_dir} on the volume {s.k8s_pvc}; a restarted pod resumes there",
        )
    else:
        yield (
            "plan",
            "  no --k8s-pvc: the checkpoints stay in the pod and go with it; a restarted pod starts over",
        )
    yield "save-dir", job.save_dir
    yield "script-file", file
    yield "job-name", job_name(job.save_dir)
    yield "script", trainjob_yaml(s, job)


def job_name(save_dir: str) -> str:
    """The TrainJob's name, from the save-dir's own name in Kubernetes' alphabet (lowercase, digits, -)."""
    words = re.sub(r"[^a-z0-9]+", "-", os.path.basename(os.path.normpath(save_dir)).lower()).strip("-")
    return f"multigpu-{words}"[:NAME_LENGTH].rstrip("-") if words else "multigpu"


def literal(word: str) -> str:
    """A word of the container's command as Kubernetes passes it on unexpanded: every `$` doubled."""
    return word.replace("$", "$$")


def container_command(s: Settings, job: Job) -> list[str]:
    """torchrun (multigpu/launch/torchrun.py) with the trainer and its flags, in the image's working directory:
    nodes, processes, node rank and rendezvous come from the PET_* variables."""
    log = literal(os.path.join(job.save_dir, "torchrun-node")) + "$(PET_NODE_RANK).log"
    restarts = [f"--max_restarts={job.nodes.max_restarts}"] if job.nodes.max_restarts is not None else []
    trainer = trainer_flags(s, job.devices)
    words = [*trainer, "--resume", "auto", *s.trainer_args]
    return ["python", "multigpu/launch/torchrun.py", "--log-file", log, *restarts, "main_multi_gpu.py"] + [
        literal(word) for word in words
    ]


def trainjob(s: Settings, job: Job) -> dict[str, Any]:
    """The TrainJob as a dict, in the API's field names (kubeflow-trainer-api's TrainerV1alpha1TrainJob)."""
    resources: dict[str, Any] = {"requests": {"cpu": str(job.cpus), "memory": f"{memory_gib(job)}Gi"}}
    if job.gpus:
        resources["limits"] = {"nvidia.com/gpu": str(job.gpus)}
    trainer = {
        "image": s.image or DEFAULT_IMAGE,
        "numNodes": job.nodes.count,
        "numProcPerNode": job.procs,
        "resourcesPerNode": resources,
        "env": [{"name": "OMP_NUM_THREADS", "value": str(max(1, job.cpus // job.procs))}],
        "command": container_command(s, job),
    }
    spec: dict[str, Any] = {
        "runtimeRef": {"name": RUNTIME},
        "trainer": trainer,
        "runtimePatches": [pod_volumes(s.k8s_pvc, job)],
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": job_name(job.save_dir)},
        "spec": spec,
    }


def memory_gib(job: Job) -> int:
    """The memory a pod requests, in GiB (MEMORY_GIB_PER_GPU, MEMORY_GIB_PER_CPU_PROCESS)."""
    return job.gpus * MEMORY_GIB_PER_GPU if job.gpus else job.procs * MEMORY_GIB_PER_CPU_PROCESS


def pod_volumes(claim: str | None, job: Job) -> dict[str, Any]:
    """The runtime patch of every pod's training container: a memory-backed /dev/shm of a quarter of the pod's
    memory, and with --k8s-pvc the claim mounted at --save-dir."""
    volumes: list[dict[str, Any]] = [
        {
            "name": SHM_VOLUME,
            "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(1, memory_gib(job) // 4)}Gi"},
        }
    ]
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if claim:
        volumes.append({"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": VOLUME, "mountPath": job.save_dir})
    pod = {"volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounts}]}
    replicated = {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
    return {
        "manager": MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated]}}},
    }


def trainjob_yaml(s: Settings, job: Job) -> str:
    """The TrainJob's YAML, after comment lines that say what it runs and how to submit it."""
    file = shlex.quote(os.path.join(job.save_dir, FILE_NAME))
    head = [
        f"# Kubeflow Trainer TrainJob written by launch_multi_gpu.sh on {time.strftime('%Y-%m-%d %H:%M:%S')}:",
        f"# {plural(job.nodes.count, 'pod')} x {job.what}, {job.devices.mode.upper()} under torchrun.",
        f"# Submit: kubectl apply -f {re.sub(CONTROL, '?', file)}",  # a comment ends at a line break
        "# A pod started again continues from the newest checkpoint in --save-dir (--resume auto).",
    ]
    return "\n".join(head) + "\n" + to_yaml(trainjob(s, job))


# --------------------------------------------------------------------------- YAML, without a YAML library

PLAIN = re.compile(r"^(--?)?[A-Za-z/][A-Za-z0-9_./=-]*$")
# Words a YAML 1.1 reader (PyYAML, older kubectl) takes for something other than a string.
NOT_STRINGS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}


def scalar(value: Any) -> str:
    """A string plain where no YAML reader can misread it, else double-quoted with JSON's escapes (a subset of
    YAML's); numbers as numbers."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"not a TrainJob value: {value!r}")
    if isinstance(value, int):
        return str(value)
    if PLAIN.fullmatch(value) and value.lower() not in NOT_STRINGS:
        return value
    return json.dumps(value, ensure_ascii=False)


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists, strings and whole numbers."""
    return "".join(line + "\n" for line in _lines(value, indent))


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{scalar(key)}:")
                lines += _lines(item, indent + 2)
            else:
                lines.append(f"{pad}{scalar(key)}: {scalar(item)}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            inner = _lines(item, indent + 2)
            lines.append(f"{pad}- {inner[0].lstrip()}")
            lines += inner[1:]
        return lines
    return [f"{pad}{scalar(value)}"]
