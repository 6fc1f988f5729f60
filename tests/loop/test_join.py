"""The uneven end of a stream under DDP (multigpu/loop/join.py): the ranks that ran out join the others' steps,
so the others train what they still hold, and every rank takes every step alike.

Two gloo ranks hold 20 and 8 samples of a stream that splits by rank itself; batches of 4, 2 micro-batches a
step: step 1 is even (8 samples on each rank), step 2 is rank 0's full window alone, step 3 its short window
(one micro-batch) alone. Two epochs with Adam, a loss over samples, a loss over tokens, and a model with
BatchNorm (whose buffers DDP broadcasts in a forward): the two ranks end on the same weights and Adam moments,
bit for bit, and those are a plain one-process loop's over the same steps (each step's loss the mean over the
samples, or the counted tokens, the ranks trained in it). torch's own
`DistributedDataParallel.join()` leaves the ranks' Adam moments apart, and the replicas drift after it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from conftest import config_for, run_ranks, tiny_model
from multigpu.loop.tokens import IGNORE_INDEX, SequenceCrossEntropy

SHARES = (20, 8)  # samples of rank 0 and rank 1
STEPS = [[*range(0, 8), *range(20, 28)], list(range(8, 16)), list(range(16, 20))]  # each step's samples
VOCAB, LENGTH = 11, 6
KINDS = ("samples", "tokens", "batchnorm")


def sample(kind: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `i`: 16 features and a class, or LENGTH token ids and their next tokens, 1 to LENGTH counted."""
    draw = torch.Generator().manual_seed(i)
    if kind != "tokens":
        return torch.randn(16, generator=draw), torch.tensor(i % 4)
    ids = torch.randint(0, VOCAB, (LENGTH,), generator=draw)
    counted = 1 + i % LENGTH
    return ids, torch.where(torch.arange(LENGTH) < counted, ids.roll(-1), IGNORE_INDEX)


class RankShares(IterableDataset):
    """A stream whose rank reads its own share (SHARES), as a reader of whole files per rank does."""

    shards_itself = True

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __iter__(self):
        rank = int(os.environ.get("RANK", 0))
        start = sum(SHARES[:rank])
        return (sample(self.kind, i) for i in range(start, start + SHARES[rank]))


class TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def model_for(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "batchnorm":  # buffers DDP broadcasts from rank 0 at a forward after a synced one
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
    return tiny_model() if kind == "samples" else TokenModel()


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def train_uneven(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Each kind's weights, Adam moments and steps on this rank after 2 epochs."""
    from train_multi_gpu import MultiGPUTrainer

    results = {}
    for kind in KINDS:
        config = config_for(
            tmp / kind, world, batch_size=4, grad_accum_steps=2, epochs=2, log_every=1, lr_schedule="constant"
        )
        with MultiGPUTrainer(model_for(kind), RankShares(kind), None, config, optimizer=adam) as trainer:
            summary = trainer.fit()
            moments = [state["exp_avg"].clone() for state in trainer.optimizer.state.values()]
            results[kind] = {
                "weights": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
                "moments": moments,
                "steps": summary["global_step"],
                "uneven": getattr(trainer.step, "uneven_steps", 0),
            }
    return results


def one_process(kind: str) -> dict[str, torch.Tensor]:
    """A plain loop over STEPS, twice: each step's loss the mean over its samples' losses (or counted tokens)."""
    model = model_for(kind)
    optimizer = adam(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss() if kind == "samples" else SequenceCrossEntropy()
    for _ in range(2):
        for ids in STEPS:
            inputs, targets = (torch.stack(column) for column in zip(*(sample(kind, i) for i in ids)))
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_ranks_that_run_out_join_the_others_steps_and_every_rank_takes_them_alike(tmp_path: Path) -> None:
    ranks = run_ranks(train_uneven, 2, tmp_path, tmp_path)
    for kind in KINDS:
        first, second = (rank[kind] for rank in ranks)
        assert first["steps"] == second["steps"] == 2 * len(STEPS), kind
        assert first["uneven"] == second["uneven"] == 4, kind  # steps 2 and 3 of each epoch
        for name, weight in first["weights"].items():
            assert torch.equal(weight, second["weights"][name]), (kind, name)  # the replicas never drift
        assert all(torch.equal(a, b) for a, b in zip(first["moments"], second["moments"])), kind
        if kind == "batchnorm":  # normalized over each rank's batch: not one process's batch of both
            continue
        expected = one_process(kind)
        for name, weight in first["weights"].items():
            torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-5, msg=f"{kind} {name}")
