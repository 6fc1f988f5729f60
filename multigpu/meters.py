"""Per-interval training numbers, kept on the device between sync points.

Each step adds its loss to a device tensor (no host sync); at a sync point
(`--log-every` steps, save steps, epoch ends) one all-reduce carries the
interval's per-step losses, its sample count and every rank's stop vote, so
all ranks decide alike (MULTI_GPU_GUIDE.md, "When the loss becomes NaN or inf").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from multigpu.distributed import all_reduce_sum


@dataclass
class Interval:
    """One logging interval, summed over ranks."""

    step_losses: list[float]  # per optimizer step: the loss summed over its samples
    samples: float
    stop_votes: float  # ranks that got SIGTERM/SIGINT
    seconds: float

    @property
    def mean_loss(self) -> float:
        return sum(self.step_losses) / self.samples if self.samples else float("nan")


class IntervalMeter:
    """Loss, samples and skipped fp16 steps of the steps since the last sync point."""

    def __init__(self, log_every: int, device: torch.device):
        self.capacity, self.device = log_every + 1, device
        self.reset()

    def reset(self) -> None:
        self.losses = torch.zeros(self.capacity, device=self.device)
        self.steps = 0
        self.samples = 0
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """A micro-batch's mean loss over `samples` samples (stays on the device)."""
        self.losses[self.steps] += loss.detach().float() * samples

    def end_step(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples

    def reduce(self, stop_requested: bool) -> Interval:
        """Sum the interval over ranks: the one host sync of the interval."""
        flags = torch.tensor([self.samples, float(stop_requested)], device=self.device)
        values = all_reduce_sum(torch.cat([self.losses[:self.steps], flags])).tolist()
        return Interval(values[:self.steps], values[self.steps], values[self.steps + 1],
                        time.perf_counter() - self.started)
