"""Device slots: GPUs cut into runs of --gpus-per-run, CPU slots, and what a dead worker's exit means."""

from __future__ import annotations

import pytest

from multigpu.errors import UsageError
from multigpu.sweep.options import parse
from multigpu.sweep.scheduler import describe_exit, find_slots


def slots_of(argv, gpus):
    options, _ = parse(argv, environ={})
    return find_slots(options, gpus)


def test_gpus_are_cut_into_slots_of_gpus_per_run():
    slots, line = slots_of(["--gpus-per-run", "2"], ["0", "1", "2", "3"])
    assert [slot.devices for slot in slots] == ["0,1", "2,3"]  # each worker's CUDA_VISIBLE_DEVICES
    assert line == "2 GPU slot(s) x 2 GPU(s)"
    slots, line = slots_of(["--max-gpus", "3", "--gpus-per-run", "2"], ["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    assert [slot.devices for slot in slots] == ["GPU-a,GPU-b"] and "1 GPU(s) left idle" in line


def test_without_gpus_the_slots_are_cpu_workers():
    slots, line = slots_of([], [])
    assert [(slot.devices, slot.label) for slot in slots] == [("", "cpu0"), ("", "cpu1")]
    slots, line = slots_of(["--workers", "3", "--max-gpus", "4"], [])
    assert len(slots) == 3 and "no GPU found, so --max-gpus 4 is not used" in line


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max-gpus", "5"], r"--max-gpus 5: only 4 GPU\(s\) visible"),
        (["--max-gpus", "1", "--gpus-per-run", "2"], "needs at least"),
    ],
)
def test_impossible_gpu_requests_are_refused(argv, expected):
    with pytest.raises(UsageError, match=expected):
        slots_of(argv, ["0", "1", "2", "3"])


def test_a_dead_workers_exit_is_named():
    assert describe_exit(-9) == "killed by SIGKILL (out of memory, or killed from outside)"
    assert describe_exit(-11) == "killed by SIGSEGV (a crash)"
    assert describe_exit(3) == "exited with status 3 without reporting"
