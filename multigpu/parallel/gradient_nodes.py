"""Autograd's AccumulateGrad nodes, held for the whole run so that every step reuses them.

Each parameter's gradient is added to `.grad` by an AccumulateGrad node in the
autograd graph. The parameter keeps only a weak reference to it, so once a
step's graph is freed the nodes go too, and the next forward makes them anew:
per parameter and step, one node built and one destroyed, each holding the
parameter, which Python also holds, so torch takes Python's lock to count that
reference (twice per parameter per step). DDP's reducer holds the nodes itself;
a hand-written loop holds them without knowing it, in its `loss` variable,
until the next step's forward has used them. Holding them here gives the
single-process and DataParallel paths the same (docs/measured.md, "Per-step
overhead"). Nothing computed changes: these are the very nodes autograd uses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge


def hold_gradient_nodes(model: torch.nn.Module) -> list[Any]:
    """The AccumulateGrad node of every parameter of `model` that requires a gradient; keep the list alive."""
    return [get_gradient_edge(parameter).node for parameter in model.parameters() if parameter.requires_grad]
