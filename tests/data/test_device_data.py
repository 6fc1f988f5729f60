"""--data-on-device (data/device_data.py): the training set on the device, each batch gathered there.

The same samples in the same order as the loader: bit-identical weights in one process and under 2-process
DDP (with accumulation and a short last window); a data set whose samples are read once (the built-in
synthetic set) too; CIFAR's crop and flip on whole batches, reproducible on a rerun and across a resume
mid-epoch; auto keeps the loader with one line saying why, and `on` refuses in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from conftest import (
    TINY,
    assert_ok,
    blobs,
    config_for,
    image_folder,
    run_benchmark,
    run_cli,
    run_ranks,
    tiny_model,
)
from multigpu.data import RandomCropFlip, SyntheticImages, device_data
from multigpu.data.augment import crop_flip
from multigpu.errors import UsageError
from multigpu.tuning import autotune
from train_multi_gpu import MultiGPUTrainer


def weights(trainer: MultiGPUTrainer) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a), [
        key for key in a if not torch.equal(a[key], b[key])
    ]


def train(
    tmp_path: Path, data: Dataset, model: torch.nn.Module, world_size: int = 1, **overrides: Any
) -> MultiGPUTrainer:
    config = config_for(tmp_path, world_size, **{"epochs": 2, "grad_accum_steps": 2, **overrides})
    trainer = MultiGPUTrainer(model, data, None, config)
    trainer.fit()
    return trainer


def test_on_the_device_one_process_trains_bit_identically_to_the_loader(tmp_path: Path) -> None:
    # 138 samples, micro-batches of 8, 2 per step: each epoch ends in a short window (10 = 8 + 2)
    loader = train(tmp_path / "loader", blobs(138, 0), tiny_model(), data_on_device="off")
    device = train(tmp_path / "device", blobs(138, 0), tiny_model(), data_on_device="on")
    assert type(loader.train_loader).__name__ == "DataLoader"
    assert isinstance(device.train_loader, device_data.DeviceBatches)
    assert device.progress.global_step == loader.progress.global_step == 18
    assert_identical(weights(loader), weights(device))


def images_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )


def test_a_set_whose_samples_never_change_is_read_once_and_trains_bit_identically(tmp_path: Path) -> None:
    synthetic = SyntheticImages(100, (3, 8, 8), 10, seed=3)
    read = []
    original = SyntheticImages.__getitem__

    def recorded(self: Any, index: int) -> Any:
        read.append(index)
        return original(self, index)

    SyntheticImages.__getitem__ = recorded
    try:
        device = train(tmp_path / "device", synthetic, images_model(), data_on_device="auto")
    finally:
        SyntheticImages.__getitem__ = original
    assert isinstance(device.train_loader, device_data.DeviceBatches)
    # the first sample once to size the set, then each sample once; FLOP counting reads a few more
    assert read[0] == 0 and sorted(set(read)) == list(range(100)) and read.count(57) == 1, read
    loader = train(tmp_path / "loader", synthetic, images_model(), data_on_device="off")
    assert_identical(weights(loader), weights(device))


def _ddp_weights(rank: int, world_size: int, save_dir: str, mode: str) -> tuple[dict[str, torch.Tensor], Any]:
    # 4 epochs of 5 steps: long enough for auto to measure both ways (2 x 5 steps, and as many to gain)
    trainer = train(
        Path(save_dir) / mode, blobs(138, 0), tiny_model(), world_size, data_on_device=mode, epochs=4
    )
    if mode != "auto":
        assert isinstance(trainer.train_loader, device_data.DeviceBatches) == (mode == "on")
    result = weights(trainer), trainer.autotune and trainer.autotune.chosen
    trainer.close()
    return result


def _three_ways(rank: int, world_size: int, save_dir: str) -> list[tuple[dict[str, torch.Tensor], Any]]:
    return [_ddp_weights(rank, world_size, save_dir, mode) for mode in ("off", "on", "auto")]


def test_under_ddp_two_ranks_on_the_device_train_bit_identically_to_the_loader(tmp_path: Path) -> None:
    """And auto, which switches between the two in its first steps, all ranks at the same steps."""
    ranks = run_ranks(_three_ways, 2, tmp_path, str(tmp_path))
    for (loader, _), (device, _), (auto, _chosen) in ranks:
        assert_identical(loader, device)
        assert_identical(loader, auto)
    assert_identical(ranks[0][1][0], ranks[1][1][0])  # and the ranks agree
    assert (
        ranks[0][2][1] == ranks[1][2][1] and ranks[0][2][1].data_on_device is not None
    )  # on their choice too


class StepClock:
    """The clock the autotuner reads its step times from (Autotuner._now), advanced only by what a batch costs
    each way: the decision is tested on these injected measurements, never on a busy machine's timing (the real
    timing of both ways is benchmarks/data_on_device.py --auto's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seconds = 0.0
        monkeypatch.setattr(autotune.Autotuner, "_now", lambda tuner: self.seconds)


