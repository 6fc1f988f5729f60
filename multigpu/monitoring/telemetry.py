"""Where the training time goes, how much memory it takes, and how close it runs to the device's peak.

Measured between sync points and read only at them (--log-every steps), so it
adds no host sync to a step (docs/speed.md, "Speed"):

- time/: the shares of the time spent waiting for data, copying batches to the
  device and computing (forward, backward, optimizer, and under DDP the wait for
  the gradient all-reduce). On the CPU: wall clock around the loader's `next()`,
  the rest is compute. On CUDA: events recorded on the device's stream, so the
  shares are of the GPU's own timeline, where a wait for data is the GPU idling
  until the next batch arrives, not the host waiting while the GPU still works.
- memory/ (CUDA): the interval's peak allocated and reserved memory (peaks reset
  each interval), and the allocator's retries and out-of-memory errors since training began.
  With several ranks, every rank's figure too (`memory/rank<R>_peak_gb`: on CUDA the interval's
  peak allocated, on the CPU the process's peak resident memory), one small all-reduce at the
  sync point: under fsdp each rank holds its own shard, and the largest is what must fit.
- perf/: TFLOP/s per device from FLOPs counted once at start (multigpu/monitoring/flops.py), and MFU
  on the GPUs in its table. With a loss over tokens also tokens/s, the counted ones and all positions
  with padding beside them, and the FLOPs counted per position (padded lengths vary from batch to batch).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch

from multigpu.data.batches import batch_size, sample_batch
from multigpu.loop.amp import Amp
from multigpu.loop.forward import ForwardFn
from multigpu.loop.snapshot import kept
from multigpu.loop.tokens import LossWeighting, targets_in
from multigpu.monitoring import flops as flop_lib
from multigpu.monitoring.meters import Interval
from multigpu.monitoring.reporting import Reporter
from multigpu.parallel.distributed import Runtime, all_reduce_sum
from multigpu.parallel.wrapping import uncompiled

GIB = 2**30
DATA_WAIT_HINT = 0.10  # a larger share of the time spent waiting for data gets a one-line hint


class HostClock:
    """Seconds the training loop waited for the loader, and the seconds it ran, per interval (host wall clock).

    `fetch` replaces `move(next(batches))`: everything between fetches (forward,
    backward, optimizer step) is compute, so the loop marks nothing else.
    """

    def __init__(self) -> None:
        self.waited = 0.0
        self.begun: float | None = (
            None  # the interval's first fetch (a checkpoint save before it is not counted)
        )

    def fetch(self, batches: Iterator[Any], move: Callable[[Any], Any]) -> Any:
        """The next batch, moved to the device by `move`."""
        started = time.perf_counter()
        if self.begun is None:
            self.begun = started
        batch = next(batches)
        self.waited += time.perf_counter() - started
        return move(batch)

    def read(self) -> dict[str, float]:
        """Seconds per kind ("data", "compute") since the interval's first fetch; starts the next interval."""
        total = time.perf_counter() - self.begun if self.begun is not None else 0.0
        split = {"data": self.waited, "compute": max(0.0, total - self.waited)}
        self.waited, self.begun = 0.0, None
        return split


