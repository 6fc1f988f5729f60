"""launch_multi_gpu.sh --k8s: the Kubeflow Trainer TrainJob it writes, and that TrainJob's command run as pods.

Without a cluster. The YAML is read by kubeflow-trainer-api's own model (TrainerV1alpha1TrainJob) and written back
with no key lost: a key the API does not have would be dropped there, as Kubernetes rejects it. Its container
command is then run on this machine as Kubeflow Trainer's torch plugin runs it in two pods: the command as
Kubernetes expands it (`$(NAME)` from the environment, `$$` a literal `$`), with the PET_* variables the plugin
sets, one training process each, in the repository (the image's working directory). It trains to weights
bit-identical to `torchrun --nnodes=2` run here the same way, and after a pod's process is killed the pods started
again continue from the volume's save-dir.
"""

from __future__ import annotations

import fnmatch
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_launch_multi_gpu import TINY, launch, launcher_env

from conftest import PYTHON, REPO, RUN_TIMEOUT, free_port
from multigpu.errors import UsageError
from multigpu.launch import launch_rules

yaml = pytest.importorskip("yaml", reason="PyYAML (with the [docs] or [ray] extra) is not installed")
models = pytest.importorskip(
    "kubeflow_trainer_api.models", reason="the [k8s] extra (kubeflow-trainer-api) is not installed"
)

# A save-dir a shell, YAML or Kubernetes would each misread if it were not quoted for each of them.
AWKWARD = "run 'one' \"two\" $(id) $PET_NODE_RANK"


def rule_set(*args: str) -> dict[str, str]:
    """The launcher's rule set asked for --k8s in this process (milliseconds): its records by key."""
    step, settings = launch_rules.parse(["k8s", "--python", "python", *args])
    return dict(launch_rules.STEPS[step](settings))


def kubernetes_expands(word: str, env: dict[str, str]) -> str:
    """A container command's word as Kubernetes passes it to the process (its expansion of `$(NAME)`: a defined
    variable's value, an undefined reference left as written, `$$` one `$`, any other `$` kept)."""
    out, cursor = [], 0
    while cursor < len(word):
        char = word[cursor]
        following = word[cursor + 1] if cursor + 1 < len(word) else ""
        if char == "$" and following == "$":
            out.append("$")
            cursor += 2
        elif char == "$" and following == "(" and ")" in word[cursor + 2 :]:
            end = word.index(")", cursor + 2)
            name = word[cursor + 2 : end]
            out.append(env.get(name, f"$({name})"))
            cursor = end + 1
        else:
            out.append(char)
            cursor += 1
    return "".join(out)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("gpus", [0, 8])
