"""The sweep dir's files: appends from several processes, torn lines, the fingerprint file, the shard lock."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import PYTHON, REPO
from multigpu.errors import UsageError
from multigpu.sweep import records

APPENDER = """
import sys
from multigpu.sweep.records import append_result
for i in range(300):
    append_result(sys.argv[1], {"experiment": f"{sys.argv[2]}-{i}", "finished": i, "padding": "x" * 500})
"""


def test_appends_from_several_processes_stay_whole_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    writers = [
        subprocess.Popen([PYTHON, "-c", APPENDER, str(path), name], cwd=REPO) for name in ("a", "b", "c")
    ]
    assert [writer.wait(timeout=60) for writer in writers] == [0, 0, 0]
    lines = path.read_text().splitlines()
    assert len(lines) == 900 and all(json.loads(line)["padding"] == "x" * 500 for line in lines)


def test_the_latest_record_wins_over_every_shard_and_a_torn_line_is_skipped(tmp_path):
    records.append_result(
        str(tmp_path / "results.shard-0-of-2.jsonl"), {"experiment": "e", "status": "failed", "finished": 1.0}
    )
    records.append_result(
        str(tmp_path / "results.shard-1-of-2.jsonl"), {"experiment": "e", "status": "ok", "finished": 2.0}
    )
    with open(tmp_path / "results.jsonl", "a") as file:
        file.write('{"experiment": "f", "status": "ok", "fini')  # a power cut mid-line
    latest = records.read_results(str(tmp_path))
    assert list(latest) == ["e"] and latest["e"]["status"] == "ok"


def test_the_fingerprint_is_written_once_and_compared_after(tmp_path):
    first = {"base": {"lr": 0.1}, "grid": {}, "gpus_per_run": 1, "threads_per_run": 1}
    assert records.check_fingerprint(str(tmp_path), first) is True
    assert records.check_fingerprint(str(tmp_path), first) is False
    with pytest.raises(UsageError, match=r"--lr 0.1 \(the sweep's\) vs 0.2 \(this command's\)"):
        records.check_fingerprint(str(tmp_path), {**first, "base": {"lr": 0.2}})
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]  # no temporary file left


def test_a_shard_runs_in_one_process_at_a_time(tmp_path):
    with records.exclusive(str(tmp_path), (1, 2)):
        with pytest.raises(UsageError, match=r"\(shard 1/2\) is in use by pid \d+"):
            with records.exclusive(str(tmp_path), (1, 2)):
                pass
        with records.exclusive(str(tmp_path), (0, 2)):  # another shard is free
            pass
    with records.exclusive(str(tmp_path), (1, 2)):  # released with its holder
        pass
