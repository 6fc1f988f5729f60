"""Data order and random streams (issue 5, PITFALLS 2 and 20).

- The data order is a function of (seed, epoch), the same on every rank: rank r
  trains positions r, r+W, ... of it, so the shards are disjoint, equal in
  size, and W ranks x B see what one process x W*B sees.
- Augmentation and dropout draw from streams seeded with seed + rank (loader
  workers: + worker id), so they differ per rank and per worker and repeat on
  a rerun.
- The same seed twice gives bit-identical weights; another seed other weights.

The DDP runs are two spawns of 2 real gloo processes (run A: seeds 0 and 1,
run B: seed 0 again), shared by the tests through a module fixture.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from conftest import blobs, config_for, run_ranks
from multigpu.data.sampler import ResumableDistributedSampler, epoch_order
from train_multi_gpu import MultiGPUTrainer

WORLD, SIZE, BATCH, EPOCHS = 2, 64, 8, 2


class Augmented(Dataset):
    """blobs plus random noise drawn per sample (an augmentation); logs what it served when in-process."""

    def __init__(self, size: int):
        self.base = blobs(size, 0)
        self.log: list[tuple[int, float]] = []  # (index, first noise value), in serving order

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, target = self.base[index]
        noise = 0.1 * torch.randn(inputs.shape)
        self.log.append((index, noise[0].item()))
        return inputs + noise, target


class WorkerProbe(Dataset):
    """Serves (a random draw, the id of the loader worker that drew it)."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        worker = get_worker_info()
        assert worker is not None  # read by a loader's workers only
        return torch.rand(()), worker.id


