"""multigpu.loop.inference.BatchParallel on two CPU devices (replicas on threads): the outputs of one device,
in input order; one device below the threshold; and the "auto" threshold measured once."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

from conftest import tiny_model
from multigpu.data.batches import concat, split
from multigpu.loop.inference import BatchParallel, chunk_sizes

CPUS = ["cpu", "cpu"]


def test_chunks_are_contiguous_and_differ_by_at_most_one():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]  # torch's chunk would give 3, 3, 3, 1
    assert chunk_sizes(5, 4) == [2, 1, 1, 1]  # and here only 3 chunks
    assert chunk_sizes(61, 2) == [31, 30] and chunk_sizes(60, 2) == [30, 30]


@pytest.mark.parametrize("size", [1, 7, 59, 60, 61, 101])  # around 30 x 2 devices, odd sizes
def test_two_cpu_replicas_equal_one_device_and_fall_back_below_the_threshold(size):
    model = tiny_model().eval()
    parallel = BatchParallel(model, CPUS)  # min_per_device=30
    inputs = torch.randn(size, 16, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        outputs, whole = parallel(inputs), model(inputs)
        by_chunk = torch.cat([model(chunk) for chunk in inputs.split(chunk_sizes(size, 2))])
    assert outputs.shape == (size, 4)
    if size < 60:
        assert parallel.last_path == "single" and torch.equal(outputs, whole)  # it is one device
    else:
        assert parallel.last_path == "split"
        assert torch.equal(outputs, by_chunk)  # exactly one device running the same chunks
        assert (outputs - whole).abs().max() <= 1e-6  # kernels may round differently by batch size


class Structured(nn.Module):
    """Keyword inputs and dict/tuple outputs, so the split and the join keep structures."""

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, tag: str = "") -> dict:
        return {"double": x * 2 * scale, "pair": (x.sum(1), x[:, :1]), "tag": tag}


def test_keyword_inputs_and_structured_outputs_are_split_and_joined_in_order():
    parallel = BatchParallel(Structured(), CPUS, min_per_device=2)
    x = torch.arange(14.0).reshape(7, 2)
    result = parallel(x, scale=torch.full((7, 1), 3.0), tag="t")
    assert parallel.last_path == "split"
    expected = Structured()(x, scale=torch.full((7, 1), 3.0), tag="t")
    assert result["tag"] == "t" and torch.equal(result["double"], expected["double"])
    assert all(torch.equal(got, want) for got, want in zip(result["pair"], expected["pair"]))
    assert torch.equal(concat(split(x, [3, 0, 4])), x)


class GilAndSleep(nn.Module):
    """A fixed cost per call that holds the GIL (so two replicas pay it one after the other) plus a cost per
    sample that does not (so replicas overlap): splitting wins only for large enough batches (about 2 x
    FIXED / PER_SAMPLE samples), on any machine. Counts its calls."""

    FIXED, PER_SAMPLE = 0.004, 0.0005

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls += 1
        end = time.perf_counter() + self.FIXED
        while time.perf_counter() < end:
            pass
        time.sleep(self.PER_SAMPLE * x.shape[0])
        return x * 2


def test_auto_measures_the_crossover_once_per_input_shape_and_uses_it():
    model = GilAndSleep()
    parallel = BatchParallel(model, CPUS, min_per_device="auto")
    small = torch.ones(3, 5)
    assert torch.equal(parallel(small), small * 2)
    crossover = parallel.last_threshold
    assert 8 <= crossover <= 256, crossover  # about 16 in theory; timing noise moves it a little
    assert parallel.last_path == "single"
    measured_calls = model.calls
    big = torch.ones(int(crossover) + 1, 5)
    assert torch.equal(parallel(big), big * 2) and parallel.last_path == "split"
    assert model.calls == measured_calls + 2  # no second measurement: just the two replicas' calls
    parallel(torch.ones(3, 6))  # another input shape: measured anew
    assert model.calls > measured_calls + 10


def test_bad_settings_are_refused_and_one_device_never_splits():
    with pytest.raises(ValueError, match="all CUDA or all CPU"):
        BatchParallel(tiny_model(), ["cpu", "meta"])
    with pytest.raises(ValueError, match="min_per_device must be a positive integer or 'auto'"):
        BatchParallel(tiny_model(), CPUS, min_per_device=0)
    single = BatchParallel(tiny_model(), ["cpu"], min_per_device=1)
    single(torch.ones(500, 16))
    assert single.last_path == "single"
