"""A probe step at start leaves no trace: buffers, gradients, RNG, mode, and on request weights and optimizer."""

from __future__ import annotations

import random

import numpy as np
import torch

from multigpu.loop.snapshot import kept


def model_with_state() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)
    )


def everything(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [tensor for values in optimizer.state.values() for tensor in values.values()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [t.detach().clone() for t in [*model.state_dict().values(), *state, *grads]]


def probe_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(
        torch.randn(6, 4)
    ).sum().backward()  # dropout draws random numbers, BatchNorm updates its statistics
    optimizer.step()
    random.random()
    np.random.rand()


def test_weights_optimizer_buffers_gradients_rng_and_mode_come_back_exactly():
    model = model_with_state()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    probe_step(model, optimizer)  # the optimizer has state, the parameters gradients
    model.eval()
    before = everything(model, optimizer)
    rng_before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with kept(model, torch.device("cpu"), weights=True, optimizer=optimizer):
        assert model.training  # probes run in training mode
        for _ in range(3):
            probe_step(model, optimizer)
    after = everything(model, optimizer)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1]
    assert np.array_equal(np.random.get_state()[1], rng_before[2])


def test_without_weights_the_buffers_and_gradients_still_come_back():
    model = model_with_state()
    model(torch.randn(6, 4)).sum().backward()
    statistics, gradient = model[1].running_mean.clone(), model[0].weight.grad.clone()
    with kept(model, torch.device("cpu")):
        assert model[0].weight.grad is None  # the probe's backward starts from no gradient
        model(torch.randn(6, 4)).sum().backward()
    assert torch.equal(model[1].running_mean, statistics) and torch.equal(model[0].weight.grad, gradient)
