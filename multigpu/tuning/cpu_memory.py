"""Freed CPU memory kept for the next step, when training on the CPU (docs/speed.md, "Speed").

On the CPU a step's activations and gradients are allocated and freed by the C library's malloc, every step.
glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised to the largest block freed,
up to 32 MiB) with a mapping of its own, unmapped when freed, and gives free memory at the top of its heap back
to the kernel once there is more than its trim threshold (128 KiB at first, then twice the mmap threshold).
Either way the next step gets fresh pages, which the kernel faults in and zeroes 4 KiB at a time. Measured on
the 2-core AMD EPYC, 64 steps of the peers cnn (one process, one thread): 220,000 to 590,000 page faults and
0.4 to 1.1 s in the kernel, in a run of about 3.3 s; with both thresholds raised, 15,000 to 18,000 faults,
0.02 to 0.06 s, and about 2.6 s. The number varied from run to run with the heap's layout, which is why the
same loop ran fast in one process and slow in the next.

CUDA's caching allocator exists for the same reason. `kept_for_the_next_step` raises both thresholds for
training: malloc keeps what a step frees and hands it to the next, so the process holds its peak memory while
it trains (as it does on a GPU). On leaving, both thresholds go back to glibc's starting values and
`malloc_trim` gives back what is free. Blocks above 32 MiB (the most that older glibc accepts as a threshold)
are still mapped afresh each time. Nothing is computed differently: only where tensors live in memory changes.
Other C libraries (musl, macOS), and a malloc tuned through glibc's environment variables, are left as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
NEVER_TRIM = -1  # mallopt(M_TRIM_THRESHOLD, -1) turns trimming off (mallopt(3))
LARGEST_MMAP_THRESHOLD = 32 * 1024 * 1024  # the most older glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
STARTING_THRESHOLD = 128 * 1024  # both thresholds' value when a process starts (mallopt(3))


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)  # the process's own C library, the one torch's CPU allocator calls
    except OSError:
        return None


def tuned_by_the_user() -> bool:
    """Whether malloc was tuned for this process through glibc's environment variables: then it is left alone."""
    return any(
        name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
    ) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Raise glibc malloc's thresholds so freed memory stays with the process; False where the C library is not
    glibc, malloc was tuned by the user, or glibc refused."""
    libc = _glibc()
    return bool(
        libc is not None
        and not tuned_by_the_user()
        and libc.mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)
        and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    )


def give_back_free_memory() -> None:
    """Put both thresholds back to glibc's starting values and return the free memory malloc holds to the kernel.
    glibc has no way back to its adaptive thresholds: from here on they stay at 128 KiB, which gives memory back
    at least as readily."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, STARTING_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, STARTING_THRESHOLD)
        libc.malloc_trim(ctypes.c_size_t(0))


@contextlib.contextmanager
def kept_for_the_next_step(enabled: bool) -> Iterator[None]:
    """Within the block, memory a step frees stays with the process for the next step (`enabled`: training on
    the CPU with --cache-cpu-memory); on leaving, malloc gives memory back again, and what is free now goes back
    to the kernel."""
    if not (enabled and keep_freed_memory()):
        yield
        return
    try:
        yield
    finally:
        give_back_free_memory()
