"""multigpu/launch/ray_output.py: the one line of a run Ray gave up on, from the failures Ray's poll of the
workers found. Which workers a poll finds is a race under a real Ray (tests/launch/test_ray_train.py takes
either outcome), so both outcomes are shown here on the exceptions Ray Train raises."""

from __future__ import annotations

import pytest

from multigpu.launch import ray_output

exceptions = pytest.importorskip("ray.train.v2.api.exceptions", reason="the [ray] extra is not installed")

# What Ray says of a worker whose process was killed (ActorDiedError's text), and what a worker raises when
# its run ended with a failure's exit status (ray_train.py's train_on_worker).
KILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker\n\tpid: 1613\n"
    "\tThe actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"
)
ENDED = f"rank 0 {ray_output.ENDED_WITH} 1"
RESUME = "python main_multi_gpu.py --ray-workers 2 --resume auto"
# The line's parts: its start, the killed worker in words, and its end with the resume command.
FAILED = "error: the run on Ray failed: "
KILLED_IN_WORDS = (
    "worker rank 1 (pid 1613) died: its process ended without an exit status of its own "
    "(SYSTEM_ERROR, killed by a signal or the OOM killer, or crashed)"
)
GAVE_UP = f"; Ray gave up on it (--ray-max-failures 0): continue from the newest checkpoint with: {RESUME}"


def line_for(failures: dict[int, Exception]) -> str:
    return ray_output.failure_line(exceptions.WorkerGroupError("failed", failures), 0, RESUME)


def test_the_killed_worker_takes_the_blame_and_a_rank_that_ended_after_it_is_named_as_such() -> None:
    line = line_for({0: RuntimeError(ENDED), 1: RuntimeError(KILLED)})
    assert line == FAILED + KILLED_IN_WORDS + " (rank 0 ended after it)" + GAVE_UP


def test_a_poll_that_found_only_the_killed_worker_names_only_it() -> None:
    assert line_for({1: RuntimeError(KILLED)}) == FAILED + KILLED_IN_WORDS + GAVE_UP


def test_workers_that_all_ended_with_a_status_are_each_named_with_it() -> None:
    line = line_for({0: RuntimeError(ENDED), 1: RuntimeError(f"rank 1 {ray_output.ENDED_WITH} 2")})
    assert (
        line
        == FAILED + "worker rank 0 ended with exit status 1; worker rank 1 ended with exit status 2" + GAVE_UP
    )
