"""A step at a stream's uneven end under DDP: the ranks that ran out join the others' steps, so the others train
every sample they still hold (docs/data.md, "Uneven ends").

The stream (data/streaming.py) hands every rank the same steps; in a step of the uneven end some ranks hold
fewer micro-batches than a window, or none. DDP's gradient all-reduce runs in the backward of a window's last
micro-batch, which a rank without one never reaches, so each rank here runs its micro-batches under no_sync and
then sums the gradients over all ranks itself, those that ran out adding zeros, as DDP's join hook does
(`torch.distributed.algorithms.Join`, `DistributedDataParallel.join_hook`). Unlike torch's Join context, where
the ranks that ran out wait out the others' loop and are sent the last rank's model at its end, every rank takes
the step here: the same averaged gradients, optimizer step, schedule step, step count and sync points on every
rank. The ranks' optimizer states (Adam's moments), GradScaler, EMA and step counts never drift apart, and the
trainer's own collectives of a step (the token count of a loss over tokens, the loss at log steps, checkpoints)
are reached by every rank as usual.

The gradient is the mean over the ranks that trained the step of each one's window mean, as in an even step
(DDP's divide_by_initial_world_size=False); a loss over tokens is already scaled to the step's tokens over every
rank, so its sum is divided by the world size, as DDP divides it.
"""

from __future__ import annotations

from typing import Any

import torch

from multigpu.data.streaming import JoinedWindow
from multigpu.loop.tokens import WindowTokens
from multigpu.parallel.distributed import all_reduce_sum, gather_objects, start_all_reduce_sum
from multigpu.resilience import heartbeat
from multigpu.resilience.heartbeat import BEAT


def joined_step(step: Any, batches: JoinedWindow, window_samples: int, sizes: list[int]) -> None:
    """One optimizer step of the uneven end (`step`: the run's TrainStep): this rank's micro-batches (maybe
    none) forward and backward without DDP's all-reduce, the gradients summed over every rank, then the
    optimizer step every rank takes alike."""
    BEAT.phase = heartbeat.DATA
    window = [step.fetch(batches, step.move) for _ in sizes]
    by_tokens = _by_tokens(step, window)
    tokens = WindowTokens(step.weighting, window) if by_tokens and window else None
    if by_tokens and tokens is None:
        _add_no_tokens(step.meter.device)  # the others' token count is an all-reduce: this rank adds 0
    if not window:
        shadow_forward(step.wrapped)
    with step.no_sync():  # every micro-batch: the ranks that ran out reach no DDP all-reduce
        for index, (batch, size) in enumerate(zip(window, sizes)):
            if tokens is not None:
                step._token_forward_backward(batch, tokens, index)
            else:
                step._forward_backward(batch, size, window_samples)
    if tokens is not None:
        step.meter.end_token_step(window_samples, tokens.local, tokens.positions)
    elif by_tokens:
        step.meter.end_token_step(0, torch.zeros((), dtype=torch.int64, device=step.meter.device), 0)
    else:
        step.meter.end_step(window_samples)
    BEAT.phase = heartbeat.BACKWARD
    sum_gradients(step.model, batches.world_size if by_tokens else batches.training)
    step.uneven_steps += 1
    step._optimizer_step()


def _by_tokens(step: Any, window: list[Any]) -> bool:
    """Whether this step's loss is over tokens. Under --loss-weighting auto a stream's weighting is decided at
    its first batch: a rank that never had one adopts the others' at the first uneven step (one gather)."""
    if step.token_loss is None:
        decided = step.weighting.mode if step.weighting is not None else "samples"
    else:
        if step.weighting.mode is None and window:
            step.weighting.decide(window[0])
        decided = step.weighting.mode
    if not step.uneven_steps:  # the first uneven step, on every rank at once
        modes = [mode for mode in gather_objects(decided) if mode is not None]
        decided = decided or (modes[0] if modes else "samples")
        if step.weighting is not None and step.weighting.mode is None:
            step.weighting.mode = decided
    if decided != "tokens":
        step.token_loss = None  # as TrainStep's own first window decides: this and every later step
    return decided == "tokens"


def shadow_forward(wrapped: torch.nn.Module) -> None:
    """What DDP's forward under no_sync does across ranks, on a rank that has no micro-batch, as DDP's join hook
    does it (torch/nn/parallel/distributed.py, _DDPJoinHook.main_hook): the buckets' one rebuild (a broadcast,
    at the first forward after the first synced backward) and the buffers' broadcast from rank 0 (at the first
    forward after a synced one). The others' later micro-batches of the step, under no_sync, do neither."""
    ddp = getattr(wrapped, "_orig_mod", wrapped)  # --compile's wrapper holds it
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return
    if torch.is_grad_enabled():
        ddp.reducer._rebuild_buckets()
    if ddp._check_sync_bufs_pre_fwd():
        ddp._sync_buffers()
    ddp.require_forward_param_sync = False  # as a forward under no_sync leaves it


def _add_no_tokens(device: torch.device) -> None:
    """This rank's part of the step's token count, which the ranks with batches sum (WindowTokens): none."""
    work = start_all_reduce_sum(torch.zeros((), dtype=torch.int64, device=device))
    if work is not None:
        work.wait()


def sum_gradients(model: torch.nn.Module, divisor: int) -> None:
    """Every trainable parameter's gradient summed over the ranks and divided by `divisor`: a rank that ran no
    backward adds zeros. One all-reduce per dtype and device, in the parameters' order, the same on every rank."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for parameter in model.parameters():
        if parameter.requires_grad:
            groups.setdefault((parameter.device, parameter.dtype), []).append(parameter)
    for (_, dtype), parameters in groups.items():
        flat = torch.cat(
            [
                (p.grad.to(dtype) if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in parameters
            ]
        )
        all_reduce_sum(flat)
        flat.div_(divisor)
        for parameter, piece in zip(parameters, flat.split([p.numel() for p in parameters])):
            parameter.grad = piece.view_as(parameter)
