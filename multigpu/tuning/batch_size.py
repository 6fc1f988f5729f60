"""--batch-size auto: the largest per-device batch whose training step fits in GPU memory, found at start.

Each candidate runs one real step (forward, backward, optimizer step) on a
batch made from the data set's first samples. Every rank tries the same
candidate and the ranks agree, with one all-reduce, whether it fitted on all of
them, so they never disagree. The batch doubles until a step runs out of
memory, then bisection narrows the gap, and 10% is taken off the largest that
fitted, for memory that varies from step to step. Afterwards the model, the
optimizer and the RNG are restored exactly; the data order is untouched, since
the loader is not used (docs/speed.md, "Speed").
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable

import torch

from multigpu.config import FIELDS, TrainConfig
from multigpu.data.batches import repeat_batch, sample_batch
from multigpu.errors import TrainingStopped
from multigpu.loop.amp import Amp
from multigpu.loop.forward import ForwardFn, compute_loss
from multigpu.loop.optim import OptimizerArg, build_optimizer, users_optimizer
from multigpu.loop.snapshot import kept
from multigpu.parallel.distributed import Runtime, all_reduce_sum
from multigpu.parallel.wrapping import uncompiled

MARGIN = 0.10  # taken off the largest batch that fitted
FIRST_TRY = 16
PRECISION = 1 / 32  # bisection stops when the gap is this share of the batch (well inside the margin)
SAMPLES = 64  # distinct samples in a probe batch, repeated to its size
DEFAULT_BATCH_SIZE: int = FIELDS["batch_size"].default  # type: ignore[assignment]  # an int; used without CUDA


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA allocation failure (torch.cuda.OutOfMemoryError, or a RuntimeError saying "out of memory")."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error)
    )


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest batch in 1..limit for which `fits` says yes, assuming bigger batches need more memory:
    doubling from FIRST_TRY (halving if that fails), then bisection. 0 when not even 1 fits."""
    size = min(FIRST_TRY, limit)
    if fits(size):
        good, bad = size, None
        while bad is None and good < limit:
            size = min(2 * good, limit)
            good, bad = (size, None) if fits(size) else (good, size)
    else:
        good, bad = 0, size
        while good == 0 and bad > 1:
            size = bad // 2
            good, bad = (size, bad) if fits(size) else (0, size)
    while bad is not None and bad - good > max(1, int(good * PRECISION)):
        size = (good + bad) // 2
        good, bad = (size, bad) if fits(size) else (good, size)
    return good


def with_margin(largest: int, limit: int) -> int:
    """The batch to train with: the largest that fitted, less the margin (all of it when the data ran out first)."""
    return largest if largest >= limit else max(1, int(largest * (1 - MARGIN)))


