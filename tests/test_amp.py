"""The precision of a run: which forward passes autocast, and whether fp16's GradScaler is on."""

from __future__ import annotations

import torch

from multigpu.amp import Amp


def test_autocast_only_with_a_dtype_and_not_under_fsdp():
    assert not Amp(None, "cpu").autocasts
    assert Amp(torch.bfloat16, "cpu").autocasts
    assert not Amp(torch.bfloat16, "cpu", sharded=True).autocasts  # FSDP's policy casts instead


def test_scaling_follows_the_scaler_even_when_it_is_replaced():
    amp = Amp(None, "cpu")
    assert not amp.scaling and not amp.scaler.is_enabled()
    amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # as a test or the GPU check's dry run does
    assert amp.scaling and amp.scaler.is_enabled()
    assert Amp(torch.float16, "cpu").scaling
