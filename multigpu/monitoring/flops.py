"""FLOPs: counted once per run on one batch, and the peak FLOP/s of the GPUs this project knows.

MFU (model FLOPs utilisation) is the FLOP/s the training achieves over the
device's peak. The count is exact for what the model runs (torch's
FlopCounterMode over one forward and backward, the optimizer left out, as
usual for MFU); the peak comes from the table below, dense (no sparsity)
figures from NVIDIA's data sheets. A GPU that is not in the table gets no MFU:
it is never guessed (docs/speed.md, "Speed").
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from multigpu.data.batches import map_tensors
from multigpu.loop.forward import own_loss, predictions

# Dense peak TFLOP/s by precision. fp32 is the plain FP32 pipeline; tf32, bf16 and fp16 are tensor cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "T4": {"fp32": 8.1, "fp16": 65.0},  # Turing: no bf16, no tf32
    "V100 SXM2": {"fp32": 15.7, "fp16": 125.0},  # Volta: no bf16, no tf32
    "V100 PCIe": {"fp32": 14.0, "fp16": 112.0},
    "V100S PCIe": {"fp32": 16.4, "fp16": 130.0},
}

# torch.cuda.get_device_name() -> a row of the table; the first match wins, so variants come before their family.
# A name that matches none (an H100 of unknown form factor, any other GPU) has no peak.
GPU_NAMES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(pattern, re.IGNORECASE), row)
    for pattern, row in [
        (r"\bH100\b.*\bNVL\b", "H100 NVL"),
        (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
        (r"\bH100\b.*\b(SXM|HBM3)", "H100 SXM"),
        (r"\bH200\b.*\bNVL\b", "H200 NVL"),
        (r"\bH200\b", "H200 SXM"),  # the other H200 form factor
        (r"\bA100\b", "A100"),  # SXM and PCIe, 40 and 80 GB: the same peaks
        (r"\bL4\b", "L4"),  # not L40/L40S
        (r"\bT4\b", "T4"),
        (r"\bV100S\b", "V100S PCIe"),
        (r"\bV100\b.*\bPCIe\b", "V100 PCIe"),
        (r"\bV100\b.*\bSXM2\b", "V100 SXM2"),
    ]
]


def gpu_row(device_name: str) -> str | None:
    """The PEAK_TFLOPS row of a GPU, from its name as torch reports it; None for a GPU not in the table."""
    return next((row for pattern, row in GPU_NAMES if pattern.search(device_name)), None)


def precision_of(amp_dtype: torch.dtype | None) -> str:
    """Which peak a run is measured against: its autocast dtype, else tf32 where matmuls may use TF32
    (torch.set_float32_matmul_precision "high"/"medium"), else fp32."""
    if amp_dtype is not None:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one GPU at `precision`; None when the GPU or the precision is not in the table."""
    row = gpu_row(device_name)
    tflops = PEAK_TFLOPS[row].get(precision) if row else None
    return None if tflops is None else tflops * 1e12


def transformer_flops_per_token(params: int, layers: int, width: int, context: int) -> int:
    """Training FLOPs per token of a decoder-only transformer by the usual estimate (PaLM's appendix, nanoGPT's
    estimate_mfu): 6 per parameter (forward 2, backward 4; `params` without the position embedding) plus
    attention's 12 x layers x width x context. The cross-check of what FlopCounterMode counts."""
    return 6 * params + 12 * layers * width * context


def _count_cpu_attention() -> None:
    """Give the CPU's scaled_dot_product_attention kernel the FLOP formulas torch has for the GPU's kernels (the
    same two matmuls forward, five backward): without them FlopCounterMode counts no attention on the CPU, and a
    transformer's FLOPs fall short of 6N + attention."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    for op, formula in (
        (aten._scaled_dot_product_flash_attention_for_cpu, flop_counter.sdpa_flop),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, flop_counter.sdpa_backward_flop),
    ):
        if op.default not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op, get_raw=True)(formula)  # `formula` takes the shapes itself


_count_cpu_attention()


def count_flops(forward: Callable[[], Any]) -> int | None:
    """FLOPs of `forward()` and of the backward pass from its outputs; None when nothing in them has a gradient.

    The backward starts from the model's own loss where it returns one, else from
    the sum of its outputs: the model's backward FLOPs do not depend on the loss,
    and the user's loss function is not called an extra time.
    """
    with FlopCounterMode(display=False) as counter:
        outputs = forward()
        target = backward_target(outputs)
        if target is None:
            return None
        target.backward()
    return counter.get_total_flops()


def backward_target(outputs: Any) -> torch.Tensor | None:
    """A scalar whose backward runs the model's whole backward pass."""
    loss = own_loss(outputs)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    found: list[torch.Tensor] = []
    map_tensors(found.append, predictions(outputs))
    with_grad = [tensor.float().sum() for tensor in found if tensor.requires_grad]
    return torch.stack(with_grad).sum() if with_grad else None
