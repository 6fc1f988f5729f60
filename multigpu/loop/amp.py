"""Mixed precision: which autocast dtype a run uses, its context, and the fp16 GradScaler.

bf16 needs no loss scaling; fp16 does (its gradients underflow), so only fp16 gets
an enabled GradScaler. Without autocast, every step shares one no-op context
(a torch.autocast object keeps state while entered, so each use gets its own).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Callable

import torch

NAMES = {None: "off", torch.float16: "fp16", torch.bfloat16: "bf16"}


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


class Amp:
    """The precision of one run: `autocast()` for forward passes, `scaler` for fp16 backward passes.

    `sharded` (fsdp): FSDP's MixedPrecisionPolicy casts the parameters itself (multigpu/parallel/sharding.py), so
    autocast stays off (it would compute some ops in fp32 again), and fp16's scaler is the
    ShardedGradScaler, whose inf check covers every rank's shard.
    """

    def __init__(
        self, dtype: torch.dtype | None, device_type: str, init_scale: float = 2.0**16, sharded: bool = False
    ):
        self.dtype = dtype
        self.sharded = sharded
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(
                device_type, init_scale=init_scale, enabled=dtype == torch.float16
            )
        else:
            self.scaler = torch.amp.GradScaler(
                device_type, init_scale=init_scale, enabled=dtype == torch.float16
            )
        self.device_type = device_type
        self._nothing = contextlib.nullcontext()
        # A plain flag: the training step tests it rather than entering a no-op context on every step
        # (docs/measured.md, "Per-step overhead"); `scaling` likewise, kept by the scaler's setter.
        self.autocasts = dtype is not None and not sharded

    @classmethod
    def resolved(cls, flag: str, device: torch.device, sharded: bool, say: Callable[[str], None]) -> Amp:
        """--amp resolved for `device` (auto: bf16 where the GPU computes in it); `sharded` (fsdp) casts the
        parameters itself (FSDP2's MixedPrecisionPolicy) rather than autocasting."""
        return cls(resolve_dtype(flag, device, say), device.type, sharded=sharded)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """fp16's GradScaler (disabled in other precisions); `scaling` says whether it is enabled."""
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler) -> None:
        self._scaler, self.scaling = scaler, scaler.is_enabled()

    def autocast(self) -> AbstractContextManager:
        """The autocast context of this run (a no-op without --amp, and under fsdp, whose policy casts)."""
        if not self.autocasts:
            return self._nothing
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def name(self) -> str:
        return NAMES[self.dtype]
