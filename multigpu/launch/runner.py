"""One training run, from a TrainConfig or a command line: devices, data, model, the trainer, and how the
run ends as an exit status.

main_multi_gpu.py (the command line), the sweep's workers and its torchrun children all train through
here, so the package never imports an entry script.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable

import torch

from multigpu.checkpoints import run_folders
from multigpu.config import TrainConfig, parse_config
from multigpu.data import build_datasets
from multigpu.errors import TrainingStopped, UsageError
from multigpu.launch import console
from multigpu.models import build_model, fresh_weights_note
from multigpu.parallel import lora
from multigpu.parallel.distributed import Runtime, gather_objects, is_distributed, setup, teardown
from multigpu.resilience.preemption import PeerLost, agent_store, error_detail, is_peer_failure, restart_count
from multigpu.tuning.gc_pauses import skip_the_collection_at_exit
from train_multi_gpu import MultiGPUTrainer


def run(config: TrainConfig, callbacks: Sequence[Any] = ()) -> dict:
    """Set up devices, data and model, train with `callbacks` (multigpu/loop/callbacks.py) beside the flags' own,
    and return the final metrics."""
    group_before = is_distributed()  # Ray's (multigpu/launch/ray_train.py): joined here, ended by its maker
    runtime = setup(config)  # --float8 is refused there, before any data is read, where the device has none
    try:
        return _train(config, runtime, callbacks)
    finally:
        # After _train returned, so the trainer and its DDP wrapper (which hold the process group)
        # are gone first: a group still referenced at interpreter exit can abort the process.
        if not group_before:
            teardown()


def _train(config: TrainConfig, runtime: Runtime, callbacks: Sequence[Any]) -> dict:
    # A resume of a LoRA run without the LoRA flags: the base is loaded as the checkpoint's run loaded it (4-bit).
    config = run_folders.resumed_settings(config)
    # Rank 0 downloads (if asked) while the others wait, then they read its files. Its refusal (no files
    # there, say) reaches them through that wait, so they stop with it quietly instead of losing rank 0.
    refusal = None
    if runtime.is_main:
        try:
            data = build_datasets(config, download_allowed=True)
        except UsageError as error:
            refusal = error
    said = gather_objects(None if refusal is None else str(refusal))[0]  # rank 0's refusal, on every rank
    if refusal is not None:
        raise refusal
    if said is not None:
        raise UsageError(said)  # the same verdict: rank 0 says it (main_guarded)
    if not runtime.is_main:
        data = build_datasets(config, download_allowed=False)
    torch.manual_seed(config.seed)  # the same initial weights on every rank and every rerun
    model = build_model(config.model_name, data.input_shape, data.num_classes, config)
    if runtime.is_main:
        print(
            f"model {config.model_name} ({lora.parameter_count(model):,} parameters{fresh_weights_note(model)}); "
            f"data {config.dataset}: {_samples(data.train)} train / {_samples(data.val)} val samples",
            flush=True,
        )
        for line in [*data.notes, *data.warnings]:
            print(line, flush=True)
    trainer = MultiGPUTrainer(
        model, data.train, data.val, config, runtime=runtime, collate_fn=data.collate_fn, callbacks=callbacks
    )
    return trainer.evaluate_saved() if config.eval_only else trainer.fit()


def train_from_argv(
    argv: Sequence[str] | None,
    on_summary: Callable[[dict], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> int:
    """Train on main_multi_gpu.py's training flags and return the exit status (see `main_guarded`).

    `on_summary` receives the final metrics of a finished run; `callbacks` are the trainer's (run).
    """

    def train(args: Sequence[str] | None) -> None:
        summary = run(parse_config(args), callbacks)
        if on_summary is not None:
            on_summary(summary)

    return main_guarded(train, argv)


def _samples(dataset: Any) -> str:
    """A data set's size in words: no set (--dataset hf without --val-files), or a stream of unknown length."""
    if dataset is None:
        return "no"
    try:
        return str(len(dataset))
    except TypeError:
        return "a stream of"


