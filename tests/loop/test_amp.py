"""The precision of a run: which forward passes autocast, and whether fp16's GradScaler is on."""

from __future__ import annotations

import pytest
import torch

from multigpu.loop.amp import Amp


def test_autocast_only_with_a_dtype_and_not_under_fsdp():
    assert not Amp(None, "cpu").autocasts
    assert Amp(torch.bfloat16, "cpu").autocasts
    assert not Amp(torch.bfloat16, "cpu", sharded=True).autocasts  # FSDP's policy casts instead


def test_scaling_follows_the_scaler_even_when_it_is_replaced():
    amp = Amp(None, "cpu")
    assert not amp.scaling and not amp.scaler.is_enabled()
    amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # as a test or the GPU check's dry run does
    assert amp.scaling and amp.scaler.is_enabled()
    assert Amp(torch.float16, "cpu").scaling


@pytest.mark.skipif(torch.cuda.is_available(), reason="--multi-gpu none trains on the GPU where there is one")
def test_auto_is_a_choice_of_the_command_line_and_trains_in_fp32_on_the_cpu(tmp_path, capsys):
    from main_multi_gpu import main

    summaries: list[dict] = []
    status = main(
        [
            "--amp",
            "auto",
            "--train-size",
            "64",
            "--val-size",
            "16",
            "--batch-size",
            "16",
            "--epochs",
            "1",
            "--no-progress",
            "--multi-gpu",
            "none",
            "--save-dir",
            str(tmp_path / "run"),
        ],
        summaries.append,
    )
    out = capsys.readouterr().out
    assert status == 0 and summaries
    assert "--amp auto: fp32 on the CPU" in out and "amp off" in out  # the plan line names the precision used
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert checkpoint["config"]["amp"] == "auto"  # resolved at each start, for the device of that start
