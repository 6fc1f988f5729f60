"""--activation-checkpointing (multigpu/parallel/activation_checkpointing.py): each block runs its forward again in
backward, and training gives the same weights as without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TokenDicts, config_for, full_weights, tiny_gpt2
from multigpu.errors import UsageError
from multigpu.models import GPT
from multigpu.parallel.activation_checkpointing import checkpoint_activations
from train_multi_gpu import MultiGPUTrainer

TOLERANCE = 1e-6
SIZE = 32  # token windows: 4 optimizer steps of 8


def gpt2() -> torch.nn.Module:
    """A transformers GPT-2 without dropout (then recomputing draws nothing, and the runs compare to 1e-6)."""
    model = tiny_gpt2()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def train(tmp_path: Path, model: torch.nn.Module, block: str, **overrides: Any) -> dict[str, Any]:
    """Train `model` on token windows; its weights, and how often each block's `block` (its attention: a module
    inside what is recomputed) ran forward per training step."""
    config = config_for(tmp_path, 1, epochs=1, lr=0.01, **overrides)
    forwards: list[int] = []
    windows = TokenDicts(SIZE, 0)
    # transformers' models take dicts; the built-in GPT (inputs, targets) pairs
    data = windows if block == "GPT2Attention" else torch.utils.data.TensorDataset(windows.ids, windows.ids)
    trainer = MultiGPUTrainer(model, data, None, config)
    blocks = [module for module in trainer.model.modules() if type(module).__name__ == block]
    for module in blocks:
        module.register_forward_hook(lambda *args: forwards.append(1) if torch.is_grad_enabled() else None)
    trainer.fit()
    steps = trainer.progress.global_step
    return {"weights": full_weights(trainer), "runs_per_step": len(forwards) / (steps * len(blocks))}


@pytest.mark.parametrize(
    "make, block",
    [(gpt2, "GPT2Attention"), (lambda: GPT(32, 12, n_layer=2, n_head=2, n_embd=16), "CausalSelfAttention")],
    ids=["transformers' own", "torch's wrapper"],
)
def test_the_blocks_run_forward_again_in_backward_and_the_weights_are_the_same(tmp_path, make, block):
    torch.manual_seed(0)
    plain = train(tmp_path / "plain", make(), block)
    torch.manual_seed(0)
    checkpointed = train(tmp_path / "checkpointed", make(), block, activation_checkpointing=True)
    assert plain["runs_per_step"] == 1
    assert checkpointed["runs_per_step"] == 2  # forward, and again in backward
    weights = plain["weights"]
    assert weights.keys() == checkpointed["weights"].keys()  # no wrapper in the checkpoint's names
    assert max((weights[k] - checkpointed["weights"][k]).abs().max().item() for k in weights) <= TOLERANCE


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 2)


def test_a_model_without_blocks_is_refused_in_one_line():
    with pytest.raises(UsageError) as refused:
        checkpoint_activations(TwoLayers(), None, sharded=False)
    assert str(refused.value).startswith("--activation-checkpointing: TwoLayers has no repeated blocks")
