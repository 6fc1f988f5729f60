"""Test-only training script whose user code misbehaves on one rank, for tests/resilience/test_watchdog.py.

    torchrun --nproc_per_node=2 tests/hang_scenarios.py SCENARIO [main_multi_gpu.py flags]

SCENARIO: getitem (rank 1's data set blocks forever in __getitem__), extra-all-reduce and extra-barrier (rank 0's
model calls one collective more than rank 1's, a data-dependent branch), callback (a training hook deadlocks on
rank 0 on a lock never released), plain (nothing misbehaves).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from multigpu.config import parse_config  # noqa: E402
from multigpu.launch.runner import main_guarded  # noqa: E402
from train_multi_gpu import MultiGPUTrainer  # noqa: E402

STUCK_AFTER = 30  # samples the misbehaving data set reads on rank 1 before it blocks (a few steps in)
RANK = int(os.environ.get("RANK", "0"))


class Blobs(Dataset):
    """16 features, 4 classes; with `blocks`, __getitem__ of the STUCK_AT-th sample on rank 1 never returns."""

    def __init__(self, size: int, blocks: bool = False):
        generator = torch.Generator().manual_seed(0)
        self.targets = torch.randint(4, (size,), generator=generator)
        self.inputs = torch.randn(size, 16, generator=generator) + self.targets[:, None].float()
        self.blocks, self.reads = blocks, 0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.blocks and RANK == 1 and self.reads > STUCK_AFTER:
            threading.Event().wait()  # a read that never returns: a dead file system, a stuck socket
        return self.inputs[index], self.targets[index]


class ExtraCollective(torch.nn.Module):
    """Rank 0 takes a branch that calls a collective (all_reduce of its activations, or a barrier); rank 1 does
    not: a desync. (On gloo an all_reduce of another size than the peer's aborts inside gloo at once; a barrier
    waits, as most desyncs on NCCL do.)"""

    def __init__(self, collective: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)
        self.collective, self.calls = collective, 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if RANK == 0 and self.training and self.calls == 6:  # the data-dependent branch, a few steps in
            dist.all_reduce(inputs) if self.collective == "all-reduce" else dist.barrier()
        return self.layer(inputs)


class DeadlockOnRank0:
    """A training hook that takes a lock it already holds (on rank 0, at step 3)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def on_step_end(self, trainer: Any) -> None:
        if RANK == 0 and trainer.progress.global_step == 3:
            with self.lock:
                self.lock.acquire()  # never released: the hook waits for itself


def train(argv: Sequence[str] | None) -> dict:
    scenario, *flags = argv if argv is not None else sys.argv[1:]
    config = parse_config(flags)
    torch.manual_seed(0)
    model = (
        ExtraCollective(scenario.removeprefix("extra-"))
        if scenario.startswith("extra-")
        else torch.nn.Sequential(torch.nn.Linear(16, 4))
    )
    callbacks = [DeadlockOnRank0()] if scenario == "callback" else []
    with MultiGPUTrainer(
        model, Blobs(256, blocks=scenario == "getitem"), Blobs(32), config, callbacks=callbacks
    ) as trainer:
        return trainer.fit()


if __name__ == "__main__":
    sys.exit(main_guarded(train))
