"""BatchParallel: split each batch over several devices in one process, for prediction outside training.

    model = BatchParallel(model, devices=[0, 1, 2, 3])  # or ["cpu", "cpu"]; default: every visible GPU
    outputs = model(inputs)                              # the same outputs as model(inputs), in input order

Each batch is cut into contiguous chunks whose sizes differ by at most one,
the replicas run concurrently, and the outputs are joined in input order on
the first device. Below `min_per_device x devices` samples the batch runs on
the first device alone: splitting a small batch costs more (copies, one
kernel launch per device, the join) than it saves. `min_per_device="auto"`
measures where splitting starts to win, once per model, input shape and device
list (docs/prediction.md, "Prediction").

On GPUs it is torch's own DataParallel machinery (replicate, parallel_apply,
gather) with one difference: torch's scatter cuts with `chunk`, whose chunks
are ceil-sized (10 samples over 4 GPUs: 3, 3, 3, 1; 5 over 4: only 3 chunks),
so the batch is cut here. Those functions are CUDA-only, so on CPU devices the
replicas (one module, shared) run in threads and the outputs are joined here.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch.nn.parallel import gather, parallel_apply, replicate

from multigpu.data.batches import batch_size, concat, repeat_batch, split, to_device

DeviceSpec = Union[int, str, torch.device]
AUTO_LARGEST = 4096  # the largest batch "auto" times: a crossover above it counts as "never"
AUTO_REPEATS = 3  # timings per batch size and path (the median is used)

# "auto" crossovers, measured once per (model, input shape, devices): {module: {(shape key, devices): samples}}
CROSSOVERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, float]] = weakref.WeakKeyDictionary()


def chunk_sizes(samples: int, parts: int) -> list[int]:
    """`samples` cut into `parts` contiguous chunks, the first `samples % parts` of them one larger."""
    base, extra = divmod(samples, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def crossover(batches: Sequence[int], split_wins: Sequence[bool]) -> int | None:
    """Where splitting starts to win: the smallest of the measured `batches` (ascending) at which the split
    was faster both there and at the next measured batch (the largest counts on its own); None if nowhere.

    Asking for two wins in a row keeps one lucky timing from setting the threshold.
    """
    for index, (batch, won) in enumerate(zip(batches, split_wins)):
        if won and (index + 1 == len(batches) or split_wins[index + 1]):
            return batch
    return None


class BatchParallel:
    """A callable that runs `module` on each batch split over `devices` (see the module docstring).

    `last_path` says how the last call ran: "split" over the devices or "single" on the first one;
    `last_threshold` the batch size from which that input splits (inf: never).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        devices: Sequence[DeviceSpec] | None = None,
        min_per_device: int | str = 30,
    ):
        self.devices = _devices(devices)
        if min_per_device != "auto" and not (
            isinstance(min_per_device, int) and not isinstance(min_per_device, bool) and min_per_device >= 1
        ):
            raise ValueError(f"min_per_device must be a positive integer or 'auto', got {min_per_device!r}")
        self.module = module.to(self.devices[0])
        self.min_per_device = min_per_device
        self.last_path: str | None = None
        self.last_threshold: float | None = None
        self._replicas: list[torch.nn.Module] = []
        self._replicas_of: tuple | None = None  # the parameter versions the cached replicas were made from

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        samples = batch_size((inputs, kwargs))
        self.last_threshold = self._threshold(inputs, kwargs) if samples > 0 else math.inf
        if samples < self.last_threshold:
            self.last_path = "single"
            return self._single(inputs, kwargs)
        self.last_path = "split"
        return self._split(inputs, kwargs, samples)

    # ------------------------------------------------------------------ the two paths
    def _single(self, inputs: tuple, kwargs: dict) -> Any:
        device = self.devices[0]
        return self.module(*to_device(inputs, device), **to_device(kwargs, device))

    def _split(self, inputs: tuple, kwargs: dict, samples: int) -> Any:
        parts = [
            to_device(part, device)
            for part, device in zip(
                split((inputs, kwargs), chunk_sizes(samples, len(self.devices))), self.devices
            )
        ]
        replicas = self._current_replicas()
        if self.devices[0].type == "cuda":
            outputs = parallel_apply(
                replicas, [args for args, _ in parts], [kw for _, kw in parts], self.devices
            )
            return gather(outputs, self.devices[0])
        return concat(_run_in_threads(replicas, parts))

    def _current_replicas(self) -> list[torch.nn.Module]:
        """One replica per device. CUDA replicas are rebuilt when a weight changed (or, with gradients
        on, every call, as DataParallel does); on the CPU the replicas are the module itself."""
        if self.devices[0].type != "cuda":
            return [self.module] * len(self.devices)
        grad = torch.is_grad_enabled()
        versions = (
            None
            if grad
            else tuple(
                (t.data_ptr(), t._version) for t in (*self.module.parameters(), *self.module.buffers())
            )
        )
        if grad or versions != self._replicas_of:
            self._replicas = replicate(self.module, self.devices, detach=not grad)
            self._replicas_of = versions
        return self._replicas

    # ------------------------------------------------------------------ the threshold
    def _threshold(self, inputs: tuple, kwargs: dict) -> float:
        """The batch size from which this input is split."""
        if len(self.devices) == 1:
            return math.inf
        if isinstance(self.min_per_device, int):  # else "auto"
            return self.min_per_device * len(self.devices)
        key = (_shape_key((inputs, kwargs)), tuple(self.devices))
        measured = CROSSOVERS.setdefault(self.module, {})
        if key not in measured:
            measured[key] = self._measure_crossover(inputs, kwargs)
        return measured[key]

    def _measure_crossover(self, inputs: tuple, kwargs: dict) -> float:
        """The `crossover` of split against one device, timed at powers of 2 from one sample per device up
        to AUTO_LARGEST samples (or as far as memory allows); inf when splitting never wins. Batches are this
        input's samples repeated; timed in eval mode without gradients."""
        template = to_device((inputs, kwargs), self.devices[0])
        measured: list[int] = []
        wins: list[bool] = []
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for size in (len(self.devices) * 2**k for k in range(32)):
                    if size > AUTO_LARGEST:
                        break
                    batch_inputs, batch_kwargs = repeat_batch(template, size)
                    single = self._time(lambda: self._single(batch_inputs, batch_kwargs))
                    spread = self._time(lambda: self._split(batch_inputs, batch_kwargs, size))
                    measured.append(size)
                    wins.append(spread < single)
                    if len(wins) >= 2 and wins[-1] and wins[-2]:
                        break  # confirmed: larger batches need not be timed
        except torch.OutOfMemoryError:
            pass  # the largest batches do not fit: what was measured so far decides
        finally:
            self.module.train(was_training)
        found = crossover(measured, wins)
        return math.inf if found is None else found

    def _time(self, run: Any) -> float:
        """Median seconds of `run()` after one warm-up call, waiting for every device."""
        times = []
        for attempt in range(AUTO_REPEATS + 1):
            self._synchronize()
            started = time.perf_counter()
            run()
            self._synchronize()
            if attempt:
                times.append(time.perf_counter() - started)
        return statistics.median(times)

    def _synchronize(self) -> None:
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def _devices(devices: Sequence[DeviceSpec] | None) -> list[torch.device]:
    """The devices as torch.device objects: GPU ids are CUDA devices; default every visible GPU (else the CPU)."""
    if devices is None:
        count = torch.cuda.device_count()
        return [torch.device("cuda", index) for index in range(count)] or [torch.device("cpu")]
    resolved = [
        torch.device("cuda", spec) if isinstance(spec, int) else torch.device(spec) for spec in devices
    ]
    if not resolved:
        raise ValueError("BatchParallel needs at least one device")
    if len({device.type for device in resolved}) > 1:
        raise ValueError(
            f"BatchParallel devices must all be of one kind (all CUDA or all CPU), got "
            f"{', '.join(map(str, resolved))}"
        )
    return resolved


def _run_in_threads(replicas: list[torch.nn.Module], parts: list[tuple[tuple, dict]]) -> list[Any]:
    """Each replica on its part, concurrently (torch's kernels release the GIL), with the caller's
    gradient and CPU autocast settings; the first error is raised here."""
    results: list[Any] = [None] * len(parts)
    errors: list[BaseException] = []
    grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu")

    def work(index: int) -> None:
        try:
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=dtype, enabled=autocast):
                args, kwargs = parts[index]
                results[index] = replicas[index](*args, **kwargs)
        except BaseException as error:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(1, len(parts))]
    for thread in threads:
        thread.start()
    work(0)  # the caller's thread takes the first part
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _shape_key(batch: Any) -> tuple:
    """Per-sample shapes and dtypes of every tensor in `batch`: what the crossover depends on."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape[1:]), batch.dtype)
    if isinstance(batch, dict):
        return tuple((key, _shape_key(value)) for key, value in sorted(batch.items()))
    if isinstance(batch, (list, tuple)):
        return tuple(_shape_key(value) for value in batch)
    return ()
