"""The hang watchdog (--hang-timeout) on real hangs: 2 gloo processes started as torchrun starts its workers,
one of them misbehaving; each run ends by itself within the hang timeout plus a few seconds."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import HANG, TINY, busy_cpus, cli_env, run_cli, torchrun_command
from conftest import HANG_RUN_LIMIT as LIMIT
from conftest import run_hang_scenario as scenario
from multigpu.errors import HANG_EXIT_STATUS
from multigpu.resilience.faults import FAULT_ENV


def report(save_dir: Path) -> str:
    return (save_dir / "hang_report.txt").read_text()


@pytest.mark.slow
def test_a_stopped_rank_is_named_its_peer_saved_and_resume_continues(tmp_path):
    """Through multigpu/launch/torchrun.py, as the launcher and the SLURM script run it: exit status 3 and one line."""
    save_dir, log, started = tmp_path / "ckpt", tmp_path / "torchrun.log", time.monotonic()
    result = subprocess.run(
        torchrun_command(log, *HANG, "--save-dir", str(save_dir)),
        cwd=tmp_path,
        env=cli_env({FAULT_ENV: "1:3:stop"}),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert result.returncode == HANG_EXIT_STATUS, result.stderr
    assert time.monotonic() - started < LIMIT
    assert (
        f"torchrun: hang: see {save_dir / 'hang_report.txt'} (rank 0 stopped the run with status 3"
        in result.stderr
    )
    assert (
        "exitcode  : -9" in log.read_text()
    )  # rank 0's watchdog ended the stopped rank: torchrun did not wait
    text = report(save_dir)
    assert "rank 1 does not respond (stopped, frozen or dead)" in text.splitlines()[1]
    # where it was: its last heartbeat if it is as recent as step 3, else the step 3 it took with rank 0
    assert re.search(r"rank 1 .*(last heard at step [3-9]|completed step 3 with the others)", text), text
    assert "rank 0 waits in DDP's gradient all-reduce (backward)" in text
    assert (
        "in _forward_backward" in text.split("--- rank 0")[1]
    )  # rank 0's stack, from its own watchdog thread
    assert "(no answer: rank 1 does not respond" in text
    assert (save_dir / "step-000000003.pt").exists()  # rank 1 stopped after step 3: the last completed step
    assert "hang: checkpoint of the last completed step (3) written" in result.stderr

    resumed = run_cli([*TINY, *HANG, "--save-dir", str(save_dir), "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from " + str(save_dir / "step-000000003.pt") in resumed.stdout


@pytest.mark.slow
def test_a_data_set_stuck_on_rank_1_is_named_with_the_line_of_its_getitem(tmp_path):
    ranks = scenario("getitem", tmp_path)
    assert [rank.returncode for rank in ranks] == [HANG_EXIT_STATUS] * 2, ranks[0].stderr
    text = report(tmp_path)
    assert "rank 1 stuck in data loading" in text.splitlines()[1]
    assert "hang_scenarios.py:" in text.splitlines()[2] and "in __getitem__" in text.splitlines()[2]
    assert "threading.Event().wait()  # a read that never returns" in text.split("--- rank 1")[1]
    assert list(tmp_path.glob("step-*.pt"))


@pytest.mark.slow
def test_on_a_hybrid_mesh_the_report_names_the_stuck_ranks_replica_and_shard(tmp_path):
    """fsdp at replicate 2 x shard 1: rank 1, alone in the second replica, blocks in its data set."""
    ranks = scenario("getitem", tmp_path, "--multi-gpu", "fsdp", "--dp-replicate", "2")
    assert [rank.returncode for rank in ranks] == [HANG_EXIT_STATUS] * 2, ranks[0].stderr
    lines = report(tmp_path).splitlines()
    assert "rank 1 (mesh replicate 1, shard 0) stuck in data loading" in lines[1]
    # Its peer waits in FSDP's gradient all-reduce across the replicas.
    assert (
        "rank 0 (mesh replicate 0, shard 0) waits in FSDP's torch.distributed.all_reduce (backward)"
        in lines[3]
    )
    # Rank 0 holds a shard only: no checkpoint from its replica, the last sharded one stays the resume point.
    assert (
        "no checkpoint written: under fsdp the last complete sharded checkpoint stays the resume point"
        in ranks[0].stderr
    ), ranks[0].stderr
    assert not list(tmp_path.glob("step-*"))


def test_a_collective_on_rank_0_only_is_named_a_desync(tmp_path):
    ranks = scenario("extra-barrier", tmp_path)
    assert [rank.returncode for rank in ranks] == [HANG_EXIT_STATUS] * 2, ranks[0].stderr
    headline = report(tmp_path).splitlines()[1]
    assert "desync: ranks wait in different collectives: rank 0 in torch.distributed.barrier" in headline
    assert "rank 1 in DDP's gradient all-reduce (backward)" in headline


@pytest.mark.slow
def test_a_rank_that_dies_of_a_desync_is_named_by_its_peer_which_saves_the_last_step(tmp_path):
    """On gloo an extra all_reduce of another size aborts the peer that receives it at once (no hang): the
    survivor names the lost rank, the collective it was in as not the trainer's, a desync, and keeps its step."""
    ranks = scenario("extra-all-reduce", tmp_path)
    assert [rank.returncode for rank in ranks] == [1, -6], ranks[0].stderr  # rank 1: gloo's abort (SIGABRT)
    said = ranks[0].stderr.strip().splitlines()
    assert said[0].startswith("rank 0: lost contact with rank 1, which died or hung (")
    assert "while this rank was in torch.distributed.all_reduce called at " in said[0]
    assert "hang_scenarios.py:" in said[0] and "not one of the trainer's collectives" in said[0]
    assert "the ranks desynchronised (a desync; --debug-collectives checks every collective)" in said[0]
    assert said[1].startswith(
        "rank 0: checkpoint of the last completed step (3) written from rank 0's replica: "
    )
    assert [path.name for path in tmp_path.glob("step-*.pt")] == ["step-000000003.pt"]
    assert "Traceback" not in ranks[0].stderr