def dropout_model(seed: int) -> torch.nn.Sequential:
    """Built like main_multi_gpu builds models: after torch.manual_seed(seed), so identical on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4)
    )


def train_recording(tmp_path: Path, world_size: int, seed: int) -> dict[str, Any]:
    """Train with augmentation and dropout; return the served indices and noise, dropout masks and weights."""
    model, data = dropout_model(seed), Augmented(SIZE)
    config = config_for(tmp_path, world_size, seed=seed, epochs=EPOCHS, batch_size=BATCH, num_workers=0)
    trainer = MultiGPUTrainer(model, data, None, config)
    data.log.clear()  # the samples the trainer read at start to count FLOPs per sample (docs/speed.md, "MFU")
    masks: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda module, args, output: masks.append((output == 0) & (args[0] != 0)))
    trainer.fit()
    per_epoch = len(data.log) // EPOCHS
    return {
        "order": [
            [index for index, _ in data.log[e * per_epoch : (e + 1) * per_epoch]] for e in range(EPOCHS)
        ],
        "noise": [value for _, value in data.log],
        "dropout": torch.stack(masks[:3]),
        "weights": {name: tensor.clone() for name, tensor in model.state_dict().items()},
    }


def worker_draws(tmp_path: Path, world_size: int, seed: int) -> dict[int, list[float]]:
    """One epoch through the trainer's own loader with 2 workers: each worker's draws in serving order."""
    trainer = MultiGPUTrainer(
        dropout_model(seed),
        WorkerProbe(),
        None,
        config_for(tmp_path, world_size, seed=seed, batch_size=BATCH, num_workers=2),
    )
    draws: dict[int, list[float]] = {}
    for values, workers in trainer.train_loader:
        for value, worker in zip(values.tolist(), workers.tolist()):
            draws.setdefault(worker, []).append(value)
    return draws


def _rank(rank: int, world_size: int, tmp_path: Path, seeds: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    # Under torchrun loader workers fork (the Linux default). These ranks were spawned, which would make
    # their workers spawn too and re-import torch for seconds each: fork, as in real runs.
    multiprocessing.set_start_method("fork", force=True)
    results = {}
    for seed in seeds:
        where = tmp_path / f"seed{seed}-rank{rank}"
        results[seed] = {
            **train_recording(where / "train", world_size, seed),
            "workers": worker_draws(where / "workers", world_size, seed),
        }
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[int, dict[str, Any]]]]:
    """{"A": per-rank results for seeds 0 and 1, "B": per-rank results of a rerun with seed 0}."""
    tmp_path = tmp_path_factory.mktemp("streams")
    return {
        name: run_ranks(_rank, WORLD, tmp_path, tmp_path / name, seeds)
        for name, seeds in (("A", (0, 1)), ("B", (0,)))
    }


# ------------------------------------------------------------------ the sampler alone
def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    order = epoch_order(11, seed=3, epoch=2)
    assert sorted(order.tolist()) == list(range(11))
    assert torch.equal(order, epoch_order(11, seed=3, epoch=2))
    assert not torch.equal(order, epoch_order(11, seed=3, epoch=3))
    assert not torch.equal(order, epoch_order(11, seed=4, epoch=2))


@pytest.mark.parametrize("size", [12, 13, 17])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_are_equal_disjoint_and_w_ranks_see_what_one_process_sees(size, world_size):
    samplers = [ResumableDistributedSampler(size, rank, world_size, seed=5) for rank in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(1)
    shards = [list(sampler) for sampler in samplers]
    usable = size - size % world_size  # at most W-1 samples left out, so batch counts are equal (no hang)
    assert (
        [len(shard) for shard in shards] == [len(s) for s in samplers] == [usable // world_size] * world_size
    )
    order = epoch_order(size, 5, 1)[:usable].tolist()
    assert sorted(sum(shards, [])) == sorted(order)  # disjoint and covering
    batch = 2
    for i in range(usable // world_size // batch):  # global batch i of W x B == batch i of 1 x W*B
        ranks_batch = {index for shard in shards for index in shard[i * batch : (i + 1) * batch]}
        assert ranks_batch == set(order[i * batch * world_size : (i + 1) * batch * world_size])


# ------------------------------------------------------------------ real DDP training
@pytest.mark.slow
def test_trained_order_comes_from_seed_and_epoch_and_is_shared_by_the_ranks(runs):
    for seed in (0, 1):
        ranks = [result[seed] for result in runs["A"]]
        for epoch in range(EPOCHS):
            order = epoch_order(SIZE, seed, epoch).tolist()
            for rank, result in enumerate(ranks):
                assert result["order"][epoch] == order[rank::WORLD], (seed, epoch, rank)
    assert runs["A"][0][0]["order"][0] != runs["A"][0][0]["order"][1]  # set_epoch reached the sampler


@pytest.mark.slow
def test_augmentation_and_dropout_differ_per_rank_and_repeat_on_a_rerun(runs):
    first, rerun = runs["A"], runs["B"]
    for stream in ("noise", "dropout"):
        rank0, rank1 = (first[rank][0][stream] for rank in range(WORLD))
        assert not _equal(rank0, rank1), f"{stream}: every rank drew the same randomness"
        for rank in range(WORLD):
            assert _equal(first[rank][0][stream], rerun[rank][0][stream]), (
                f"{stream}: rank {rank} did not repeat"
            )


@pytest.mark.slow
def test_loader_workers_draw_streams_of_their_own_per_rank_that_repeat(runs):
    first, rerun = runs["A"], runs["B"]
    for rank in range(WORLD):
        draws = first[rank][0]["workers"]
        assert sorted(draws) == [0, 1]
        assert draws[0] != draws[1]  # workers of one rank differ (seed + worker id)
        assert draws == rerun[rank][0]["workers"]
    assert first[0][0]["workers"] != first[1][0]["workers"]  # and ranks differ


@pytest.mark.slow
def test_same_seed_gives_bit_identical_weights_and_another_seed_other_weights(runs):
    seed0, again, seed1 = runs["A"][0][0]["weights"], runs["B"][0][0]["weights"], runs["A"][0][1]["weights"]
    assert all(torch.equal(seed0[name], again[name]) for name in seed0)
    assert all(not torch.equal(seed0[name], seed1[name]) for name in seed0)
    for name in seed0:  # DDP keeps the ranks identical despite their different dropout and augmentation
        assert torch.equal(seed0[name], runs["A"][1][0]["weights"][name])


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