class CountedRows(TensorDataset):
    """A TensorDataset each of whose samples, read through the loader, costs `per_sample` seconds on `clock`."""

    def __init__(self, clock: StepClock, per_sample: float, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.clock, self.per_sample = clock, per_sample

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.clock.seconds += self.per_sample
        return super().__getitem__(index)


def counted_gathers(monkeypatch: pytest.MonkeyPatch, clock: StepClock, per_batch: float) -> None:
    """Each batch gathered on the device costs `per_batch` seconds on `clock`."""
    gather = device_data.DeviceBatches._gather

    def counted(self: Any, index: Any) -> Any:
        clock.seconds += per_batch
        return gather(self, index)

    monkeypatch.setattr(device_data.DeviceBatches, "_gather", counted)


@pytest.mark.parametrize("slower", ["the loader", "the device"])
def test_auto_measures_both_ways_in_the_first_steps_and_keeps_the_faster(
    tmp_path: Path, capsys, monkeypatch, slower: str
) -> None:
    """auto put a TensorDataset on the device where the loader was faster (514 against 868 samples/s in one
    process): the first steps measure both ways on the training steps themselves, and the faster stays, with
    the same batches, saved in the checkpoint and kept on a resume. The step times are injected (StepClock): a
    batch costs 10 ms the faster way and 58 ms the slower, 8 samples a batch."""
    clock = StepClock(monkeypatch)
    data = blobs(160, 0)  # 20 steps of 8: 5 each way, and 10 to gain
    loader_ms, device_ms = (58, 10) if slower == "the loader" else (10, 58)
    counted_gathers(monkeypatch, clock, device_ms / 1000)
    data = CountedRows(clock, loader_ms / 1000 / 8, *data.tensors)
    auto = train(tmp_path / "auto", data, tiny_model(), data_on_device="auto", epochs=1, grad_accum_steps=1)
    line = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("--data-on-device auto:")
    )
    faster = "data through the loader" if slower == "the device" else "data on the device"
    gain = device_ms / min(device_ms, loader_ms)
    assert line == (
        f"--data-on-device auto: {faster}, x{gain:.2f} the data on the device (median step "
        f"{min(device_ms, loader_ms):.1f} ms vs {device_ms:.1f} ms; steps 1-10 measured, ms per step: data on the "
        f"device {device_ms:.1f}; data through the loader {loader_ms:.1f})"
    )
    assert isinstance(auto.train_loader, device_data.DeviceBatches) == (slower == "the loader")
    assert_identical(
        weights(auto),
        weights(
            train(tmp_path / "off", data, tiny_model(), data_on_device="off", epochs=1, grad_accum_steps=1)
        ),
    )
    resumed = train(
        tmp_path / "auto",
        data,
        tiny_model(),
        data_on_device="auto",
        epochs=2,
        grad_accum_steps=1,
        resume="auto",
    )
    assert (
        f"--data-on-device auto: {faster}, as chosen at step 10 and saved in the checkpoint (not measured "
        f"again)" in capsys.readouterr().out
    )
    assert resumed.autotune is not None  # --data-on-device auto's choice
    assert resumed.autotune.medians == [] and isinstance(resumed.train_loader, type(auto.train_loader))


