"""FLOPs counted on one batch, and the table of peaks that MFU divides by (never guessed for an unknown GPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from multigpu.monitoring import flops


@pytest.mark.parametrize(
    "name, row",
    [
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA L4", "L4"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
        # Not guessed: other GPUs, look-alike names, an H100 whose form factor the name does not say.
        ("NVIDIA L40S", None),
        ("NVIDIA L40", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA H100", None),
        ("NVIDIA A10", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM3-32GB", None),
    ],
)
def test_gpu_names_map_to_their_row_of_peaks_or_to_none(name, row):
    assert flops.gpu_row(name) == row


def test_peaks_are_dense_and_missing_precisions_are_none():
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert flops.peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == pytest.approx(19.5e12)
    assert flops.peak_flops("Tesla T4", "bf16") is None  # Turing has no bf16 tensor cores
    assert flops.peak_flops("NVIDIA L40S", "bf16") is None
    assert all(set(row) <= {"fp32", "tf32", "bf16", "fp16"} for row in flops.PEAK_TFLOPS.values())
    assert {row for _, row in flops.GPU_NAMES} == set(flops.PEAK_TFLOPS)


def test_the_precision_follows_autocast_and_the_float32_matmul_setting():
    assert flops.precision_of(torch.bfloat16) == "bf16" and flops.precision_of(torch.float16) == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert flops.precision_of(None) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert flops.precision_of(None) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_forward_and_backward_flops_of_a_small_mlp_are_counted_exactly():
    model, inputs = tiny_model(), torch.randn(5, 16)  # 16 -> 32 -> 4
    forward = 2 * 16 * 32 + 2 * 32 * 4  # per sample
    backward = 2 * forward - 2 * 16 * 32  # weight gradients of both layers, input gradient of the second only
    assert flops.count_flops(lambda: model(inputs)) == 5 * (forward + backward)


def test_outputs_without_gradient_are_not_counted():
    model = tiny_model().requires_grad_(False)
    assert flops.count_flops(lambda: model(torch.randn(2, 16))) is None


def test_a_transformers_counted_flops_agree_with_6n_plus_attention_on_the_cpu_too():
    """The GPT's FLOPs as counted (attention included, on the CPU's kernel as on the GPU's) within 5% of the
    6N + 12 L d T estimate; without attention they would fall 25% short at this context."""
    from multigpu.models import GPT

    layers, width, context, batch = 2, 64, 128, 2
    model = GPT(65, context, layers, 4, width)
    tokens = torch.randint(0, 65, (batch, context))
    counted = flops.count_flops(lambda: model(tokens, tokens))
    params = sum(p.numel() for p in model.parameters()) - model.position_embedding.weight.numel()
    estimate = flops.transformer_flops_per_token(params, layers, width, context) * batch * context
    assert counted == pytest.approx(estimate, rel=0.05)
