"""Telemetry on the CPU: the time split and FLOP rate in TensorBoard with sane values, the data-wait hint, the
end-of-run line, and the GPU-only figures absent (multigpu/monitoring/telemetry.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from conftest import TINY, assert_ok, blobs, config_for, read_scalars, run_cli, tiny_model
from multigpu.data.batches import sample_batch
from multigpu.monitoring import telemetry
from multigpu.monitoring.telemetry import split_timeline
from train_multi_gpu import MultiGPUTrainer

FLOPS_PER_SAMPLE = (
    3 * (2 * 16 * 32 + 2 * 32 * 4) - 2 * 16 * 32
)  # tiny_model: forward, backward (no input gradient)


def values(scalars: dict, tag: str) -> list[float]:
    return [value for _, value in sorted(scalars[tag])]


def test_time_split_and_flop_rate_are_logged_at_each_sync_point_with_sane_values(tmp_path: Path, capsys):
    config = config_for(tmp_path, 1, epochs=1, log_every=2)
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config)  # 8 steps: 4 logging intervals
    summary = trainer.fit()
    scalars = read_scalars(tmp_path / "ckpt" / "tb")
    data, compute = values(scalars, "time/data_wait_frac"), values(scalars, "time/compute_frac")
    assert len(data) == len(compute) == 4
    assert all(0 <= share <= 1 for share in data + compute)
    assert all(abs(a + b - 1) < 1e-6 for a, b in zip(data, compute))
    assert all(step_ms > 0 for step_ms in values(scalars, "time/step_ms"))
    # FLOPs counted once at start, exactly; the rate is FLOPs per sample x the interval's samples/s.
    assert trainer.telemetry.flops_per_sample == FLOPS_PER_SAMPLE
    rates = values(scalars, "train/samples_per_sec")
    assert values(scalars, "perf/tflops_per_device") == pytest.approx(
        [FLOPS_PER_SAMPLE * r / 1e12 for r in rates], rel=1e-5
    )
    assert not [
        tag for tag in scalars if tag.startswith("memory/") or tag == "perf/mfu"
    ]  # CUDA, a known GPU only
    assert 0 <= summary["data_wait_frac"] <= 1 and "mfu" not in summary
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and done[0].endswith(f"; data wait {summary['data_wait_frac']:.0%}")


class SlowSamples(Dataset):
    """blobs() whose samples take 20 ms each to load, as from a slow disk."""

    def __init__(self, size: int):
        self.data = blobs(size, 0)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        time.sleep(0.02)  # the load itself, not a wait for another process
        return self.data[index]


def test_waiting_for_data_shows_in_the_split_and_gets_one_hint(tmp_path: Path, capsys):
    config = config_for(tmp_path, 1, epochs=1, log_every=2, num_workers=0)
    trainer = MultiGPUTrainer(tiny_model(), SlowSamples(64), None, config)
    summary = trainer.fit()  # 8 steps of 8 samples: at least 1.28 s of loading
    assert trainer.telemetry.seconds["data"] >= 64 * 0.02
    shares = values(read_scalars(tmp_path / "ckpt" / "tb"), "time/data_wait_frac")
    assert len(shares) == 4 and all(0 <= share <= 1 for share in shares) and summary["data_wait_frac"] > 0.5
    hints = [line for line in capsys.readouterr().out.splitlines() if "waiting for data" in line]
    assert len(hints) == 1 and hints[0].startswith(
        "steps 3-4: "
    )  # the first interval holds the loader's start-up
    assert hints[0].endswith(
        "of the time went to waiting for data: raise --num-workers (TrainConfig.num_workers from Python; now 0)"
    )


@pytest.mark.slow
def test_under_fsdp_every_ranks_memory_is_logged_and_the_largest_named_at_the_end(tmp_path: Path):
    """2 real gloo processes under fsdp: one memory/rank<R>_peak_gb series per rank (the CPU's peak resident
    memory), gathered at each sync point, and the end-of-run line's range over the ranks."""
    result = run_cli(
        [
            *TINY,
            "--multi-gpu",
            "fsdp",
            "--epochs",
            "1",
            "--log-every",
            "4",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ],
        nproc=2,
    )
    assert_ok(result)
    scalars = read_scalars(tmp_path / "ckpt" / "tb")
    per_rank = [values(scalars, f"memory/rank{rank}_peak_gb") for rank in (0, 1)]
    steps = 512 // (32 * 2)
    assert [len(series) for series in per_rank] == [steps // 4] * 2
    assert all(
        0.05 < figure < 8 for series in per_rank for figure in series
    )  # a process with torch: 50 MB..8 GB
    assert all(
        later >= earlier for series in per_rank for earlier, later in zip(series, series[1:])
    )  # a peak
    done = next(line for line in result.stdout.splitlines() if line.startswith("done:"))
    low, high = min(s[-1] for s in per_rank), max(s[-1] for s in per_rank)
    assert f"peak resident memory per rank {low:.2f}-{high:.2f} GiB" in done


def test_counting_flops_leaves_the_models_buffers_and_gradients_as_they_were(tmp_path: Path):
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(8)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 8), norm, torch.nn.Dropout(0.5), torch.nn.Linear(8, 4)
    ).eval()
    assert norm.running_mean is not None  # tracked by default
    trainer = MultiGPUTrainer(model, blobs(64, 0), None, config_for(tmp_path, 1))
    statistics, random_state = norm.running_mean.clone(), torch.get_rng_state()
    sample = sample_batch(blobs(64, 0), 8)
    flops = telemetry.flops_per_sample(
        trainer.telemetry, trainer.amp, model, trainer.forward, trainer.evaluator.move, sample
    )
    assert flops is not None and flops > 0  # a forward and backward in training mode ...
    assert torch.equal(norm.running_mean, statistics)  # ... and the BatchNorm statistics put back,
    assert torch.equal(torch.get_rng_state(), random_state)  # the random state (dropout drew from it),
    assert all(p.grad is None for p in model.parameters()) and not model.training  # no gradient, eval mode


def test_the_gpu_timeline_is_split_by_the_mark_that_ends_each_stretch():
    # start, batch 1 (waited 2, copied 1, computed 5 with its optimizer step), batch 2 arrives at once
    kinds = ["start", "data", "copy", "compute", "compute", "data", "copy", "compute"]
    seconds = [0.0, 2.0, 3.0, 7.0, 8.0, 8.0, 8.5, 10.0]
    assert split_timeline(kinds, seconds) == {"data": 2.0, "copy": 1.5, "compute": 6.5}