def test_auto_leaves_the_loaders_way_untried_where_the_batches_cost_too_little_to_matter(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A step's compute is the same either way: where its batches cost less on the device than the 3% the loader
    would have to save (1 ms of a 101 ms step, injected as above), the loader's 5 trial steps, and their two
    switches, would only cost a short run: not tried, and the line says why."""
    clock = StepClock(monkeypatch)
    counted_gathers(monkeypatch, clock, 0.001)
    model = tiny_model()

    def compute(module: torch.nn.Module, inputs: Any) -> None:
        clock.seconds += 0.1

    model.register_forward_pre_hook(compute)
    data = CountedRows(clock, 0.0, *blobs(160, 0).tensors)
    auto = train(tmp_path / "auto", data, model, data_on_device="auto", epochs=1, grad_accum_steps=1)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("--data-on-device"))
    assert line == (
        "--data-on-device auto: data on the device, x1.00 the data on the device (median step 101.0 ms vs 101.0 "
        "ms; steps 1-5 measured, ms per step: data on the device 101.0); the loader's way not tried: a step's "
        "batches take 1.00 ms on the device, less than the 3% of a 101.0 ms step that it would have to save"
    )
    assert isinstance(auto.train_loader, device_data.DeviceBatches) and auto.autotune is not None
    assert len(auto.autotune.trials) == 1 and auto.autotune.summary["at_step"] == 5


def cifar_like(size: int = 96) -> RandomCropFlip:
    generator = torch.Generator().manual_seed(5)
    images = TensorDataset(
        torch.randn(size, 3, 8, 8, generator=generator), torch.randint(0, 10, (size,), generator=generator)
    )
    return RandomCropFlip(images, padding=2, fill=[-1.0, 0.0, 1.0])


def test_crop_and_flip_on_a_batch_is_a_window_of_the_padded_image_mirrored_where_drawn() -> None:
    images = torch.randn(16, 3, 6, 5)
    fill = torch.tensor([-1.0, 0.5, 2.0])
    out = crop_flip(images, 2, fill, torch.Generator().manual_seed(7))
    replay = torch.Generator().manual_seed(7)  # the draws, in crop_flip's order
    offsets = torch.randint(0, 5, (2, 16), generator=replay)
    flipped = torch.randint(0, 2, (16, 1), generator=replay, dtype=torch.bool)
    padded = torch.cat(
        [torch.nn.functional.pad(images[:, c : c + 1], (2, 2, 2, 2), value=float(fill[c])) for c in range(3)],
        dim=1,
    )
    for i in range(16):
        top, left = int(offsets[0, i]), int(offsets[1, i])
        window = padded[i, :, top : top + 6, left : left + 5]
        assert torch.equal(out[i], window.flip(-1) if flipped[i] else window), i
    assert flipped.any() and not flipped.all() and len(set(offsets[0].tolist())) > 1


def test_augmentation_on_the_device_repeats_on_a_rerun_and_across_a_resume_mid_epoch(tmp_path: Path) -> None:
    whole = train(tmp_path / "whole", cifar_like(), images_model(), data_on_device="on", save_every_steps=3)
    rerun = train(tmp_path / "rerun", cifar_like(), images_model(), data_on_device="on")
    assert_identical(weights(whole), weights(rerun))
    # 96 samples, 16 per step: 6 steps an epoch; step 9 is mid-epoch 2
    resumed = train(
        tmp_path / "resumed",
        cifar_like(),
        images_model(),
        data_on_device="on",
        resume=str(tmp_path / "whole" / "ckpt" / "step-000000009.pt"),
    )
    assert resumed.progress.global_step == 12
    assert_identical(weights(whole), weights(resumed))
    plain = train(tmp_path / "plain", cifar_like().dataset, images_model(), data_on_device="on")
    assert not all(torch.equal(a, b) for a, b in zip(weights(whole).values(), weights(plain).values()))


class Vectors(Dataset):
    """A set whose samples are one bare tensor each (no targets), and never change."""

    fixed_samples = True

    def __len__(self) -> int:
        return 30

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.arange(4.0) + index


def test_the_batches_are_the_loaders_batches_in_structure_and_order() -> None:
    from multigpu.config import TrainConfig
    from multigpu.data import ResumableDistributedSampler, build_loader

    for data in (Vectors(), blobs(30, 0)):
        sampler = ResumableDistributedSampler(len(data), rank=1, world_size=2, seed=4)
        sampler.start_at(1, 8)  # mid-epoch, as after a resume
        on = device_data.DeviceData(
            data, TrainConfig(data_on_device="on"), torch.device("cpu"), 2, None, False
        )
        gathered = list(on.batches(sampler, 4, seed=0))
        loaded = list(build_loader(data, torch.device("cpu"), 0, sampler=sampler, batch_size=4))
        assert len(gathered) == len(loaded) == 3  # (30 - 8) // 2 = 11 samples: 4 + 4 + 3
        for mine, theirs in zip(gathered, loaded):
            assert type(mine) is type(theirs)
            for a, b in zip(*((mine, theirs) if isinstance(mine, list) else ([mine], [theirs]))):
                assert torch.equal(a, b) and a.dtype == b.dtype


class Unmarked(Dataset):
    """A user's map-style set that promises nothing about its samples."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((16,), float(index)), index % 4


def plan_data_line(trainer: MultiGPUTrainer) -> str:
    return trainer.plan_facts().data


def test_auto_keeps_the_loader_with_one_line_saying_why(tmp_path: Path, monkeypatch) -> None:
    config = config_for(tmp_path, 1)
    with MultiGPUTrainer(tiny_model(), Unmarked(), None, config) as trainer:
        assert type(trainer.train_loader).__name__ == "DataLoader"
        assert plan_data_line(trainer) == (
            "data: read by the loader: a Unmarked is neither a TensorDataset nor a "
            "set whose samples never change (fixed_samples = True)"
        )
    with MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config) as trainer:
        assert plan_data_line(trainer) == (
            "data: the training set on the device (64 samples, 4.6 kB, already in "
            "this process's memory, used as it is), batches gathered there; the "
            "loader's instead if the first steps measure it faster "
            "(--data-on-device auto)"
        )
    monkeypatch.setattr(device_data, "DEVICE_SHARE", 1e-12)  # no memory to spare for data
    synthetic = SyntheticImages(64, (1, 4, 4), 4)
    with MultiGPUTrainer(tiny_model(), synthetic, None, config) as trainer:
        line = plan_data_line(trainer)
        assert type(trainer.train_loader).__name__ == "DataLoader"
        assert line.startswith(
            "data: read by the loader: its 4.6 kB are more than the 0.0 kB data may take on cpu"
        )
    with pytest.raises(
        UsageError,
        match=r"^--data-on-device on: its 4.6 kB are more than .*; use --data-on-device "
        r"auto \(or off\) to read it with the loader$",
    ):
        MultiGPUTrainer(tiny_model(), synthetic, None, config_for(tmp_path, 1, data_on_device="on"))


