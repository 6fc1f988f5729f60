"""One optimizer step: forward and backward of each micro-batch of a window, then the optimizer and the schedule.

Everything here runs every step, so it costs what the same lines of a hand-written
loop cost: plain attribute reads, no host sync (the loss stays on the device in the
interval meter until the next sync point), no context entered that does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
import torch.nn as nn

from multigpu.data.streaming import JoinedWindow
from multigpu.loop.amp import Amp
from multigpu.loop.forward import ForwardFn, check_first_batch, compute_loss
from multigpu.loop.join import joined_step
from multigpu.loop.tokens import LossWeighting, TokenLoss, WindowTokens
from multigpu.resilience import heartbeat
from multigpu.resilience.heartbeat import BEAT


class TrainStep:
    """The run's training step. `wrapped` is what trains (DDP, DataParallel, the sharded module or the module
    itself), `no_sync` the context of the micro-steps whose gradients are not synced yet, `move` how a batch
    reaches the device; --autotune may switch all three between steps (multigpu/engine/build.py, use_setting).
    With `token_loss`, a loss over tokens (multigpu/loop/tokens.py): `weighting` says whether this run's is one,
    or decides it at the first window (a stream under --loss-weighting auto)."""

    def __init__(
        self,
        model: nn.Module,
        wrapped: nn.Module,
        no_sync: Callable[[], AbstractContextManager],
        forward: ForwardFn,
        loss_fn: Any,
        amp: Amp,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scheduler_interval: str,
        clip_grad_norm: float,
        meter: Any,
        fetch: Callable[[Iterator, Any], Any],
        move: Callable[[Any], Any],
        weighting: LossWeighting | None = None,
        token_loss: TokenLoss | None = None,
    ):
        self.model, self.wrapped, self.no_sync, self.forward, self.loss_fn = (
            model,
            wrapped,
            no_sync,
            forward,
            loss_fn,
        )
        self.amp, self.optimizer, self.scheduler, self.scheduler_interval = (
            amp,
            optimizer,
            scheduler,
            scheduler_interval,
        )
        self.clip_grad_norm, self.meter, self.fetch, self.move = clip_grad_norm, meter, fetch, move
        self.applied_lr = optimizer.param_groups[0][
            "lr"
        ]  # the LR the last step used, as TensorBoard shows it
        self.batch_checked = False
        self.weighting = weighting
        self.token_loss = None if weighting is None or weighting.mode == "samples" else token_loss
        self.uneven_steps = 0  # steps of a stream's uneven ends, where ranks that ran out joined the others

    def __call__(self, batches: Iterator, window_samples: int, sizes: list[int]) -> None:
        """One optimizer step over the micro-batches holding this rank's next `window_samples` samples (`sizes`:
        each micro-batch's). DDP all-reduces (fsdp reduce-scatters) only in the last micro-batch's backward: the
        others run in no_sync (docs/scaling.md, "The effective-batch rule")."""
        if isinstance(batches, JoinedWindow):  # a stream's uneven end, where some ranks ran out
            joined_step(self, batches, window_samples, sizes)
            return
        if self.token_loss is not None:
            self._token_step(batches, window_samples, sizes)
            return
        BEAT.phase = heartbeat.DATA  # and again after each backward: the next fetch
        for size in sizes[:-1]:
            with self.no_sync():
                self._forward_backward(self.fetch(batches, self.move), size, window_samples)
        self._forward_backward(self.fetch(batches, self.move), sizes[-1], window_samples)
        self.meter.end_step(window_samples)
        self._optimizer_step()

    def _forward_backward(self, batch: Any, samples: int, window_samples: int) -> None:
        """Forward and backward of one micro-batch of `samples` samples. Its mean loss is weighted by its share
        of the window, so the gradient is the mean over the window whatever its size, a short last window of an
        epoch included."""
        BEAT.phase = heartbeat.FORWARD
        if self.amp.autocasts:
            with self.amp.autocast():
                loss = self._loss(batch)
        else:
            loss = self._loss(batch)
        share = loss if samples == window_samples else loss * (samples / window_samples)
        BEAT.phase = heartbeat.BACKWARD  # DDP's gradient all-reduce runs in here
        (self.amp.scaler.scale(share) if self.amp.scaling else share).backward()
        BEAT.phase = heartbeat.DATA
        self.meter.add(loss, samples)  # kept on the device: read only at the next sync point

    def _token_step(self, batches: Iterator, window_samples: int, sizes: list[int]) -> None:
        """One optimizer step whose loss is the mean over its counted tokens: the window's micro-batches are
        fetched first, so that their tokens are counted (and summed over the ranks) before the first backward."""
        BEAT.phase = heartbeat.DATA
        window = [self.fetch(batches, self.move) for _ in sizes]
        if self.weighting.mode is None and self.weighting.decide(window[0]) == "samples":  # type: ignore[union-attr]
            self.token_loss = (
                None  # a stream's first window, decided now: this and every later step by samples
            )
            self._samples_window(window, window_samples, sizes)
            return
        tokens = WindowTokens(self.weighting, window)  # type: ignore[arg-type]
        for index, batch in enumerate(window[:-1]):
            with self.no_sync():
                self._token_forward_backward(batch, tokens, index)
        self._token_forward_backward(window[-1], tokens, len(window) - 1)
        self.meter.end_token_step(window_samples, tokens.local, tokens.positions)
        self._optimizer_step()

    def _token_forward_backward(self, batch: Any, tokens: WindowTokens, index: int) -> None:
        BEAT.phase = heartbeat.FORWARD
        if self.amp.autocasts:
            with self.amp.autocast():
                share = self.token_loss(self.wrapped, batch, tokens, index)  # type: ignore[misc]
        else:
            share = self.token_loss(self.wrapped, batch, tokens, index)  # type: ignore[misc]
        BEAT.phase = heartbeat.BACKWARD
        (self.amp.scaler.scale(share) if self.amp.scaling else share).backward()
        BEAT.phase = heartbeat.DATA
        self.meter.add_sum(share.detach() * (tokens.step_total() / self.token_loss.ranks))  # type: ignore[union-attr]

    def _samples_window(self, window: list[Any], window_samples: int, sizes: list[int]) -> None:
        """A window already fetched, its loss weighted by samples."""
        for batch, size in zip(window[:-1], sizes):
            with self.no_sync():
                self._forward_backward(batch, size, window_samples)
        self._forward_backward(window[-1], sizes[-1], window_samples)
        self.meter.end_step(window_samples)
        self._optimizer_step()

    def _loss(self, batch: Any) -> torch.Tensor:
        """The micro-batch's forward and loss. The outputs are dropped on return, before the backward: the
        logits are no input of any backward (log_softmax keeps its own result), so they are freed now, not after
        the whole backward: a lower memory peak by their size, which a large vocabulary makes large."""
        outputs, targets = self.forward(self.wrapped, batch)
        if not self.batch_checked:  # once: a mismatch is one clear line, not an error deep in the loss
            check_first_batch(outputs, targets, self.loss_fn)
            self.batch_checked = True
        return compute_loss(outputs, targets, self.loss_fn)

    def _optimizer_step(self) -> None:
        """unscale -> clip -> step -> update, in the only order that is right (MULTI_GPU_GUIDE.md, "Mixed
        precision")."""
        BEAT.phase = heartbeat.OPTIMIZER  # until the step's end: the weights may be half updated
        if self.clip_grad_norm > 0:
            self.amp.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.applied_lr = self.optimizer.param_groups[0]["lr"]
        if self.amp.scaling:
            scaler = self.amp.scaler
            assert scaler._scale is not None  # set by scale() in the step's backward
            scale_before = scaler._scale.clone()  # private, but get_scale() would sync the host
            scaler.step(self.optimizer)
            scaler.update()
            self.meter.skipped_steps += (scaler._scale < scale_before).to(
                torch.int64
            )  # a lowered scale = a skip
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler_interval == "step":
            self.scheduler.step()
