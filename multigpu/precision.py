"""Which dtype --amp means on a device: the rule the training step's autocast (multigpu/loop/amp.py) and a 4-bit
base's compute dtype (--qlora, models/hf.py) share."""

from __future__ import annotations

from typing import Callable

import torch


def resolve_dtype(amp: str, device: torch.device, say: Callable[[str], None]) -> torch.dtype | None:
    """--amp as a dtype for `device`, with a one-line note where the device cannot do what was asked.

    auto: bf16 on a GPU that has it, else fp16 (with its GradScaler) on a GPU; fp32 on the CPU, where
    autocast is faster only on processors with bf16 units, and the user says so with --amp bf16 (a note where
    the processor has none: bf16 is emulated there, slower than fp32)."""
    if amp == "auto":
        if device.type != "cuda":
            say("--amp auto: fp32 on the CPU (--amp bf16 autocasts there)")
            return None
        return torch.bfloat16 if native_bf16(device) else torch.float16
    if amp == "fp16" and device.type != "cuda":
        say("--amp fp16 needs a CUDA device; using bf16 autocast on the CPU instead")
        amp = "bf16"
    if amp == "bf16" and device.type == "cuda" and not native_bf16(device):
        say("--amp bf16 is not supported by this GPU; using fp16 with a GradScaler instead")
        return torch.float16
    if amp == "bf16" and device.type == "cpu" and cpu_bf16_units() is False:
        say(
            "--amp bf16: this CPU has no bf16 units (AVX512-BF16, AMX or Arm's BF16), so bf16 is emulated here, "
            "often several times slower than fp32; --amp auto (fp32 on the CPU) or off runs at fp32 speed"
        )
    return {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp]


BF16_UNITS = ("avx512_bf16", "amx_bf16", "bf16")  # x86's flags, and Arm's Features word


def cpu_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes in bf16 itself (BF16_UNITS among its flags), which makes CPU autocast pay;
    None where its flags cannot be read (no /proc/cpuinfo)."""
    try:
        with open(cpuinfo) as file:
            lines = [line for line in file if line.startswith(("flags", "Features"))]
    except OSError:
        return None
    flags = {flag for line in lines for flag in line.split(":", 1)[-1].split()}
    return any(unit in flags for unit in BF16_UNITS)


def native_bf16(device: torch.device) -> bool:
    """Whether the GPU `device` computes in bf16 itself: Ampere (compute capability 8) and later, or ROCm.
    torch.cuda.is_bf16_supported() also says yes where bf16 is only emulated, slowly (V100, T4)."""
    return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)
