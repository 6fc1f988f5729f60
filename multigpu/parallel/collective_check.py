"""--debug-collectives: before each of the trainer's collectives and each DDP gradient all-reduce, every rank
posts (operation, shape, dtype, the group's collective count) to the rendezvous store and compares with the
others, so a mismatch is one line naming the operation, the ranks and the shapes instead of a hang or garbage.

A rank that has not arrived is waited for (slow is not stuck) until its heartbeat (multigpu/resilience/heartbeat.py,
published by the hang watchdog) shows that it issued more collectives of the group than this rank: it waits
in one this rank did not call, which is the mismatch. torch's own TORCH_DISTRIBUTED_DEBUG=DETAIL check is turned
on beside it on NCCL only (multigpu/parallel/distributed.py): DDP built on its checking process group crashes on the CPU
(gloo, torch 2.14).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from multigpu.errors import TrainingStopped
from multigpu.resilience.hang_report import where_waiting
from multigpu.resilience.heartbeat import BEAT
from multigpu.resilience.watchdog import PREFIX, group_sequence_number

MISMATCH_KEY = PREFIX + "mismatch"  # the line, for the other ranks' watchdogs: they exit quietly
DDP_ALL_REDUCE = "DDP's gradient all-reduce"


class CollectiveCheck:
    """Compares each collective across ranks through the store (one key per rank and collective)."""

    def __init__(self, rank: int, world_size: int, give_up_after: float):
        self.rank, self.world_size, self.give_up_after = rank, world_size, give_up_after
        self.store = dist.distributed_c10d._get_default_store()
        self.count = 0  # collectives checked on this rank: the same on every rank while they agree

    def __call__(self, op: str, shape: tuple[int, ...], dtype: str) -> None:
        self.count += 1
        mine = {"op": op, "shape": list(shape), "dtype": dtype, "group_seq": group_sequence_number()}
        key = f"{PREFIX}check/{self.count}/"
        self.store.set(key + str(self.rank), json.dumps(mine))
        calls = self._wait_for_all(key, mine)
        self._compare(calls)

    def _wait_for_all(self, key: str, mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        keys = [key + str(r) for r in range(self.world_size)]
        deadline = time.monotonic() + self.give_up_after
        while True:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                return {r: json.loads(raw) for r, raw in enumerate(self.store.multi_get(keys))}
            elsewhere = self._ahead(missing, mine["group_seq"])
            if elsewhere or time.monotonic() > deadline:
                where = (
                    "; ".join(f"rank {r} {what}" for r, what in elsewhere.items())
                    or f"rank(s) {', '.join(map(str, missing))} did not arrive within {self.give_up_after:g} s"
                )
                self._fail(
                    f"collective mismatch: rank {self.rank} calls {_call(mine)} (the trainer's collective "
                    f"#{self.count}), while {where}"
                )
            time.sleep(0.05)  # polling the store while the others arrive: debug mode, not the fast path

    def _ahead(self, missing: list[int], mine: int | None) -> dict[int, str]:
        """The missing ranks that issued more collectives of the group than this rank has: they called one
        that this rank did not, and wait in it (they can never come here). From their watchdog's heartbeat."""
        found = {}
        for rank in missing:
            key = f"{PREFIX}hb/{rank}"
            if mine is None or not self.store.check([key]):
                continue
            beat = json.loads(self.store.get(key))
            if beat["group_seq"] is not None and beat["group_seq"] > mine:
                waits = where_waiting(beat) or f"{beat['phase']} at {beat['code']}"
                found[rank] = f"issued {beat['group_seq'] - mine} collective(s) more and waits in {waits}"
        return found

    def _compare(self, calls: dict[int, dict[str, Any]]) -> None:
        kinds = {(c["op"], tuple(c["shape"]), c["dtype"]) for c in calls.values()}
        if len(kinds) > 1:
            self._fail(
                f"collective mismatch at the trainer's collective #{self.count}: "
                + "; ".join(f"rank {r} calls {_call(c)}" for r, c in calls.items())
            )
        counts = {c["group_seq"] for c in calls.values()}
        if len(counts) > 1:
            self._fail(
                f"collective mismatch before {_call(calls[0])}: the ranks issued different numbers of "
                f"collectives ("
                + ", ".join(f"rank {r}: {c['group_seq']}" for r, c in calls.items())
                + "): a collective outside the trainer (the model, a callback) ran on some ranks only"
            )

    def _fail(self, line: str) -> None:
        """Say the line, let the other ranks' watchdogs end their processes quietly, and exit 1. No exception
        could unwind this: the other ranks wait inside collectives that will never complete."""
        print(f"error: rank {self.rank}: {line}", file=sys.stderr, flush=True)
        try:
            self.store.set(MISMATCH_KEY, f"{self.rank}:{line}")
            others = [f"{PREFIX}mismatch-seen/{r}" for r in range(self.world_size) if r != self.rank]
            deadline = time.monotonic() + 5
            while others and time.monotonic() < deadline and not self.store.check(others):
                time.sleep(0.05)
        except Exception:  # the store lived in a rank that has already gone: nothing left to tell
            pass
        sys.stdout.flush()
        os._exit(TrainingStopped.exit_code)


def _call(call: dict[str, Any]) -> str:
    return f"{call['op']} of shape {list(call['shape'])} {call['dtype']}"


def install(
    ddp_model: torch.nn.parallel.DistributedDataParallel | None,
    rank: int,
    world_size: int,
    give_up_after: float,
) -> None:
    """Check every trainer collective (through BEAT.recorded) and, on `ddp_model`, every gradient bucket's
    all-reduce (a DDP communication hook that checks, then all-reduces as DDP does by default)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    check = CollectiveCheck(rank, world_size, give_up_after)
    BEAT.check = check

    def checked_allreduce(state, bucket):  # DDP reads real annotations, not strings
        """(state, dist.GradBucket) -> Future, as DDP's default hook."""
        buffer = bucket.buffer()
        check(DDP_ALL_REDUCE, tuple(buffer.shape), str(buffer.dtype).removeprefix("torch."))
        return allreduce_hook(state, bucket)

    if ddp_model is not None:
        ddp_model.register_comm_hook(None, checked_allreduce)
