"""Sharded checkpoints: a folder (`last/`, `best/`, `step-N/`) where every rank writes its own shards.

The model's and optimizer's states go through torch.distributed.checkpoint (DCP):
each rank writes the shards it holds (a replicated tensor, under ddp, is written
once, by one rank), in parallel; the rest of the checkpoint, small and the same
on every rank (progress, config, scheduler, scaler, callbacks, RNG), is rank 0's
STATE_FILE beside them. A save is written into `<name>.tmp/`, a folder made by
safe_files, and renamed into place only once DCP's `.metadata` (written last,
after every rank's shards) and STATE_FILE are there: a folder under its real
name is complete. A folder saved at N processes loads at any M: DCP reshards.

    python -m multigpu.export CKPT_DIR OUT.pt

turns one into a one-file checkpoint (multigpu/export.py).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch.distributed as dist

from multigpu import faults, safe_files
from multigpu.checkpoint import CheckpointError, check_complete, is_sharded, load

# DCP warns at every save and load of one process without a process group (also in its background thread):
# that is how this project runs on one device, so the warning says nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

SHARDED = ("model", "optimizer")  # the states each rank writes its own shards of; the rest is rank 0's STATE_FILE


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported at its first use: importing it costs about half as much again as
    torch itself (0.7 s here), which a run that writes no sharded checkpoint must not pay at every start."""
    import torch.distributed.checkpoint as dcp
    return dcp


def temporary_folder(path: str) -> str:
    """Where the save of `path` is written until it is complete."""
    return path + safe_files.TMP_SUFFIX


def start_save(stateful: dict[str, Any], folder: str, background: Optional["AsyncSaves"] = None,
               die_midway: bool = False) -> Optional[Future]:
    """Every rank writes its shards of `stateful`'s SHARDED things into `folder` (made by the caller) and
    returns None when they and `.metadata` are written; with `background`, the writing goes on in a thread
    after a CPU copy is staged, and the returned Future ends when they are. `die_midway` (test-only, the
    fault injector): this process is SIGKILLed once its shard files are written, before `.metadata`."""
    shards = {name: stateful[name].as_shards() for name in SHARDED}
    # DCP's file system writer writes the shard files itself, only inside `folder`, the temporary folder that
    # safe_files.make_folder made (the exemption named in tests/test_safe_files.py).
    dcp = _dcp()
    writer = (_dying_writer(folder) if die_midway else dcp.FileSystemWriter(folder))
    no_dist = not dist.is_initialized()
    if background is None:
        dcp.save(shards, storage_writer=writer, no_dist=no_dist)
        return None
    return dcp.async_save(shards, storage_writer=writer, process_group=background.process_group(), no_dist=no_dist)


def _dying_writer(folder: str) -> Any:
    """Test-only: DCP's writer that SIGKILLs its process once its shard files are written (a save killed in
    the middle: no `.metadata`, no rename)."""

    class DyingWriter(_dcp().FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            written.wait()
            faults.kill_self()
            return written  # not reached

    return DyingWriter(folder)




def load_shards(stateful: dict[str, Any], path: str) -> None:
    """Load the SHARDED things of `stateful` from the complete folder `path`, each rank reading what it holds
    (at any world size). A folder that does not fit this model or optimizer raises the error that says why."""
    check_complete(path)
    _dcp().load({name: stateful[name].as_shards() for name in SHARDED}, checkpoint_id=path,
             no_dist=not dist.is_initialized())


def load_whole(path: str, keys: tuple[str, ...] = SHARDED) -> dict[str, Any]:
    """The checkpoint at `path` as one process reads it: a file's state, or a complete sharded folder's
    STATE_FILE keys plus the whole tensors of `keys` (no process group needed: export and prediction)."""
    state = load(path)
    if not is_sharded(path):
        return state
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    whole: dict[str, Any] = {}
    try:
        _load_state_dict(whole, storage_reader=_dcp().FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(keys=list(keys)), no_dist=True)
    except (Exception, CheckpointException) as error:  # a shard cut short or missing
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        raise CheckpointError(f"checkpoint {path} refused: its shards cannot be read ({lines[-1][:200]})") from None
    return {**state, **{key: whole[key] for key in keys if key in whole}}


class AsyncSaves:
    """The save still being written in the background, at most one: the next save (and the run's end) waits
    for it, then `finish` puts it in place."""

    def __init__(self) -> None:
        self.pending: Optional[tuple[Future, Callable[[], None]]] = None
        self.group: Optional[Any] = None  # a gloo group of its own: DCP's collectives run beside training's

    def process_group(self) -> Any:
        """The process group the background saves use (made once; every rank must call this alike)."""
        if self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
        return self.group

    def wait(self) -> float:
        """Wait for the save in flight and put it in place; the seconds spent waiting."""
        if self.pending is None:
            return 0.0
        started = time.perf_counter()
        future, finish = self.pending
        self.pending = None
        future.result()
        finish()
        return time.perf_counter() - started