@pytest.mark.slow
def test_the_cli_says_where_the_data_comes_from_and_on_refuses_what_cannot_be_gathered(
    tmp_path: Path,
) -> None:
    result = run_cli([*TINY, "--epochs", "1", "--save-dir", str(tmp_path / "run")])
    assert_ok(result)
    assert (
        "data: the training set on the device (512 samples, 1.6 MB, read once into this process's memory), "
        "batches gathered there; the loader's instead if the first steps measure it faster (--data-on-device "
        "auto)"
    ) in result.stdout.splitlines()
    folder = image_folder(tmp_path / "images", {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    refused = run_cli(
        [
            "--dataset",
            "imagefolder",
            "--data-dir",
            str(folder),
            "--image-shape",
            "3,8,8",
            "--data-on-device",
            "on",
            "--epochs",
            "1",
            "--save-dir",
            str(tmp_path / "refused"),
        ]
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --data-on-device on: a ImageFolder is neither a TensorDataset nor a set whose samples never change "
        "(fixed_samples = True); use --data-on-device auto (or off) to read it with the loader"
    ]
    assert not (tmp_path / "refused" / "last.pt").exists()


@pytest.mark.slow
def test_the_benchmark_prints_both_ways_in_one_run_with_identical_weights_unless_augmented(
    tmp_path: Path,
) -> None:
    """benchmarks/data_on_device.py at toy sizes: the CIFAR-sized tensors, plain and cropped and flipped (the read-once
    sets' identity is the tests' above); the speeds are the benchmark's figures, not this test's."""
    output = tmp_path / "table.md"
    result, raw = run_benchmark(
        "data_on_device.py",
        tmp_path,
        "--rounds",
        "1",
        "--steps",
        "4",
        "--batch",
        "8",
        "--log-every",
        "2",
        "--cifar-size",
        "64",
        "--only",
        "3,4",
        "--output",
        str(output),
    )
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")[1:]
        for line in output.read_text().splitlines()
        if line.startswith("| ") and "samples/s" not in line
    }
    assert list(rows) == ["CIFAR-sized tensors, cnn", "CIFAR-sized tensors + crop and flip, cnn"]
    assert [cells[-1] for cells in rows.values()] == ["identical |", "differ |"]
    assert all(run["samples_per_sec"] > 0 for runs in raw.values() for run in runs) and len(raw) == 4
    assert "--data-on-device against the loader" in result.stdout
