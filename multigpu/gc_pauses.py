"""Short garbage-collector pauses while training.

Python's collector runs when enough new objects have been made, and its full
collections walk every object alive: with torch and TensorBoard loaded that is
some 300,000 objects, tens of milliseconds, on one rank while the others wait
for it at the next all-reduce. What is alive when training starts (the model,
the optimizer, the libraries) lives for the whole run anyway, so it is frozen
(`gc.freeze()`): collections during training look only at the objects training
makes. On benchmarks/step_overhead.py's tiny model this took the trainer's cost
over a plain loop from 61 to 38 us per step, in one in-process comparison
(MULTI_GPU_GUIDE.md, "Speed").
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


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
