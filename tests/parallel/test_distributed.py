"""Mode resolution, device checks and nodes (this machine has no GPU: the CPU paths); two nodes on one machine."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, RUN_TIMEOUT, TINY, cli_env, free_port
from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.parallel.distributed import nodes_in_job, parse_gpu_ids, resolve_mode, setup, torchrun_hint

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallbacks")


def test_auto_mode_without_torchrun_or_gpus_is_one_device(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_mode(TrainConfig()) == "none"
    runtime = setup(TrainConfig())
    assert (runtime.mode, runtime.device.type, runtime.world_size) == ("none", "cpu", 1)


def test_auto_mode_under_torchrun_with_several_processes_is_ddp(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_mode(TrainConfig()) == "ddp"


@pytest.mark.parametrize("mode", ["dp", "none"])
def test_one_process_modes_under_torchrun_with_several_processes_are_refused(monkeypatch, mode):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        UsageError,
        match=f"--multi-gpu {mode} trains in one process, but torchrun started 2: "
        f"use --multi-gpu ddp under torchrun, or run without torchrun",
    ):
        setup(TrainConfig(multi_gpu=mode))
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: one process is what it asked for
    assert setup(TrainConfig(multi_gpu=mode)).mode == "none"


def test_ddp_without_torchrun_says_the_command_to_use(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UsageError, match="started by torchrun: torchrun --nproc_per_node=2 "):
        setup(TrainConfig(multi_gpu="ddp"))
    assert (
        torchrun_hint(["main_multi_gpu.py", "--lr", "0.1"])
        == "torchrun --nproc_per_node=2 main_multi_gpu.py --lr 0.1"
    )


def test_gpu_ids_are_checked_against_visible_gpus():
    assert parse_gpu_ids(None) == []
    with pytest.raises(UsageError, match="visible GPUs are none"):
        parse_gpu_ids("0")
    with pytest.raises(UsageError, match="comma-separated integers"):
        parse_gpu_ids("a,b")


def test_dp_with_fewer_than_two_gpus_falls_back_to_one_device(capsys):
    runtime = setup(TrainConfig(multi_gpu="dp"))
    assert (runtime.mode, runtime.device.type) == ("none", "cpu")
    assert capsys.readouterr().out.strip() == (
        "--multi-gpu dp needs 2 or more GPUs, found 0: training on the single device cpu"
    )


@pytest.mark.parametrize(
    "env, nodes",
    [
        ({"GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, 2),  # torchrun: 2 agents of 4 processes
        ({"GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, 1),  # nodes of unequal sizes: no layout by node
        ({"LOCAL_WORLD_SIZE": "8"}, 1),  # one node (or not torchrun)
    ],
)
def test_the_nodes_are_torchruns_agents_when_each_runs_as_many_processes(monkeypatch, env, nodes):
    for name in ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert nodes_in_job(8) == nodes


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_fsdp_sharded_within_each_and_replicated_across(tmp_path):
    """Two torchrun commands as the guide's multi-node section runs them (c10d rendezvous on 127.0.0.1, node 0
    hosting it), 2 gloo processes each: without --dp-* flags the mesh is replicate 2 (nodes) x shard 2."""
    port, save_dir = free_port(), tmp_path / "shared"
    nodes = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=two-nodes",
                f"--rdzv_conf=is_host={int(rank == 0)}",
                str(REPO / "main_multi_gpu.py"),
                "--multi-gpu",
                "fsdp",
                *TINY,
                "--epochs",
                "1",
                "--batch-size",
                "16",
                "--save-dir",
                str(save_dir),
            ],
            cwd=tmp_path,
            env=cli_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, f"{out}\n{err}"
    out = "".join(out for out, _ in outputs)
    assert (
        "mode fsdp, hybrid: 4 processes, backend gloo, mesh replicate 2 x shard 2 (dp_replicate, dp_shard); with "
        "2 nodes: shard within each node, replicate across them"
    ) in out
    assert out.count("done:") == 1  # one job, one global rank 0
    assert (save_dir / "last" / ".metadata").is_file()
