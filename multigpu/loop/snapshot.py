"""Probes that leave no trace: measure a step at start, then put the model, optimizer and RNG back exactly.

Counting FLOPs and finding the batch size that fits run real steps before
training starts; a run with them must train exactly as one without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from multigpu import rng
from multigpu.data.batches import map_tensors


def _cpu_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of `state` (a state_dict) with its tensors on the CPU: kept aside without taking device memory."""
    return map_tensors(lambda tensor: tensor.detach().to("cpu", copy=True), state)


@contextlib.contextmanager
def kept(
    model: torch.nn.Module,
    device: torch.device,
    *,
    weights: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> Iterator[None]:
    """Run the block in training mode, then restore what its steps changed.

    Always: the RNG states (torch, CUDA, Python, NumPy), the buffers (BatchNorm
    statistics), the gradients and the train/eval mode. With `weights`, the
    parameters too, and with `optimizer` its state (moments, step counts, LRs),
    for probes that take optimizer steps.
    """
    random_state = rng.rng_state(device)
    saved = _cpu_copy(model.state_dict() if weights else dict(model.named_buffers()))
    optimizer_state = _cpu_copy(optimizer.state_dict()) if optimizer is not None else None
    gradients = [parameter.grad for parameter in model.parameters()]
    training = model.training
    for parameter in model.parameters():
        parameter.grad = None  # the probe's backward must not add to gradients the caller holds
    model.train()
    try:
        yield
    finally:
        with torch.no_grad():
            if weights:
                model.load_state_dict(saved)
            else:
                for name, buffer in model.named_buffers():
                    buffer.copy_(saved[name])
        if optimizer is not None:
            assert optimizer_state is not None  # saved above with the optimizer
            optimizer.load_state_dict(optimizer_state)
        for parameter, gradient in zip(model.parameters(), gradients):
            parameter.grad = gradient
        model.train(training)
        rng.set_rng_state(random_state, device)
