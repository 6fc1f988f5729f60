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

turns one into a one-file checkpoint (multigpu/checkpoints/export.py).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist

from multigpu import safe_files
from multigpu.checkpoints.checkpoint import is_sharded, load, load_failure
from multigpu.checkpoints.dcp_metadata import check_complete
from multigpu.errors import CheckpointError
from multigpu.parallel.distributed import gather_objects
from multigpu.resilience import faults

# DCP warns at every save and load of one process without a process group (also in its background thread):
# that is how this project runs on one device, so the warning says nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

SHARDED = (
    "model",
    "optimizer",
)  # the states each rank writes its own shards of; the rest is rank 0's STATE_FILE


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported at its first use: importing it costs about half as much again as
    torch itself (0.7 s here), which a run that writes no sharded checkpoint must not pay at every start."""
    import torch.distributed.checkpoint as dcp

    return dcp


def temporary_folder(path: str) -> str:
    """Where the save of `path` is written until it is complete."""
    return path + safe_files.TMP_SUFFIX


def start_save(
    stateful: dict[str, Any], folder: str, background: AsyncSaves | None = None, die_midway: bool = False
) -> Future | None:
    """Every rank writes its shards of `stateful`'s SHARDED things into `folder` (made by the caller) and
    returns None when they and `.metadata` are written; with `background`, the writing goes on in a thread
    after a CPU copy is staged, and the returned Future ends when they are. `die_midway` (test-only, the
    fault injector): this process is SIGKILLed once its shard files are written, before `.metadata`."""
    shards = {name: stateful[name].as_shards() for name in SHARDED}
    # DCP's file system writer writes the shard files itself, only inside `folder`, the temporary folder that
    # safe_files.make_folder made (the exemption named in tests/test_safe_files.py).
    dcp = _dcp()
    writer = _dying_writer(folder) if die_midway else dcp.FileSystemWriter(folder)
    no_dist = not dist.is_initialized()
    if background is None:
        dcp.save(shards, storage_writer=writer, no_dist=no_dist)
        return None
    return dcp.async_save(
        shards, storage_writer=writer, process_group=background.process_group(), no_dist=no_dist
    )


def _dying_writer(folder: str) -> Any:
    """Test-only: DCP's writer that SIGKILLs its process once its shard files are written (a save killed in
    the middle: no `.metadata`, no rename)."""

    class DyingWriter(_dcp().FileSystemWriter):  # type: ignore[misc]  # DCP is imported when first used
        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            written.wait()
            faults.kill_self()
            return written  # not reached

    return DyingWriter(folder)


def load_shards(stateful: dict[str, Any], path: str) -> None:
    """Load the SHARDED things of `stateful` from the complete folder `path`, each rank reading what it holds
    (at any world size). A folder that is damaged, holds anything but data, or does not fit this model or
    optimizer is a CheckpointError on every rank, before DCP reads a byte of it (docs/checkpoints.md, "Sharded
    checkpoints: every rank writes its own shards")."""
    shards = {name: stateful[name].as_shards() for name in SHARDED}
    states, refusal = {name: thing.state_dict() for name, thing in shards.items()}, None
    try:
        metadata = check_complete(path)
        misfit = _misfit(states, metadata)
        if misfit:
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {misfit}")
    except CheckpointError as error:
        refusal = str(error)
    refusal = next(
        filter(None, gather_objects(refusal)), None
    )  # a rank that refuses must not leave others in DCP
    if refusal:
        raise CheckpointError(refusal)
    _read(
        path,
        lambda: _dcp().load(
            states,
            storage_reader=_verified_reader(path, metadata),
            planner=_data_only_planner(path),
            no_dist=not dist.is_initialized(),
        ),
    )
    for (
        name,
        thing,
    ) in shards.items():  # what dcp.load does for a stateful thing, with the states checked above
        thing.load_state_dict(states[name])


def load_entries(states: dict[str, Any], path: str) -> None:
    """DCP's load of the entries of `states` (any part of what the folder `path` holds: --init-from reads the
    model's) from the complete folder `path`, each rank reading what it holds, through the same safe reading
    and checks as a resume."""
    metadata = check_complete(path)
    _read(
        path,
        lambda: _dcp().load(
            states,
            storage_reader=_verified_reader(path, metadata),
            planner=_data_only_planner(path),
            no_dist=not dist.is_initialized(),
        ),
    )


def _misfit(states: dict[str, Any], metadata: Any) -> str | None:
    """Which value of the live `states` the checkpoint's `metadata` lacks or gives another shape, in words (None
    when each is there, in its shape): DCP's own checks (default_planner.create_default_local_load_plan) raise
    on the first one, every rank with its traceback."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(states)
    missing = [key for key in flat if key not in saved]
    if missing:
        return f"{missing[0]} is not in it{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}"
    differ = [
        f"{key} is {list(saved[key].size)} in it, {list(value.size())} here"
        for key, value in flat.items()
        if torch.is_tensor(value)
        and isinstance(saved[key], TensorStorageMetadata)
        and saved[key].size != value.size()
    ]
    return f"{differ[0]}{f' ({len(differ) - 1} more differ)' if len(differ) > 1 else ''}" if differ else None


def _verified_reader(path: str, metadata: Any) -> Any:
    """DCP's file system reader of `path` that hands DCP `metadata`, already read safely and checked, in
    place of unpickling `.metadata` (or a rank's own `__N.metadata`) itself."""

    class VerifiedReader(_dcp().FileSystemReader):  # type: ignore[misc]  # DCP is imported when first used
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # what DCP's read_metadata adds
            return metadata

    return VerifiedReader(path)


def _data_only_planner(path: str, keys: list[str] | None = None) -> Any:
    """DCP's load planner (with `keys`: the one that rebuilds those values whole, with no model to load into)
    reading the shard files' values that are not tensors (the optimizer's settings) with weights_only=True:
    DCP's own unpickles them as they are, so a shard file could run code."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    base = DefaultLoadPlanner if keys is None else _EmptyStateDictLoadPlanner

    class DataOnlyPlanner(base):  # type: ignore[misc,valid-type]  # a base chosen at run time, by `keys`
        def load_bytes(
            self, read_item: Any, value: Any
        ) -> None:  # DefaultLoadPlanner.load_bytes, weights only
            name = read_item.dest_index.fqn
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", module="torch._weights_only_unpickler")
                    loaded = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as error:
                raise CheckpointError(
                    f"checkpoint {path} refused: its value {name} (in a shard file): {load_failure(error)}"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[name], loaded)
            else:
                self.state_dict[name] = loaded

    return DataOnlyPlanner() if keys is None else DataOnlyPlanner(keys=keys)


def _read(path: str, load: Callable[[], None]) -> None:
    """Run DCP's `load` of `path`; its failure, on any rank, is one CheckpointError: ours when it raised one,
    else the first failing rank's own last line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load()
    except CheckpointException as error:
        failures = [failure for _, (failure, _) in sorted(error.failures.items())]
        ours = [failure for failure in failures if isinstance(failure, CheckpointError)]
        if ours:
            raise CheckpointError(str(ours[0])) from None
        raise CheckpointError(
            f"checkpoint {path} refused: its shards cannot be read ({_last_line(failures[0])})"
        ) from None
    except CheckpointError:
        raise
    except Exception as error:  # without a process group DCP raises the failure itself
        raise CheckpointError(
            f"checkpoint {path} refused: its shards cannot be read ({_last_line(error)})"
        ) from None


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:200]


def load_whole(path: str, keys: tuple[str, ...] = SHARDED) -> dict[str, Any]:
    """The checkpoint at `path` as one process reads it: a file's state, or a complete sharded folder's
    STATE_FILE keys plus the whole tensors of `keys` (no process group needed: export and prediction)."""
    state = load(path)
    if not is_sharded(path):
        return state
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    metadata = check_complete(path)  # load() checked it: read once more, as safely, for DCP
    whole: dict[str, Any] = {}
    _read(
        path,
        lambda: _load_state_dict(
            whole,
            storage_reader=_verified_reader(path, metadata),
            planner=_data_only_planner(path, keys=list(keys)),
            no_dist=True,
        ),
    )
    return {**state, **{key: whole[key] for key in keys if key in whole}}


class AsyncSaves:
    """The save still being written in the background, at most one: the next save (and the run's end) waits
    for it, then `finish` puts it in place."""

    def __init__(self) -> None:
        self.pending: tuple[Future, Callable[[], None]] | None = None
        self.group: Any | None = None  # a gloo group of its own: DCP's collectives run beside training's

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
