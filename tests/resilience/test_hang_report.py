"""What the hang report says of each rank (multigpu/resilience/hang_report.py), from heartbeats as the watchdogs
publish them (multigpu/resilience/heartbeat.py)."""

from __future__ import annotations

from multigpu.resilience import heartbeat
from multigpu.resilience.hang_report import diagnose, headline


def published(step: int, phase: str) -> dict:
    """A heartbeat as a rank's watchdog thread publishes it, at `step` in `phase`."""
    beat = heartbeat.Heartbeat()
    beat.step = step
    beat.phase = phase
    return {**beat.snapshot(group_seq=2 * step), "beat": 1}


def test_a_rank_silent_since_before_the_steps_it_took_with_the_others_is_not_placed_at_its_stale_heartbeat():
    """10 fast lock-step steps within one publishing interval, then rank 1 is stopped: its last heartbeat still
    says start-up, while rank 0, waiting for it in step 11's all-reduce, shows that it completed step 10."""
    beats = {0: published(10, heartbeat.BACKWARD), 1: published(0, heartbeat.STARTING)}
    verdict = diagnose(beats, silent=[1], timeout=3.0, world_size=2)
    said = verdict["stuck"][1]
    assert said.startswith("does not respond (stopped, frozen or dead); it completed step 10 with the others")
    assert (
        "last heard at step 0" not in said and "(its last heartbeat, older, said step 0 in start-up)" in said
    )
    assert headline(verdict).endswith("near step 10: rank 1 does not respond (stopped, frozen or dead)")
    # a heartbeat as recent as the others' steps is the rank's place
    beats = {0: published(10, heartbeat.BACKWARD), 1: published(10, heartbeat.DATA)}
    said = diagnose(beats, silent=[1], timeout=3.0, world_size=2)["stuck"][1]
    assert said == "does not respond (stopped, frozen or dead); last heard at step 10 in data loading"
