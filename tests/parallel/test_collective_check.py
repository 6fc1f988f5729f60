"""--debug-collectives on a real desync: 2 gloo processes, rank 0's model calls one all_reduce more than rank 1's.
Without the check gloo aborts rank 1 on the size mismatch ("gloo::EnforceNotMet"); with it, one line names it."""

from __future__ import annotations

from conftest import run_hang_scenario as scenario


def test_an_extra_all_reduce_on_rank_0_is_one_line_naming_the_ranks_the_calls_and_the_shape(tmp_path):
    ranks = scenario("extra-all-reduce", tmp_path, "--debug-collectives")
    assert [rank.returncode for rank in ranks] == [1, 1], ranks[1].stderr
    said = [line for rank in ranks for line in rank.stderr.splitlines() if "mismatch" in line]
    assert said == [
        line
        for line in ranks[1].stderr.splitlines()
        if line.startswith("error: rank 1: collective mismatch: ")
    ], said
    assert len(said) == 1
    assert "rank 1 calls DDP's gradient all-reduce of shape [68] float32" in said[0]
    assert (
        "rank 0 issued 1 collective(s) more and waits in torch.distributed.all_reduce called in forward"
        in said[0]
    )
    assert "hang_scenarios.py:" in said[0]
    assert not any("Traceback" in rank.stderr or "lost contact" in rank.stderr for rank in ranks)
