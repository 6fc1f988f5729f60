"""Per-interval training numbers, kept on the device between sync points.

Each step adds its loss to a device tensor (no host sync); at a sync point
(`--log-every` steps, save steps, epoch ends) one all-reduce carries the
interval's per-step losses, its sample count and every rank's stop vote, so
all ranks decide alike (docs/scaling.md, "When the loss becomes NaN or inf").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from multigpu.parallel.distributed import all_reduce_sum, gather_objects


@dataclass
class Interval:
    """One logging interval, summed over ranks."""

    step_losses: list[float]  # per optimizer step: the loss summed over its samples (its tokens, by_tokens)
    samples: float
    stop_votes: float  # ranks that got SIGTERM/SIGINT
    seconds: float
    log_votes: float = 0.0  # ranks with scalars from trainer.log waiting
    by_tokens: bool = False  # the losses are over tokens (--loss-weighting): the mean divides by `tokens`
    tokens: float = 0.0  # counted target tokens (-100 left out)
    positions: float = 0.0  # target positions, padding included: what the model computed on
    first_count: float = 0.0  # the interval's first step's samples (its tokens, by_tokens)

    @property
    def mean_loss(self) -> float:
        count = self.tokens if self.by_tokens else self.samples
        return sum(self.step_losses) / count if count else float("nan")

    @property
    def first_step_loss(self) -> float:
        """The mean loss of the interval's first step alone (of a run's first interval: where the run started)."""
        return (
            self.step_losses[0] / self.first_count if self.step_losses and self.first_count else float("nan")
        )


class IntervalMeter:
    """Loss, samples and skipped fp16 steps of the steps since the last sync point.

    A step only appends its loss tensor (detached, still on the device) to a
    Python list: no host sync, and no kernel unless it has several micro-batches
    or a short one. Weighting by samples and summing happen once, at the sync point.
    """

    def __init__(self, device: torch.device, full_batch: int):
        self.device, self.full_batch = device, full_batch  # the samples of a full micro-batch
        self.reset()

    def reset(self) -> None:
        self.step_losses: list[torch.Tensor] = []  # per step: the loss summed over its samples / full_batch
        self.micro: list[torch.Tensor] = []  # the current step's micro-batches so far
        self.samples = 0
        self.first_samples = 0  # the first step's, this rank's
        self.skipped_steps: Any = 0  # fp16 steps the scaler skipped: becomes a device tensor at the first add
        self.tokens: list[torch.Tensor] = []  # per step of a loss over tokens: this rank's counted tokens
        self.positions = 0  # and their positions, padding included
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """A micro-batch's mean loss over `samples` samples (stays on the device)."""
        self.micro.append(
            loss.detach() if samples == self.full_batch else loss.detach() * (samples / self.full_batch)
        )

    def add_sum(self, loss_sum: torch.Tensor) -> None:
        """A micro-batch's loss summed over its counted tokens (stays on the device)."""
        self.micro.append(loss_sum.detach())

    def end_step(self, samples: int) -> None:
        """The end of a step of `samples` samples on this rank (none: a rank that joined the others' step at a
        stream's uneven end adds a loss of 0, so that every rank reduces as many steps)."""
        micro, self.micro = self.micro, []
        if not micro:
            self.step_losses.append(torch.zeros((), device=self.device))
        else:
            self.step_losses.append(micro[0] if len(micro) == 1 else torch.stack(micro).float().sum())
        self.samples += samples
        self.first_samples = self.first_samples or samples

    def end_token_step(self, samples: int, tokens: torch.Tensor, positions: int) -> None:
        """The end of a step whose losses were added as sums over `tokens` counted tokens (a device tensor)."""
        self.end_step(samples)
        self.tokens.append(tokens)
        self.positions += positions

    def reduce(self, stop_requested: bool, logged: bool = False) -> Interval:
        """Sum the interval over ranks: the one host sync of the interval (`logged`: this rank has scalars of
        trainer.log waiting, so every rank learns whether to reduce them)."""
        steps, by_tokens = len(self.step_losses), bool(self.tokens)
        scale = 1.0 if by_tokens else float(self.full_batch)  # token steps added sums, not means / full batch
        per_step = (
            torch.stack(self.step_losses).float() * scale
            if steps  # stack promotes dtypes
            else torch.zeros(0, device=self.device)
        )
        flags = torch.tensor(
            [self.samples, float(stop_requested), float(logged), self.positions, self.first_samples],
            device=self.device,
        )
        tokens = (
            torch.stack([torch.stack(self.tokens).sum(), self.tokens[0]]).float()
            if by_tokens
            else torch.zeros(2, device=self.device)
        )  # all, and the first step's
        values = all_reduce_sum(torch.cat([per_step, flags, tokens.to(self.device)])).tolist()
        return Interval(
            values[:steps],
            values[steps],
            values[steps + 1],
            time.perf_counter() - self.started,
            values[steps + 2],
            by_tokens,
            values[steps + 5],
            values[steps + 3],
            values[steps + 6] if by_tokens else values[steps + 4],
        )


class LoggedScalars:
    """The scalars user code hands to `trainer.log({name: value})` between two sync points.

    A call only appends the value (a device tensor stays on the device): no host
    sync, no collective. At the next sync point every value of a name, on every
    rank, is averaged by one all-reduce of sums and counts: the rank-mean when each
    rank logs a name once per step. A name some ranks did not log is averaged over
    the values that were logged.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.values: dict[str, list[torch.Tensor | float]] = {}

    def add(self, values: Mapping[str, torch.Tensor | float]) -> None:
        for name, value in values.items():
            self.values.setdefault(name, []).append(
                value.detach() if isinstance(value, torch.Tensor) else value
            )

    def reduce(self) -> dict[str, float]:
        """{name: mean over every rank's values} since the last reduce; every rank must call it."""
        names = sorted({name for names in gather_objects(sorted(self.values)) for name in names})
        if not names:
            return {}
        sums_and_counts = torch.stack(
            [
                torch.stack(
                    [torch.as_tensor(value, device=self.device).float().mean() for value in self.values[name]]
                ).sum()
                if name in self.values
                else torch.zeros((), device=self.device)
                for name in names
            ]
            + [torch.tensor(float(len(self.values.get(name, ()))), device=self.device) for name in names]
        )
        self.values = {}
        totals = all_reduce_sum(sums_and_counts).tolist()
        return {name: totals[i] / totals[len(names) + i] for i, name in enumerate(names)}
