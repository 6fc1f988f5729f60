"""--float8 (multigpu/parallel/float8.py): refused in one line without a GPU of compute capability 8.9; on the CPU the
conversion, checkpoints and training are checked under torchao's emulation (float8 numbers without float8
tensor cores): which layers are converted, the checkpoint's keys (a float8 run resumes without --float8 and
the reverse), and the loss over 50 steps within LOSS_TOLERANCE of bf16's."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import TINY, config_for, read_scalars, run_cli
from multigpu.parallel import float8
from train_multi_gpu import MultiGPUTrainer

# The relative difference allowed between the float8 run's logged losses and bf16's (each a mean over 5 steps).
LOSS_TOLERANCE = 0.05


def test_float8_without_a_capable_gpu_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli([*TINY, "--float8", "tensorwise", "--save-dir", str(tmp_path / "run")])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: --float8 tensorwise needs a GPU of compute capability 8.9 or above (H100, H200, L4, RTX 4090 ...), "
        "and this run trains on the CPU; drop --float8"
    ]


def net() -> torch.nn.Sequential:
    """Layers of every kind the filter meets: one large enough to gain (1040 outputs), small ones, one whose
    size is no multiple of 16, and an output layer `lm_head` large enough but kept."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        OrderedDict(
            wide=torch.nn.Linear(16, 1040),
            relu=torch.nn.ReLU(),
            lm_head=torch.nn.Linear(1040, 1040),
            narrow=torch.nn.Linear(1040, 32),
            odd=torch.nn.Linear(32, 1100),
            relu2=torch.nn.ReLU(),
            out=torch.nn.Linear(1100, 4),
        )
    )


def emulated(recipe: str = "tensorwise") -> torch.nn.Sequential:
    pytest.importorskip("torchao", reason="the float8 tests need torchao: pip install '.[float8]'")
    model = net()
    float8.convert(model, recipe, emulate=True)
    return model


def test_only_the_linear_layers_large_enough_to_gain_are_converted() -> None:
    pytest.importorskip("torchao", reason="the float8 tests need torchao: pip install '.[float8]'")
    from torchao.float8.float8_linear import Float8Linear

    model = net()
    assert float8.convert(model, "tensorwise", emulate=True) == ["wide"]
    assert [name for name, module in model.named_children() if isinstance(module, Float8Linear)] == ["wide"]
    assert float8.convert(net(), "rowwise", emulate=True) == []  # rowwise gains only above 2048 x 1024
    big = torch.nn.Sequential(torch.nn.Linear(1040, 4112))
    assert float8.convert(big, "rowwise", emulate=True) == ["0"]


def overlapping_blobs(size: int = 800) -> TensorDataset:
    """4 classes whose blobs overlap: the loss falls and levels off well above 0, where relative differences
    mean something."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=generator)
    targets = torch.randint(4, (size,), generator=generator)
    return TensorDataset(centres[targets] * 0.5 + torch.randn(size, 16, generator=generator), targets)


def train(tmp_path: Path, model: torch.nn.Module, size: int = 800, **overrides) -> MultiGPUTrainer:
    config = config_for(
        tmp_path, 1, **{"epochs": 1, "batch_size": 16, "amp": "bf16", "log_every": 5, "lr": 1e-3, **overrides}
    )
    trainer = MultiGPUTrainer(model, overlapping_blobs(size), None, config)
    trainer.fit()
    return trainer


def test_float8_trains_within_the_tolerance_of_bf16_over_50_steps(tmp_path: Path) -> None:
    bf16 = train(tmp_path / "bf16", net())
    fp8 = train(tmp_path / "fp8", emulated())
    assert bf16.progress.global_step == fp8.progress.global_step == 50
    bf16_losses = [value for _, value in read_scalars(tmp_path / "bf16" / "ckpt" / "tb")["train/loss"]]
    fp8_losses = [value for _, value in read_scalars(tmp_path / "fp8" / "ckpt" / "tb")["train/loss"]]
    assert len(fp8_losses) == len(bf16_losses) == 10
    assert fp8_losses[-1] < 0.75 * fp8_losses[0]  # it learns
    differences = [abs(a - b) / b for a, b in zip(fp8_losses, bf16_losses)]
    assert max(differences) < LOSS_TOLERANCE, differences
    assert fp8_losses != bf16_losses  # float8 did compute something else


def test_a_float8_checkpoint_has_plain_keys_and_resumes_without_float8_and_the_reverse(
    tmp_path: Path,
) -> None:
    fp8 = train(tmp_path / "fp8", emulated(), size=160)  # 10 steps an epoch
    keys = set(fp8.model.state_dict())
    assert keys == set(net().state_dict())
    plain = train(
        tmp_path / "plain", net(), size=160, epochs=2, resume=str(tmp_path / "fp8" / "ckpt" / "last.pt")
    )
    assert plain.progress.global_step == 20 and set(plain.model.state_dict()) == keys
    back = train(
        tmp_path / "back", emulated(), size=160, epochs=3, resume=str(tmp_path / "plain" / "ckpt" / "last.pt")
    )
    assert back.progress.global_step == 30