class CudaClock(HostClock):
    """The interval on the GPU's timeline: an event after each fetch, copy and compute, read at the sync point.

    Each stretch between two events is the kind of the event that ends it: the
    stretch before a fetch's event is the GPU waiting for that batch. A compute
    ends where the next fetch begins, or where the interval is read. Events are
    reused; recording one does not wait for the GPU, and by the sync point the
    GPU has passed them all (the sync point waited for it).
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.stream = torch.cuda.current_stream(device)
        self.spare: list[torch.cuda.Event] = []
        self.marks: list[tuple[str, torch.cuda.Event]] = []

    def _mark(self, kind: str) -> None:
        event = self.spare.pop() if self.spare else torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self.marks.append((kind, event))

    def fetch(self, batches: Iterator[Any], move: Callable[[Any], Any]) -> Any:
        self._mark("compute" if self.marks else "start")  # what the GPU ran since the last copy was compute
        batch = next(batches)  # the GPU's wait for it is the stretch that ends at the next mark
        self._mark("data")
        moved = move(batch)
        self._mark("copy")
        return moved

    def read(self) -> dict[str, float]:
        if self.marks:
            self._mark("compute")  # the interval's last step
        marks, self.marks = self.marks, []
        if len(marks) < 2:
            return {"data": 0.0, "copy": 0.0, "compute": 0.0}
        marks[-1][1].synchronize()  # returns at once: the sync point has already waited for the GPU
        start = marks[0][1]
        seconds = [start.elapsed_time(event) / 1000.0 for _, event in marks]
        self.spare += [event for _, event in marks]
        return split_timeline([kind for kind, _ in marks], seconds)


def split_timeline(kinds: list[str], seconds: list[float]) -> dict[str, float]:
    """Seconds per kind from marks on one timeline (`kinds[i]` recorded at `seconds[i]`): each stretch between
    two marks counts for the kind of the mark that ends it; the first mark only starts the timeline."""
    split = {"data": 0.0, "copy": 0.0, "compute": 0.0}
    for kind, before, at in zip(kinds[1:], seconds, seconds[1:]):
        split[kind] += at - before
    return split


class Telemetry:
    """The time split, memory and FLOP figures of a run: TensorBoard scalars per interval, totals at the end."""

    def __init__(
        self, runtime: Runtime, amp_dtype: torch.dtype | None, num_workers: int, say: Callable[[str], None]
    ):
        self.device, self.devices, self.num_workers, self.say = (
            runtime.device,
            runtime.devices_per_step,
            num_workers,
            say,
        )
        self.rank, self.world_size = runtime.rank, runtime.world_size
        self.cuda = self.device.type == "cuda"
        self.clock = CudaClock(self.device) if self.cuda else HostClock()
        self.gpu_name = torch.cuda.get_device_name(self.device) if self.cuda else None
        self.precision = flop_lib.precision_of(amp_dtype)
        self.peak = flop_lib.peak_flops(self.gpu_name, self.precision) if self.gpu_name else None
        self.flops_per_sample: float | None = None  # set at start by count_flops
        self.flops_per_position: float | None = (
            None  # a loss over tokens: per target position, padding included
        )
        self.tokens, self.positions = 0.0, 0.0  # over the run, a loss over tokens
        self.seconds = {"data": 0.0, "copy": 0.0, "compute": 0.0}  # over the run
        self.samples, self.train_seconds = 0.0, 0.0
        self.max_allocated: float | None = None
        self.interval_allocated = 0.0  # this interval's peak allocated GiB (CUDA)
        self.rank_peaks: list[float] | None = None  # every rank's peak GiB over the run (several ranks)
        self.baseline = {"num_alloc_retries": 0, "num_ooms": 0}  # allocator counts before training began
        self.hinted: set[str] = set()
        self.intervals = 0

    # ------------------------------------------------------------------ at start
    def count_flops(
        self, model: torch.nn.Module, forward: Callable[[Any], Any], batch: Any, samples: int
    ) -> float | None:
        """FLOPs per training sample from one forward and backward of `batch` on the plain module (outside
        any wrapper, so no collective runs); buffers, gradients and RNG are restored, so training is unchanged."""
        try:
            with kept(model, self.device):
                counted = flop_lib.count_flops(lambda: forward(batch))
        except Exception as error:  # noqa: BLE001  (a failed count costs the perf/ figures, not the run)
            self.say(
                f"perf/ not logged: counting the model's FLOPs on one batch failed ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:200] if str(error) else 'no message'})"
            )
            return None
        return counted / samples if counted else None

    def start(self) -> None:
        """Training begins: memory peaks and allocator counts from here on."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            stats = torch.cuda.memory_stats(self.device)
            self.baseline = {key: stats.get(key, 0) for key in self.baseline}

    # ------------------------------------------------------------------ at each sync point
    def interval(self, interval: Interval, first_step: int, step: int) -> dict[str, float]:
        """The interval's time/, memory/ and perf/ scalars (and, once per run, a hint where they call for one)."""
        self.intervals += 1
        split = self.clock.read()
        for kind, seconds in split.items():
            self.seconds[kind] += seconds
        self.samples += interval.samples
        self.tokens += interval.tokens
        self.positions += interval.positions
        self.train_seconds += interval.seconds
        scalars = self._time_scalars(split, interval, step - first_step + 1)
        if interval.by_tokens:
            seconds = max(interval.seconds, 1e-9)
            scalars.update(
                {
                    "perf/tokens_per_sec": interval.tokens / seconds,
                    "perf/padded_tokens_per_sec": interval.positions / seconds,
                }
            )
        if self.cuda:
            scalars.update(self._memory_scalars(first_step, step))
        if self.world_size > 1:
            scalars.update(self._rank_memory_scalars())
        flops = self._flops_in(interval.samples, interval.positions)
        if flops:
            per_device = flops / max(interval.seconds, 1e-9) / self.devices
            scalars["perf/tflops_per_device"] = per_device / 1e12
            if self.peak:
                scalars["perf/mfu"] = per_device / self.peak
        data_share = scalars.get("time/data_wait_frac", 0.0)
        if self.intervals > 1 and data_share > DATA_WAIT_HINT:  # the first holds the loader's start-up
            self._hint_once(
                "data",
                f"steps {first_step}-{step}: {data_share:.0%} of the time went to waiting for "
                f"data: raise --num-workers (TrainConfig.num_workers from Python; now "
                f"{self.num_workers})",
            )
        return scalars

    def _time_scalars(self, split: dict[str, float], interval: Interval, steps: int) -> dict[str, float]:
        total = sum(split.values())
        scalars = {"time/step_ms": 1000.0 * interval.seconds / max(steps, 1)}
        if total > 0:
            names = {"data": "time/data_wait_frac", "copy": "time/copy_frac", "compute": "time/compute_frac"}
            scalars.update({names[kind]: seconds / total for kind, seconds in split.items()})
        return scalars

    def _memory_scalars(self, first_step: int, step: int) -> dict[str, float]:
        stats = torch.cuda.memory_stats(self.device)  # the allocator's counters: no device sync
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated = stats.get("allocated_bytes.all.peak", 0) / GIB
        self.interval_allocated = allocated
        self.max_allocated = max(self.max_allocated or 0.0, allocated)
        retries = stats.get("num_alloc_retries", 0) - self.baseline["num_alloc_retries"]
        if retries:
            self._hint_once(
                "memory",
                f"steps {first_step}-{step}: the CUDA allocator had to free its cache and "
                f"retry {retries} allocation(s): memory is nearly full, which slows steps; a "
                f"smaller --batch-size (or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) "
                f"helps",
            )
        return {
            "memory/max_allocated_gb": allocated,
            "memory/max_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / GIB,
            "memory/alloc_retries": float(retries),
            "memory/ooms": float(stats.get("num_ooms", 0) - self.baseline["num_ooms"]),
        }

    def _rank_memory_scalars(self) -> dict[str, float]:
        """Every rank's memory in GiB, gathered by one all-reduce of a vector where each rank fills its own slot."""
        mine = (
            self.interval_allocated
            if self.cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        )
        slots = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        slots[self.rank] = mine
        figures = all_reduce_sum(slots).tolist()  # at the sync point: the host waits here anyway
        self.rank_peaks = [max(old, new) for old, new in zip(self.rank_peaks or figures, figures)]
        return {f"memory/rank{rank}_peak_gb": figure for rank, figure in enumerate(figures)}

    def _hint_once(self, topic: str, text: str) -> None:
        if topic not in self.hinted:
            self.hinted.add(topic)
            self.say(text)

    # ------------------------------------------------------------------ at the end
    def summary(self) -> dict[str, float | list[float] | None]:
        """Run totals for fit()'s result: data_wait_frac; on CUDA also max_memory_allocated_gb and mfu
        (None where not measured)."""
        total = sum(self.seconds.values())
        result: dict[str, float | list[float] | None] = {
            "data_wait_frac": self.seconds["data"] / total if total else None
        }
        if self.rank_peaks:
            result["peak_memory_per_rank_gb"] = self.rank_peaks
        if self.cuda:
            result["max_memory_allocated_gb"] = self.max_allocated
            flops = self._flops_in(self.samples, self.positions)
            result["mfu"] = (
                flops / self.train_seconds / self.devices / self.peak
                if flops and self.peak and self.train_seconds
                else None
            )
        if self.positions and self.train_seconds:
            result["tokens_per_sec"] = self.tokens / self.train_seconds
            result["padded_tokens_per_sec"] = self.positions / self.train_seconds
        return result

    def _flops_in(self, samples: float, positions: float) -> float | None:
        """The FLOPs of training `samples` samples of `positions` target positions: by position for a loss
        over tokens (padded lengths vary), else by sample; None where they were not counted."""
        if self.flops_per_position:
            return self.flops_per_position * positions
        return self.flops_per_sample * samples if self.flops_per_sample else None

    def summary_text(self, summary: dict[str, Any]) -> str:
        """The end-of-run line's additions: "; data wait 3%, peak memory 10.20 GiB, MFU 41.0% (bf16 peak of ...)"."""
        parts = []
        if summary.get("tokens_per_sec") is not None:
            parts.append(
                f"{summary['tokens_per_sec']:,.0f} tokens/s ({summary['padded_tokens_per_sec']:,.0f} "
                f"with padding)"
            )
        if summary.get("data_wait_frac") is not None:
            parts.append(f"data wait {summary['data_wait_frac']:.0%}")
        if summary.get("max_memory_allocated_gb") is not None:
            parts.append(f"peak memory {summary['max_memory_allocated_gb']:.2f} GiB")
        if summary.get("peak_memory_per_rank_gb"):
            peaks = summary["peak_memory_per_rank_gb"]
            what = "allocated" if self.cuda else "resident"
            parts.append(
                f"peak {what} memory per rank {min(peaks):.2f}-{max(peaks):.2f} GiB (rank "
                f"{peaks.index(max(peaks))} the most)"
            )
        if summary.get("mfu") is not None:
            parts.append(f"MFU {summary['mfu']:.1%} ({self.precision} peak of {self.gpu_name})")
        elif self.cuda:
            parts.append(f"no MFU: {self._why_no_mfu()}")
        return "; " + ", ".join(parts) if parts else ""

    def _why_no_mfu(self) -> str:
        row = flop_lib.gpu_row(self.gpu_name or "")
        if row is None:
            return f"{self.gpu_name} is not in multigpu/monitoring/flops.py's table of peaks"
        return f"no {self.precision} peak for {row}" if self.peak is None else "the FLOPs were not counted"