class StepProbe:
    """One training step on `size` samples, reporting whether it fitted in memory, agreed over the ranks."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        forward: ForwardFn,
        loss_fn: Any,
        amp: Amp,
        batch_of: Callable[[int], Any],
        device: torch.device,
        reserved_bytes: int = 0,
    ):
        self.model, self.optimizer, self.forward, self.loss_fn, self.amp = (
            model,
            optimizer,
            forward,
            loss_fn,
            amp,
        )
        self.batch_of, self.device, self.reserved_bytes = batch_of, device, reserved_bytes

    def fits(self, size: int) -> bool:
        failure: BaseException | None = None
        try:
            self._step(size)
        except Exception as error:  # noqa: BLE001  (shared with the other ranks below, then raised)
            failure = error
        out_of_memory = failure is not None and is_out_of_memory(failure)
        self.optimizer.zero_grad(set_to_none=True)
        if out_of_memory:
            failure = None  # its traceback holds the step's tensors: drop it, and any cycles, to free them
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the next candidate starts from the same free memory
        verdict = all_reduce_sum(
            torch.tensor([float(out_of_memory), float(failure is not None)], device=self.device)
        )
        too_big, failed = verdict.tolist()
        if failure is not None:
            raise failure
        if failed:
            raise TrainingStopped(
                f"--batch-size auto: another rank failed while trying a batch of {size} "
                f"(its error is in its output)"
            )
        return too_big == 0

    def _step(self, size: int) -> None:
        # DDP's gradient buckets are allocated after the search: a block of their size stands in for them.
        stand_in = torch.empty(self.reserved_bytes, dtype=torch.uint8, device=self.device)  # noqa: F841
        batch = self.batch_of(size)
        with self.amp.autocast():
            outputs, targets = self.forward(self.model, batch)
            loss = compute_loss(outputs, targets, self.loss_fn)
        loss.backward()  # without fp16's loss scaling: the memory is the same, and no step is skipped
        self.optimizer.step()


def find_batch_size(probe: StepProbe, limit: int) -> tuple[int, int]:
    """(the largest batch that fitted, the batch to train with), with the model, optimizer and RNG restored."""
    with kept(probe.model, probe.device, weights=True, optimizer=probe.optimizer):
        largest = largest_fitting(probe.fits, limit)
    return largest, with_margin(largest, limit)


def choose(
    model: torch.nn.Module,
    make_optimizer: Callable[[], torch.optim.Optimizer],
    forward: ForwardFn,
    loss_fn: Any,
    amp: Amp,
    move: Callable[[Any], Any],
    dataset: Any,
    collate_fn: Callable | None,
    runtime: Runtime,
    say: Callable[[str], None],
) -> int:
    """The per-device batch for --batch-size auto: `measure`d on CUDA, else the default batch (one line says so)."""
    if runtime.device.type != "cuda":
        say(
            f"--batch-size auto needs a CUDA device (it measures GPU memory): using the default --batch-size "
            f"{DEFAULT_BATCH_SIZE}"
        )
        return DEFAULT_BATCH_SIZE
    return measure(model, make_optimizer(), forward, loss_fn, amp, move, dataset, collate_fn, runtime, say)


def measure(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    forward: ForwardFn,
    loss_fn: Any,
    amp: Amp,
    move: Callable[[Any], Any],
    dataset: Any,
    collate_fn: Callable | None,
    runtime: Runtime,
    say: Callable[[str], None],
) -> int:
    """The largest batch whose step fits, less the margin, said in one line; every rank must call it.

    `model` is the plain module on its device, before any DDP wrap; `optimizer`
    one of the run's kind on its parameters. The largest batch tried is the data
    a rank gets per epoch: a bigger one would never be used.
    """
    sample = sample_batch(dataset, SAMPLES, collate_fn)
    ddp_buckets = (
        sum(p.numel() * p.element_size() for p in model.parameters()) if runtime.mode == "ddp" else 0
    )
    probe = StepProbe(
        model,
        optimizer,
        forward,
        loss_fn,
        amp,
        lambda size: move(repeat_batch(sample, size)),
        runtime.device,
        ddp_buckets,
    )
    limit = max(1, len(dataset) // runtime.devices_per_step)  # DataParallel: each GPU gets its share too
    with uncompiled():  # eager memory is the larger: a batch that fits eagerly fits compiled
        largest, chosen = find_batch_size(probe, limit)
    if largest == 0:
        raise TrainingStopped(
            f"--batch-size auto: not even a batch of 1 fits in the memory of {runtime.device}: "
            f"try --amp bf16, a smaller model, or free the GPU of other processes"
        )
    why = "all of a device's training data" if largest >= limit else f"{largest} fit, less {MARGIN:.0%}"
    say(f"--batch-size auto: {chosen} per device ({why})")
    return chosen


def auto_batch_size(
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: OptimizerArg,
    forward: ForwardFn,
    loss_fn: Any,
    amp: Amp,
    move: Callable[[Any], Any],
    dataset: Any,
    collate_fn: Callable | None,
    runtime: Runtime,
    say: Callable[[str], None],
) -> TrainConfig:
    """--batch-size auto: the config with the largest batch whose step fits in GPU memory, measured on a probe
    optimizer of the same kind (a given one is restored after), or the default batch without CUDA. Measured
    before anything that depends on the batch is built."""

    def probe_optimizer() -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        return (
            build_optimizer(model, config, config.lr)
            if optimizer is None
            else users_optimizer(optimizer, model, 1.0)
        )

    chosen = choose(model, probe_optimizer, forward, loss_fn, amp, move, dataset, collate_fn, runtime, say)
    return dataclasses.replace(config, batch_size=chosen)