@pytest.mark.slow
def test_a_callback_deadlocked_on_rank_0_is_shown_in_user_code_and_rank_0_writes_the_report(tmp_path):
    ranks = scenario("callback", tmp_path)
    assert [rank.returncode for rank in ranks] == [HANG_EXIT_STATUS] * 2, ranks[0].stderr
    text = report(tmp_path)
    assert "rank 0 stuck in user code (callbacks) at step 3, at " in text
    assert "self.lock.acquire()  # never released" in text.split("--- rank 0")[1]
    assert "rank 1 waits in all_reduce" in text
    assert "no checkpoint written: rank 0 itself is stuck" in text
    assert not list(tmp_path.glob("step-*.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("run", [1, 2])
def test_slow_is_not_stuck_a_run_under_cpu_load_with_a_short_timeout_finishes(tmp_path, run):
    with busy_cpus(os.cpu_count() or 2):
        ranks = scenario("plain", tmp_path, "--hang-timeout", "2", "--epochs", "1")
    assert [rank.returncode for rank in ranks] == [0, 0], ranks[0].stderr
    assert not (tmp_path / "hang_report.txt").exists()


class CountingStore:
    """A store that counts the calls made to it (each a GIL hand-off from the watchdog's thread's C++ call)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store, self.calls = dist.HashStore(), 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def test_a_lone_process_watchdog_looks_without_store_round_trips_and_at_most_every_5_seconds(tmp_path):
    """Each look took the GIL from the training thread 6 times over (the store's calls release it): a one-process
    GPT-2 step's thread waited for it back 35-57 times in 50 steps where Hugging Face's Trainer's waited 6, and on a
    busy machine each wait is a time slice lost. Alone, the watchdog reads its own heartbeat; every rank looks at
    most every 5 s with the default --hang-timeout (300 s), still every 0.6 s with a 3 s one."""
    from multigpu.resilience.heartbeat import BEAT
    from multigpu.resilience.watchdog import Watchdog

    store = CountingStore()
    alone = Watchdog(0, 1, 300.0, str(tmp_path), "gloo", lambda verdict: "", store=store)
    BEAT.restart()
    for step in range(1, 4):
        BEAT.step = step
        alone._tick()
    assert store.calls == 0 and alone.latest[0]["step"] == 3 and alone.beats == 3
    assert alone.seen[0][0][0] == 3  # its position, as the decision reads it
    pair = Watchdog(0, 2, 300.0, str(tmp_path), "gloo", lambda verdict: "", store=store)
    pair._tick()
    assert store.calls > 0 and pair.latest[0]["step"] == 3  # published for the other rank, and read back
    assert (
        alone.interval,
        Watchdog(0, 1, 3.0, str(tmp_path), "gloo", lambda v: "", store=store).interval,
    ) == (
        5.0,
        0.6,
    )
    BEAT.restart()
