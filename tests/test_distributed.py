"""Mode resolution and device checks (this machine has no GPU: the CPU paths)."""

from __future__ import annotations

import pytest
import torch

from multigpu.config import TrainConfig
from multigpu.distributed import parse_gpu_ids, resolve_mode, setup, torchrun_hint
from multigpu.errors import UsageError

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
    with pytest.raises(UsageError, match=f"--multi-gpu {mode} trains in one process, but torchrun started 2: "
                                         f"use --multi-gpu ddp under torchrun, or run without torchrun"):
        setup(TrainConfig(multi_gpu=mode))
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: one process is what it asked for
    assert setup(TrainConfig(multi_gpu=mode)).mode == "none"


def test_ddp_without_torchrun_says_the_command_to_use(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UsageError, match="started by torchrun: torchrun --nproc_per_node=2 "):
        setup(TrainConfig(multi_gpu="ddp"))
    assert torchrun_hint(["main_multi_gpu.py", "--lr", "0.1"]) == "torchrun --nproc_per_node=2 main_multi_gpu.py --lr 0.1"


def test_gpu_ids_are_checked_against_visible_gpus():
    assert parse_gpu_ids(None) == []
    with pytest.raises(UsageError, match="visible GPUs are none"):
        parse_gpu_ids("0")
    with pytest.raises(UsageError, match="comma-separated integers"):
        parse_gpu_ids("a,b")


def test_dp_with_fewer_than_two_gpus_falls_back_to_one_device(capsys):
    runtime = setup(TrainConfig(multi_gpu="dp"))
    assert (runtime.mode, runtime.device.type) == ("none", "cpu")
    assert capsys.readouterr().out.strip() == ("--multi-gpu dp needs 2 or more GPUs, found 0: "
                                               "training on the single device cpu")