def run_telemetry(
    runtime: Runtime,
    amp: Amp,
    loader: Any,
    report: Reporter,
    model: torch.nn.Module,
    forward: ForwardFn,
    move: Callable[[Any], Any],
    dataset: Any,
    batch: int,
    collate_fn: Callable | None,
    weighting: LossWeighting | None = None,
) -> Telemetry:
    """The run's telemetry, with FLOPs per training sample (per target position, for a loss over tokens:
    `weighting`) for MFU (docs/speed.md, "Speed")."""
    measured = Telemetry(runtime, amp.dtype, loader.num_workers, report.line)
    if loader.num_workers == 0:
        report.import_writer_in_background()
    try:
        sample = sample_batch(dataset, min(batch, 8), collate_fn)
    except Exception:  # a data set that only reads inside the loader's workers: no FLOP count, no perf/
        return measured
    measured.flops_per_sample = flops_per_sample(measured, amp, model, forward, move, sample)
    targets = targets_in(sample)
    if measured.flops_per_sample and weighting is not None and weighting.tokens and targets is not None:
        measured.flops_per_position = measured.flops_per_sample * batch_size(sample) / targets.numel()
    return measured


def flops_per_sample(
    telemetry: Telemetry,
    amp: Amp,
    model: torch.nn.Module,
    forward: ForwardFn,
    move: Callable[[Any], Any],
    sample: Any,
) -> float | None:
    """FLOPs per training sample, counted on `sample`, a small batch of the training set, on the plain module,
    before the wrap (no collective)."""

    def forward_only(moved: Any) -> Any:
        with amp.autocast():
            return forward(model, moved)[0]

    with uncompiled():
        return telemetry.count_flops(model, forward_only, move(sample), batch_size(sample))
