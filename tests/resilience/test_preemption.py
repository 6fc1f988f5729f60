"""A survivor of a lost peer (multigpu/resilience/preemption.py), in real gloo processes. The double SIGTERM and Ctrl-C cases
are in test_resume.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import run_ranks
from multigpu.resilience.preemption import PeerLost, StopRequest, stops_handled


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
    lost, signal_name, saved, handler_after = run_ranks(_survive_torchruns_sigterm_while_saving, 2, tmp_path,
                                                        str(tmp_path / "marker"))[0]
    assert (lost, signal_name, saved) == ([1], "SIGTERM", "saved")  # the signal only set the flag
    assert handler_after == signal.SIG_DFL  # and the handlers are put back afterwards

