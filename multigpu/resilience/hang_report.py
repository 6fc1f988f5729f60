"""What the hang watchdog says: the diagnosis of every rank's heartbeat, the summary lines,
<save-dir>/hang_report.txt, and NCCL's flight recorder.

multigpu/resilience/watchdog.py decides when; this module decides what (docs/hangs.md, "When a run hangs").
The checkpoint of the last completed step is the trainer's to write (multigpu/engine/state.py, save_from_replica):
the watchdog is handed a function that writes it.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from multigpu import safe_files
from multigpu.resilience.heartbeat import BACKWARD, BEAT, FORWARD, LIBRARIES

FILE_NAME = "hang_report.txt"
NCCL_TRACE_PREFIX = "nccl_trace_rank_"  # + rank: where NCCL's flight recorder dumps, in the save-dir
NO_SAVE_OFF_RANK_0 = "no checkpoint written: rank 0, which writes checkpoints, does not respond"
SILENT = "does not respond (stopped, frozen or dead)"
TRAINER_STEP = os.path.join(
    "multigpu", "loop", "step.py"
)  # where forward and backward run: FSDP's collectives come from here


def where_waiting(beat: dict[str, Any], ddp: bool = True) -> str | None:
    """The collective this rank's main thread waits in, in words, or None when it is not in one (`ddp`: backward
    runs DDP's gradient all-reduce)."""
    shape = "x".join(map(str, beat["shape"])) or "-"
    if beat["in_collective"]:
        return f"{beat['op']} #{beat['seq']} of the trainer (shape {shape}, {beat['dtype']})"
    if "distributed_c10d.py" in beat["where"]:  # torch.distributed called outside the trainer's helpers
        operation = beat["where"].rsplit(" in ", 1)[-1]
        if beat["phase"] in (FORWARD, BACKWARD) and TRAINER_STEP in beat["code"]:
            # No user code between the trainer's step and torch: FSDP's hooks issued it (an all-gather, a
            # reduce-scatter, or on a hybrid mesh the gradient all-reduce across the replicas).
            return f"FSDP's torch.distributed.{operation} ({beat['phase']})"
        return (
            f"torch.distributed.{operation} called in {beat['phase']} at {beat['code']} "
            f"(not one of the trainer's)"
        )
    if beat["phase"] == BACKWARD and ddp:
        return "DDP's gradient all-reduce (backward)"
    return None


def failed_collective(error: BaseException, peers: str) -> str:
    """The collective a failed call was in, in words, from the error's traceback and this rank's heartbeat.

    A collective that is not the trainer's (the user's own torch.distributed call) is the usual desync: one rank
    took a branch the others did not. On gloo the peer that receives the unexpected data aborts at once ("Is
    there a distributed collective mismatch in your code?"), so this survivor's words are all that is left.
    """
    frames = traceback.extract_tb(error.__traceback__)
    c10d = [
        i
        for i, frame in enumerate(frames)
        if frame.filename.endswith(os.path.join("distributed", "distributed_c10d.py"))
    ]
    if c10d:
        first = c10d[0]
        callers = [frame for frame in frames[:first] if not frame.filename.startswith(LIBRARIES)]
        caller = callers[-1] if callers else frames[first]
        if not caller.filename.endswith(os.path.join("multigpu", "parallel", "distributed.py")):
            return (
                f"torch.distributed.{frames[first].name} called at {caller.filename}:{caller.lineno} in "
                f"{caller.name}, not one of the trainer's collectives: if {peers} did not call it too, the ranks "
                f"desynchronised (a desync; --debug-collectives checks every collective)"
            )
    if BEAT.in_collective:
        return f"{BEAT.op} #{BEAT.seq} of the trainer (shape {'x'.join(map(str, BEAT.shape)) or '-'}, {BEAT.dtype})"
    if BEAT.phase == BACKWARD:
        return "DDP's gradient all-reduce (backward)"
    return f"a collective during {BEAT.phase}"


def rank_name(rank: int, mesh: tuple[int, int] | None = None) -> str:
    """ "rank 3", or on fsdp's hybrid mesh (replicate, shard) "rank 3 (mesh replicate 1, shard 1)": the replica and
    the place in its shard group, which tell a stuck node from a stuck process."""
    if mesh is None:
        return f"rank {rank}"
    replicate, shard = divmod(rank, mesh[1])
    return f"rank {rank} (mesh replicate {replicate}, shard {shard})"


