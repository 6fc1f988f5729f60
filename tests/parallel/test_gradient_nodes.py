"""The trainer holds each parameter's AccumulateGrad node: every step's graph uses those very nodes."""

from __future__ import annotations

from typing import Any

import torch

from conftest import blobs, config_for, tiny_model
from multigpu.parallel.gradient_nodes import hold_gradient_nodes
from train_multi_gpu import MultiGPUTrainer


def accumulate_grad_nodes(output: torch.Tensor) -> list:
    """The AccumulateGrad nodes of the graph that produced `output`."""
    found = []
    stack: list[Any] = [output.grad_fn]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None:
                continue
            if type(node).__name__ == "AccumulateGrad":
                found.append(node)
            else:
                stack.append(node)
    return found


def test_one_node_per_parameter_that_trains():
    model = tiny_model()
    model[0].bias.requires_grad_(False)  # frozen: autograd makes no node for it
    nodes = hold_gradient_nodes(model)
    assert len(nodes) == 3 and all(type(node).__name__ == "AccumulateGrad" for node in nodes)
    assert sorted(map(id, nodes)) == sorted(map(id, accumulate_grad_nodes(model(torch.randn(2, 16)))))


def test_every_training_step_uses_the_nodes_the_trainer_holds(tmp_path):
    trainer = MultiGPUTrainer(
        tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=1, batch_size=16)
    )
    held = {id(node) for node in trainer.gradient_nodes}  # alive all along, so an equal id is the same node
    steps: list[set[int]] = []
    trainer.model.register_forward_hook(
        lambda module, args, output: (
            steps.append({id(node) for node in accumulate_grad_nodes(output)}) if module.training else None
        )
    )
    trainer.fit()
    assert len(held) == 4 and len(steps) == 4  # 64 samples / 16: 4 steps
    assert all(step == held for step in steps)
