"""Which checkpoints of a save-dir a resume tries, newest first (multigpu/checkpoints/run_folders.py)."""

from __future__ import annotations

import os
from pathlib import Path

from multigpu.checkpoints import run_folders


def written(path: Path, at: float) -> str:
    path.write_bytes(b"checkpoint")
    os.utime(path, (at, at))
    return str(path)


def test_newest_first_orders_by_write_time_then_last_then_step(tmp_path):
    step4 = written(tmp_path / "step-000000004.pt", 100.0)
    step8 = written(tmp_path / "step-000000008.pt", 200.0)
    last = written(tmp_path / "last.pt", 200.0)  # the same coarse mtime as step 8's: written after it
    assert run_folders.newest_first([step4, last, step8]) == [last, step8, step4]
    assert run_folders.resumable_files(str(tmp_path)) == [last, step8, step4]


def test_a_checkpoint_pruned_between_the_listing_and_its_date_is_left_out(tmp_path):
    """Replica groups share a save-dir: the leading group prunes an old step checkpoint while a restarted group
    lists them (a restarted group's FileNotFoundError ended it, found under a loaded machine)."""
    kept = written(tmp_path / "step-000000008.pt", 200.0)
    pruned = written(tmp_path / "step-000000004.pt", 100.0)
    listed = [pruned, kept]
    os.remove(pruned)
    assert run_folders.newest_first(listed) == [kept]
