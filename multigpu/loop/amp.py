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

from multigpu.precision import resolve_dtype

NAMES = {None: "off", torch.float16: "fp16", torch.bfloat16: "bf16"}


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