def main_guarded(train: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> int:
    """Run `train(argv)` and turn how it ends into an exit status: 0 done (or stopped cleanly by a signal),
    1 training failed, 2 bad input, each with one line and no traceback. Scripts of your own
    (examples/) use it too. The console is best-effort meanwhile (multigpu/launch/console.py)."""
    skip_the_collection_at_exit()  # a second less per process at exit: nothing is left to collect then
    with console.best_effort():
        return _exit_status(train, argv)


def _exit_status(train: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        train(argv)
    except PeerLost as error:
        return error.exit_code  # every survivor has already said which rank it lost
    except (UsageError, TrainingStopped) as error:
        # An error that one rank met alone (a data file its loader read mid-epoch) is said by that rank; one that
        # every rank reaches (the decisions are all-reduced, or every rank checks the same flags) is said once.
        if error.agreed:
            say_once(str(error), rank)
        else:
            print(f"error: {'' if rank == 0 else f'rank {rank}: '}{error}", file=sys.stderr, flush=True)
        return error.exit_code
    except PermissionError as error:
        # What no check named already (the current folder when it is not writable, say): the path, in one line.
        path = os.path.abspath(error.filename) if error.filename else str(error)
        print(
            f"error: {'' if rank == 0 else f'rank {rank}: '}cannot use {path}: permission denied; give this user "
            f"access to it, or use another path",
            file=sys.stderr,
            flush=True,
        )
        return UsageError.exit_code
    except KeyboardInterrupt:
        # Training turns Ctrl-C into a checkpoint and exit 0; this one came before or after training.
        if rank == 0:
            print(
                "interrupted outside training: the interrupt wrote no checkpoint", file=sys.stderr, flush=True
            )
        return 130
    except BaseException as error:
        if is_peer_failure(error) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # A rank died or hung outside training (set-up, a barrier): the group is gone, no rank can be named.
            print(
                f"rank {rank}: lost contact with another rank, which died or hung ({error_detail(error)}); "
                f"stopping",
                file=sys.stderr,
                flush=True,
            )
            return TrainingStopped.exit_code
        if rank != 0:
            print(f"rank {rank} failed:", file=sys.stderr, flush=True)
        raise
    return 0


SAID_WAIT_SECONDS = (
    30.0  # for the rank that says the line to print it: milliseconds, unless it died meanwhile
)


def say_once(error: str, rank: int) -> None:
    """Print a verdict that every rank reaches, `error: <error>` on stderr, once for the whole run.

    torchrun ends every worker as soon as one exits with an error, so rank 0, left to say it, was often ended
    before it had: no line at all. Under torchrun the first rank here claims the line in torchrun's store and
    prints it; the others wait until it has, so the ones that exit first never cut it off. Without torchrun's
    store (one process, or ranks started by hand, which nothing ends early) rank 0 says it.
    """
    store = _torchruns_store()
    try:
        if store is not None and not _claimed(store):
            return  # the rank that claimed the line has printed it
    except RuntimeError:  # the store went away (torchrun with it), or the claimer died before printing
        print(f"error: rank {rank}: {error}", file=sys.stderr, flush=True)
        return
    if store is not None or rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    if store is not None:
        with contextlib.suppress(
            RuntimeError
        ):  # a store gone now: the others, ended by torchrun, wait no more
            store.set(_said_key() + "/said", "1")


def _claimed(store: Any) -> bool:
    """Whether this rank is the first to claim the line in `store`; the others return once it is printed."""
    key = _said_key()
    if store.add(key, 1) == 1:
        return True
    store.wait([key + "/said"], timedelta(seconds=SAID_WAIT_SECONDS))
    return False


def _said_key() -> str:
    return f"multigpu/said-once/attempt-{restart_count()}"  # a torchrun restart's verdict is said again


def _torchruns_store() -> Any | None:
    """torchrun's store, where several of its workers may end the run; None in one process, without torchrun's
    store, or when it cannot be reached (torchrun is going away too)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    try:
        return agent_store(timedelta(seconds=SAID_WAIT_SECONDS))
    except RuntimeError:
        return None