def diagnose(
    beats: dict[int, dict[str, Any]],
    silent: list[int],
    timeout: float,
    world_size: int,
    mesh: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Which ranks are stuck and where, which wait in which collective, and whether the ranks desynchronised
    (different collective counts of the process group, or different collectives at the same one); `mesh`: the
    hybrid mesh's shape, whose coordinates the report gives beside each rank."""
    stuck, waiting, ddp = {}, {}, world_size > 1
    stuck.update({rank: f"{SILENT}; it never published a heartbeat" for rank in silent if rank not in beats})
    # The steps the responding ranks completed: every rank takes part in every step, the silent ones too.
    together = max((beat["step"] for rank, beat in beats.items() if rank not in silent), default=0)
    for rank, beat in sorted(beats.items()):
        waits = where_waiting(beat, ddp)
        if rank in silent:
            stuck[rank] = f"{SILENT}; {_last_heard(beat, together)}"
        elif waits is None:
            stuck[rank] = f"stuck in {beat['phase']} at step {beat['step']}, at {beat['code']}"
        else:
            waiting[rank] = (
                f"waits in {waits} at step {beat['step']}, collective #{beat['group_seq']} of the group"
            )
    live_waiting = {rank: beats[rank] for rank in waiting}
    desync = None
    counts = {rank: beat["group_seq"] for rank, beat in live_waiting.items()}
    kinds = {rank: where_waiting(beat, ddp) for rank, beat in live_waiting.items()}
    if len(set(counts.values())) > 1:
        desync = "ranks wait at different collectives of the group: " + ", ".join(
            f"rank {rank} at #{count}" for rank, count in counts.items()
        )
    elif len(set(kinds.values())) > 1:
        desync = "ranks wait in different collectives: " + "; ".join(
            f"rank {rank} in {kind}" for rank, kind in kinds.items()
        )
    step = max((beat["step"] for beat in beats.values()), default=0)
    return {
        "stuck": dict(sorted(stuck.items())),
        "waiting": waiting,
        "desync": desync,
        "timeout": timeout,
        "step": step,
        "mesh": mesh,
    }


def _last_heard(beat: dict[str, Any], together: int) -> str:
    """Where a silent rank was last: its last heartbeat, or, when that is older than the `together` steps it took
    with the others (it went silent within a publishing interval of fast steps), those steps."""
    heard = f"step {beat['step']} in {beat['phase']}"
    if beat["step"] >= together:
        return f"last heard at {heard}"
    return (
        f"it completed step {together} with the others and went silent after it (its last heartbeat, older, "
        f"said {heard})"
    )


def headline(verdict: dict[str, Any]) -> str:
    """The first line: no rank advanced, and the cause in a few words."""
    cause = (
        f"desync: {verdict['desync']}"
        if verdict["desync"]
        else "; ".join(
            f"{rank_name(rank, verdict.get('mesh'))} {why.split(';')[0].split(', at ')[0]}"
            for rank, why in verdict["stuck"].items()
        )
        or "every rank waits in a collective that does not complete (network or backend)"
    )
    return f"hang: no rank advanced for {verdict['timeout']:g} s (--hang-timeout), near step {verdict['step']}: {cause}"


def summary(verdict: dict[str, Any], saved: str, path: str, exit_status: int) -> list[str]:
    """The few lines printed on the deciding rank and put at the top of the report."""
    return [
        headline(verdict),
        *(
            f"hang: {rank_name(rank, verdict.get('mesh'))} {why}"
            for rank, why in {**verdict["stuck"], **verdict["waiting"]}.items()
        ),
        f"hang: {saved}",
        f"hang: every rank's stack in {path}; stopping with exit status {exit_status}",
    ]


def write(
    path: str,
    lines: list[str],
    beats: dict[int, dict[str, Any]],
    stacks: dict[int, str],
    backend: str | None,
    save_dir: str,
    world_size: int,
) -> None:
    """<save-dir>/hang_report.txt: the summary, each rank's heartbeat, each rank's main-thread stack."""
    parts = [
        f'# hang report written {time.strftime("%Y-%m-%d %H:%M:%S")} (docs/hangs.md, "When a run hangs")',
        *lines,
        "",
        "## heartbeats (the last each rank published)",
    ]
    for rank, beat in sorted(beats.items()):
        parts.append(
            f"rank {rank} (host {beat['host']}, pid {beat['pid']}): step {beat['step']}, phase {beat['phase']}, "
            f"last trainer collective {beat['op'] or '-'} #{beat['seq']} "
            f"{'(inside it)' if beat['in_collective'] else '(returned)'}, "
            f"group collectives issued {beat['group_seq']}, main thread at {beat['code']}"
        )
    parts += ["", "## main-thread stacks (innermost call last)"]
    for rank in range(world_size):
        parts += [f"--- rank {rank}", stacks.get(rank, f"(no answer: rank {rank} {SILENT})\n").rstrip()]
    if backend == "nccl":
        parts += [
            "",
            f"## NCCL flight recorder: {os.path.join(save_dir, NCCL_TRACE_PREFIX)}<rank> (analyse with "
            f"python -m torch.distributed.flight_recorder.fr_trace {save_dir} -p {NCCL_TRACE_PREFIX})",
        ]
    safe_files.write_atomically(path, "\n".join(parts) + "\n")


def nccl_flight_recorder_env(save_dir: str) -> None:
    """Turn NCCL's flight recorder on (unless the user set it), dumping into the save-dir on a timeout.
    Read when the NCCL process group is created, so call this before init_process_group."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    prefix = os.path.join(os.path.abspath(save_dir), NCCL_TRACE_PREFIX)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", prefix)
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)  # its name before torch 2.9


def dump_nccl_trace(backend: str | None, save_dir: str, rank: int) -> None:
    """On NCCL, write this rank's flight-recorder buffer into the save-dir now: the watchdog acts before
    NCCL's own timeout would dump it."""
    if backend != "nccl":
        return
    try:
        import torch

        trace = torch._C._distributed_c10d._dump_nccl_trace()  # type: ignore[attr-defined]  # NCCL builds only
        with open(os.path.join(save_dir, f"{NCCL_TRACE_PREFIX}{rank}"), "wb") as dump:
            dump.write(trace)
    except Exception:  # a torch without it: NCCL's own dump on timeout still comes
        pass
