"""Short garbage-collector pauses while training.

Python's collector runs when enough new objects have been made, and its full
collections walk every object alive: with torch and TensorBoard loaded that is
some 300,000 objects, tens of milliseconds, on one rank while the others wait
for it at the next all-reduce. What is alive when training starts (the model,
the optimizer, the libraries) lives for the whole run anyway, so it is frozen
(`gc.freeze()`): collections during training look only at the objects training
makes. On benchmarks/step_overhead.py's tiny model this took the trainer's cost
over a plain loop from 61 to 38 us per step, in one in-process comparison
(docs/speed.md, "Speed").

The same walk ends every process: the interpreter's last full collection,
after the atexit handlers, takes over a second once torch and torch._dynamo
(which the optimizers load) are imported. A command that trained has nothing
left for it to do, so it is skipped (`skip_the_collection_at_exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def long_lived_objects_frozen() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block, then give them back to the collector.

    A program that froze objects itself is left as it is: unfreezing would undo its freeze too.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the frozen objects become collectable again, the oldest generation's


_skipping_at_exit = False


def skip_the_collection_at_exit() -> None:
    """Freeze every object at exit, so the interpreter's final collection has nothing to walk: on a 2-core
    CPU a training run's end, after its last atexit handler, went from 1.5 s to 0.27 s (docs/speed.md,
    "Speed").

    Safe at that point: objects still die by reference counting as the interpreter clears its modules, and
    Python never promised to collect reference cycles at exit; what must reach disk is closed or flushed
    explicitly (the trainer closes its writer and checkpointer in `fit()`; logging and multiprocessing flush
    and join in atexit handlers of their own). Registered once, when a command starts: atexit runs
    last-in, first-out, so the freeze comes after the handlers of what is imported later and before those
    of what was imported already (torch, logging, multiprocessing), which a freeze does not hinder. Called
    from `main_guarded` inside a program of your own, it also applies when that program exits.
    """
    global _skipping_at_exit
    if not _skipping_at_exit:
        atexit.register(gc.freeze)
        _skipping_at_exit = True
