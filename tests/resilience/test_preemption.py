"""A survivor of a lost peer (multigpu/resilience/preemption.py), in real gloo processes. The double SIGTERM and
Ctrl-C cases are in test_resume.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import PYTHON, REPO, cli_env, run_ranks
from multigpu.resilience.preemption import PeerLost, StopRequest, stops_handled
from multigpu.resilience.watchdog import Watchdog


def _survive_torchruns_sigterm_while_saving(rank: int, world_size: int, marker: str) -> object:
    if rank == 1:
        return None  # this rank leaves: its connections close under rank 0's next collective
    stop = StopRequest()

    def save_last_step() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's SIGTERM to the survivors, at the worst moment
        Path(marker).write_text("saved")

    try:
        with stops_handled(stop, rank, world_size, wait_seconds=5.0, on_peer_lost=save_last_step):
            dist.all_reduce(torch.ones(1))
    except PeerLost as error:
        return error.lost, stop.signal_name, Path(marker).read_text(), signal.getsignal(signal.SIGTERM)
    return "the collective did not fail"


def test_a_survivors_save_after_losing_a_peer_is_not_cut_off_by_sigterm(tmp_path):
    lost, signal_name, saved, handler_after = run_ranks(
        _survive_torchruns_sigterm_while_saving, 2, tmp_path, str(tmp_path / "marker")
    )[0]
    assert (lost, signal_name, saved) == ([1], "SIGTERM", "saved")  # the signal only set the flag
    assert handler_after == signal.SIG_DFL  # and the handlers are put back afterwards


def _lose_a_rank_while_another_waits_elsewhere(rank: int, world_size: int, save_dir: str) -> object:
    """Hybrid sharding's case in 3 ranks: rank 0 shares a group with rank 1, which dies, and another with rank 2,
    which waits in that group's collective (alive, its main thread stuck there) while rank 0 calls the roll."""
    with_1, with_2 = dist.new_group([0, 1]), dist.new_group([0, 2])
    watchdog = Watchdog(rank, world_size, 300.0, save_dir, "gloo", lambda verdict: "").start()
    if rank == 1:
        watchdog.stop()  # its last heartbeat stays in the store, as a killed rank's does
        return None  # this rank leaves: its connections close under rank 0's collective
    try:
        if rank == 2:
            assert isinstance(with_2, dist.ProcessGroup)  # rank 2 is in it
            dist.all_reduce(torch.ones(1), group=with_2)  # until rank 0 joins it, after its roll call
            return None
        assert isinstance(with_1, dist.ProcessGroup) and isinstance(with_2, dist.ProcessGroup)  # rank 0: both
        started = time.monotonic()
        try:
            with stops_handled(StopRequest(), rank, world_size, wait_seconds=10.0):
                dist.all_reduce(torch.ones(1), group=with_1)
        except PeerLost as error:
            lost, seconds = error.lost, time.monotonic() - started
        dist.all_reduce(torch.ones(1), group=with_2)
        return lost, seconds
    finally:
        watchdog.stop()


def test_a_rank_waiting_in_another_collective_is_alive_and_not_named_lost(tmp_path, capfd):
    """Under hybrid sharding ranks 0 and 3 said `lost contact with ranks 1, 2` while rank 2 was alive: a rank
    whose hang watchdog still beats is not gone, and the roll call ends as soon as it knows."""
    lost, seconds = run_ranks(_lose_a_rank_while_another_waits_elsewhere, 3, tmp_path, str(tmp_path))[0]
    assert lost == [1] and seconds < 8  # not the whole wait for a rank that will not answer in time
    assert "rank 0: lost contact with rank 1, which died or hung" in capfd.readouterr().err


WAITS_FOR_A_QUORUM = """
import sys, threading
from multigpu.resilience.preemption import StopRequest
stop = StopRequest()
stop.install()
seconds = {"inside": 60, "ends in time": 0.5, "outside": 1.5}[sys.argv[1]]
if sys.argv[1] == "outside":
    print("waiting", flush=True)
    threading.Event().wait(seconds)
else:
    with stop.exits_while("rank 0 of replica group 1 waits for the quorum of step 7"):
        print("waiting", flush=True)
        threading.Event().wait(seconds)  # as torchft's quorum future is waited for
    threading.Event().wait(1.5)  # past the grace: the process was not ended
print("after the wait, requested:", stop.requested, flush=True)
"""


def test_a_stop_request_while_waiting_for_other_processes_ends_the_process_at_once_elsewhere_it_waits(
    tmp_path,
):
    """StopRequest.exits_while: a SIGTERM inside the block (a wait a lost process never ends) whose wait is
    still on a second later exits with its line and status 128 + 15; a wait that ends within that second, or a
    SIGTERM outside the block, only sets the flag, and the process goes on to stop cleanly."""
    results = {}
    for where in ("inside", "ends in time", "outside"):
        process = subprocess.Popen(
            [PYTHON, "-c", WAITS_FOR_A_QUORUM, where],
            cwd=REPO,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        assert process.stdout.readline() == "waiting\n"
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        results[where] = (process.returncode, out, err, time.monotonic() - sent)
    status, _, err, seconds = results["inside"]
    assert status == 128 + signal.SIGTERM and 1 <= seconds < 10, results
    assert err == (
        "SIGTERM while rank 0 of replica group 1 waits for the quorum of step 7 (still after 1 s): exiting "
        "now without a checkpoint\n"
    )
    for where in ("ends in time", "outside"):
        status, out, err, _ = results[where]
        assert status == 0 and out == "after the wait, requested: True\n" and err == "", results
