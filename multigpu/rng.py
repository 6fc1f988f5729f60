"""Random number generators: seeding, and their state as plain types for weights_only checkpoints."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python and NumPy."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (of `device`), Python and NumPy."""
    python_version, python_state, python_gauss = random.getstate()
    numpy_state = np.random.get_state()
    assert isinstance(numpy_state, tuple)  # the legacy form, get_state's default
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": [python_version, list(python_state), python_gauss],
        "numpy": [
            numpy_state[0],
            numpy_state[1].tolist(),
            *[x.item() if hasattr(x, "item") else x for x in numpy_state[2:]],
        ],
    }


def same_state(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether two `rng_state`s are the same: no random number was drawn between them."""

    def same(a: Any, b: Any) -> bool:
        return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b

    return all(same(ours[name], theirs[name]) for name in ("torch", "cuda", "python", "numpy"))


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