def test_the_trainjob_is_kubeflows_own_model_with_no_key_lost(nodes: int, gpus: int) -> None:
    args = ["--nnodes", str(nodes), "--gpus", str(gpus), "--save-dir", "/runs/exp1", "--k8s-pvc", "runs"]
    records = rule_set(*args, "--multi-gpu", "fsdp", "--image", "ghcr.io/you/multigpu-train:1.0")
    written = yaml.safe_load(records["script"])
    job = models.TrainerV1alpha1TrainJob.from_dict(written)
    assert job.to_dict() == written  # every key is the API's: none dropped on the way in
    trainer = job.spec.trainer
    procs = gpus or 2
    assert (job.api_version, job.kind, job.spec.runtime_ref.name) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
        "torch-distributed",
    )
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (nodes, procs)
    memory = 16 * gpus if gpus else 2 * procs  # GiB: per GPU, or per CPU process
    resources = {"requests": {"cpu": str(5 * gpus if gpus else procs), "memory": f"{memory}Gi"}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    assert job.to_dict()["spec"]["trainer"]["resourcesPerNode"] == resources
    assert trainer.image == "ghcr.io/you/multigpu-train:1.0"
    # No rendezvous flag: torchrun reads the plugin's PET_* variables; the hybrid mesh by node is named.
    command = trainer.command
    assert command[:2] == ["python", "multigpu/launch/torchrun.py"] and "--nnodes" not in " ".join(command)
    trainer_args = command[command.index("main_multi_gpu.py") + 1 :]
    assert trainer_args[:2] == ["--multi-gpu", "fsdp"]
    assert ("--dp-replicate" in trainer_args) == (nodes > 1)
    if nodes > 1:
        at = trainer_args.index("--dp-replicate")
        assert trainer_args[at : at + 4] == ["--dp-replicate", str(nodes), "--dp-shard", str(procs)]
    assert trainer_args[-2:] == ["--resume", "auto"]
    patch = job.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs[0]
    pod = patch.template.spec.template.spec
    # /dev/shm memory-backed (a container's default is 64 MB: DataLoader workers pass their batches through it)
    shm, claim = pod.volumes
    assert (shm.empty_dir.medium, shm.empty_dir.to_dict()["sizeLimit"]) == ("Memory", f"{memory // 4}Gi")
    assert claim.persistent_volume_claim.claim_name == "runs"
    mounts = {mount.name: mount.mount_path for mount in pod.containers[0].volume_mounts}
    assert pod.containers[0].name == "node" and mounts == {shm.name: "/dev/shm", claim.name: "/runs/exp1"}
    assert records["job-name"] == job.metadata.name == "multigpu-exp1"


def test_a_save_dir_no_shell_or_yaml_reads_right_reaches_the_trainer_exactly(tmp_path: Path) -> None:
    save_dir = f"/runs/{AWKWARD}"
    records = rule_set("--gpus", "0", "--save-dir", save_dir, "--k8s-pvc", "runs")
    job = yaml.safe_load(records["script"])
    command = [kubernetes_expands(word, {"PET_NODE_RANK": "1"}) for word in job["spec"]["trainer"]["command"]]
    assert command[command.index("--save-dir") + 1] == save_dir  # $(id) and $PET_NODE_RANK unexpanded
    assert command[command.index("--log-file") + 1] == f"{save_dir}/torchrun-node1.log"  # the one reference
    mount = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert (
        mount["template"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][-1]["mountPath"]
        == save_dir
    )
    assert job["metadata"]["name"] == "multigpu-run-one-two-id-pet-node-rank"
    assert records["script-file"] == f"{save_dir}/trainjob.yaml"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--image", "my image"], "--image 'my image': not a container image name"),
        (["--image", "img:$(id)"], "--image 'img:$(id)': not a container image name"),
        (["--nnodes", "2", "--save-dir", "/runs/x"], "--nnodes 2 needs --k8s-pvc NAME"),
        (
            ["--k8s-pvc", "runs", "--save-dir", "runs/x"],
            "give an absolute one (e.g. /runs/exp1), not 'runs/x'",
        ),
        (["--k8s-pvc", "Runs!"], "--k8s-pvc 'Runs!': not a PersistentVolumeClaim name"),
        (["--node-rank", "1"], "--node-rank is Kubernetes's to decide; leave it out with --k8s"),
        (["--slurm", "1"], "give one of --slurm and --k8s"),
        (
            ["--fault-tolerance", "1"],
            "--fault-tolerance runs its replica groups here or with --slurm, not with --k8s",
        ),
        (
            ["--", "--resume", "last.pt"],
            "--resume after -- with --k8s: every pod continues with --resume auto",
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_kubernetes_flags_are_one_line(args: list[str], message: str) -> None:
    step, settings = launch_rules.parse(["k8s", "--gpus", "0", *args])
    with pytest.raises(UsageError) as refused:
        dict(launch_rules.STEPS[step](settings))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_submit_applies_the_written_file_with_kubectl_and_without_kubectl_says_so(tmp_path: Path) -> None:
    recorder = tmp_path / "fake"
    recorder.mkdir()
    (recorder / "kubectl").write_text('#!/bin/sh\necho "$@" > "$KUBECTL_ARGS"\n')
    (recorder / "kubectl").chmod(0o755)
    env = launcher_env(
        PATH=f"{recorder}{os.pathsep}{os.environ['PATH']}", KUBECTL_ARGS=str(tmp_path / "args")
    )
    applied = launch(["--k8s", "--yes", "--gpus", "0", "--save-dir", "job", "--submit"], env, cwd=tmp_path)
    assert applied.returncode == 0, applied.stderr
    assert (tmp_path / "args").read_text() == "apply -f job/trainjob.yaml\n"
    assert (tmp_path / "job" / "trainjob.yaml").read_text() == applied.stdout

    # The same PATH less every kubectl on it.
    bare = tmp_path / "bin"
    bare.mkdir()
    for folder in dict.fromkeys(os.environ["PATH"].split(os.pathsep)):
        for tool in Path(folder).iterdir() if Path(folder).is_dir() else ():
            if tool.name != "kubectl" and not (bare / tool.name).exists():
                (bare / tool.name).symlink_to(tool)
    env = launcher_env(PATH=str(bare))
    refused = launch(["--k8s", "--yes", "--gpus", "0", "--save-dir", "job2", "--submit"], env, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        "launch_multi_gpu.sh: kubectl not found: apply job2/trainjob.yaml with kubectl where the cluster is reachable"
    )
    assert (tmp_path / "job2" / "trainjob.yaml").is_file()  # written, not applied


# --- the TrainJob's command, run as its pods --------------------------------------------------------------


def start_pods(
    command: list[str], env: dict[str, str], port: int, fault: str | None = None
) -> list[subprocess.Popen]:
    """The container command in two "pods": the PET_* variables of Kubeflow Trainer's torch plugin, each pod's
    own expansion of the command, the repository as the image's working directory."""
    pods = []
    for rank in (0, 1):
        pod_env = {
            **env,
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
        }
        if fault:
            pod_env["MULTIGPU_FAULT_INJECT"] = fault
        words = [kubernetes_expands(word, pod_env) for word in command]
        pods.append(
            subprocess.Popen(
                words, cwd=REPO, env=pod_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    return pods


def finish(processes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    try:
        outputs = [process.communicate(timeout=RUN_TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
    return [(process.returncode, output) for process, output in zip(processes, outputs)]


def final_weights(save_dir: Path) -> dict[str, Any]:
    return torch.load(save_dir / "last.pt", weights_only=True)["model"]


@pytest.mark.slow
def test_two_pods_train_as_torchrun_on_two_nodes_and_resume_from_the_volume_after_a_kill(
    tmp_path: Path,
) -> None:
    save_dir = tmp_path / AWKWARD  # the volume, mounted at --save-dir
    args = ["--k8s", "--yes", "--nnodes", "2", "--gpus", "0", "--nproc", "1", "--k8s-pvc", "runs"]
    args += ["--save-dir", str(save_dir), "--epochs", "2", "--batch-size", "32", *TINY]
    written = launch(args, launcher_env(), cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    job = yaml.safe_load((save_dir / "trainjob.yaml").read_text())
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 1)
    env = {
        **launcher_env(),
        **{item["name"]: item["value"] for item in trainer["env"]},
        "PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ['PATH']}",  # the image's python
    }

    # The reference: torchrun --nnodes=2 here, the same trainer flags, its own save-dir.
    command = trainer["command"]
    trainer_words = [
        kubernetes_expands(word, {}) for word in command[command.index("main_multi_gpu.py") + 1 :]
    ]
    reference = tmp_path / "reference"
    trainer_words[trainer_words.index("--save-dir") + 1] = str(reference)
    port = free_port()
    torchruns = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={rank}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "--nproc_per_node=1",
                "main_multi_gpu.py",
                *trainer_words,
            ],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    for status, output in finish(torchruns):
        assert status == 0, output[-3000:]

    # The pods, first with pod 1's training process SIGKILLed after step 3 (the fault injector, first start only):
    # pod 0 loses it and stops with a checkpoint of the last completed step. Both started again resume from it.
    killed = finish(start_pods(command, env, free_port(), fault="1:3"))
    assert killed[1][0] != 0 and killed[0][0] != 0, [output[-2000:] for _, output in killed]
    assert "checkpoint of the last completed step (3) written" in killed[0][1], killed[0][1][-3000:]
    again = finish(start_pods(command, env, free_port()))
    for status, output in again:
        assert status == 0, output[-3000:]
    pod0 = again[0][1]
    assert f"resumed from {save_dir}/step-000000003.pt: epoch 1, step 3" in pod0, pod0[-3000:]
    assert "done:" in pod0 and "done:" not in again[1][1]  # global rank 0 is node 0's: it alone reports
    assert (save_dir / "torchrun-node0.log").is_file() and (save_dir / "torchrun-node1.log").is_file()

    weights, expected = final_weights(save_dir), final_weights(reference)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as Docker reads them: continued lines joined, comments dropped."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
        for line in joined.splitlines()
        if line.strip()
    ]


def test_the_dockerfile_builds_the_image_the_trainjob_runs_from_this_repository() -> None:
    """No Docker daemon here: the Dockerfile read as Docker reads it. Its working directory is the repository
    (the TrainJob's command names multigpu/launch/torchrun.py and main_multi_gpu.py relative to it), its Python
    is one the project supports, it installs requirements.txt's pins, and .dockerignore leaves out environments,
    data and runs but nothing the command runs."""
    instructions = dockerfile_instructions((REPO / "Dockerfile").read_text())
    kinds = [kind for kind, _ in instructions]
    assert kinds[0] == "FROM" and kinds.count("FROM") == 1
    python = re.fullmatch(r"python:(3)\.(\d+)-slim", instructions[0][1])
    assert python and (3, int(python.group(2))) >= (3, 9)  # pyproject.toml's requires-python
    workdir = dict(instructions)["WORKDIR"]
    assert workdir.startswith("/")
    copies = [args.split() for kind, args in instructions if kind == "COPY"]
    assert all((REPO / source).exists() for sources in copies for source in sources[:-1])
    runs = [args for kind, args in instructions if kind == "RUN"]
    assert any("pip install -r requirements.txt" in run for run in runs)
    assert copies[-1] == [".", "."] and kinds.index("RUN") < kinds.index(
        "COPY", kinds.index("RUN")
    )  # deps first
    job = yaml.safe_load(rule_set("--gpus", "0", "--save-dir", "/runs/exp1")["script"])
    command = job["spec"]["trainer"]["command"]
    needed = [command[1], command[command.index("main_multi_gpu.py")]]
    assert all((REPO / path).is_file() for path in needed), needed
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert {".venv", "datasets", "checkpoints", "runs"} <= set(ignored)
    assert not any(fnmatch.fnmatch(path, pattern) for path in needed for pattern in ignored)
    docs = (REPO / "docs" / "launcher.md").read_text()
    assert "`docker build -t ghcr.io/you/multigpu-train:1.0 .`" in docs
