"""--batch-size auto: the search for the largest batch that fits, tested on the CPU with a model that fails like a
full GPU above a size; the ranks' agreement through a real 2-process gloo group; the one line without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import blobs, config_for, run_ranks, tiny_model
from multigpu.loop.amp import Amp
from multigpu.loop.forward import default_forward
from multigpu.parallel.distributed import Runtime
from multigpu.tuning import batch_size
from train_multi_gpu import MultiGPUTrainer


class OutOfMemoryAbove(torch.nn.Module):
    """The tiny test model, raising what PyTorch raises on a full GPU for batches above `capacity` samples."""

    def __init__(self, capacity: int):
        super().__init__()
        self.net = tiny_model()
        self.capacity = capacity
        self.sizes: list[int] = []

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.sizes.append(inputs.shape[0])
        if inputs.shape[0] > self.capacity:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {inputs.shape[0]} MiB")
        return self.net(inputs)


def checksum(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every weight and every optimizer state tensor, copied."""
    state = [value for values in optimizer.state.values() for value in values.values()]
    return [tensor.detach().clone() for tensor in [*model.state_dict().values(), *state]]


def search(capacity: int, runtime: Runtime, data_size: int = 4000) -> tuple[int, list[int], bool]:
    """measure() on the CPU as the trainer calls it on CUDA: (batch chosen, sizes tried, all state unchanged)."""
    model = OutOfMemoryAbove(capacity)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()  # the optimizer has state: moments and a step count
    before, rng_before = checksum(model, optimizer), torch.get_rng_state()
    lines: list[str] = []
    chosen = batch_size.measure(
        model,
        optimizer,
        default_forward,
        torch.nn.CrossEntropyLoss(),
        Amp(None, "cpu"),
        lambda batch: batch,
        blobs(data_size, 0),
        None,
        runtime,
        lines.append,
    )
    after = checksum(model, optimizer)
    unchanged = (
        len(before) == len(after)
        and all(torch.equal(a, b) for a, b in zip(before, after))
        and torch.equal(torch.get_rng_state(), rng_before)
    )
    assert (
        len(lines) == 1
        and lines[0].startswith(f"--batch-size auto: {chosen} per device (")
        and lines[0].endswith(" fit, less 10%)")
    ), lines
    return chosen, model.sizes, unchanged


def test_the_largest_batch_that_fits_less_10_percent_and_everything_restored():
    chosen, tried, unchanged = search(300, Runtime("none", torch.device("cpu")))
    largest = max(size for size in tried if size <= 300)
    assert 300 * (1 - batch_size.PRECISION) <= largest <= 300 and chosen == int(largest * 0.9)
    assert tried[1:7] == [16, 32, 64, 128, 256, 512]  # (after the set-up step of 4) doubling, then bisection
    assert len(tried) <= 12 and unchanged


def test_largest_fitting_halves_when_the_first_try_fails_and_stops_at_the_data():
    assert batch_size.largest_fitting(lambda size: size <= 5, 1000) == 5
    assert batch_size.largest_fitting(lambda size: False, 1000) == 0
    assert batch_size.largest_fitting(lambda size: True, 40) == 40
    assert batch_size.with_margin(40, 40) == 40 and batch_size.with_margin(100, 400) == 90


def _search_on_rank(rank: int, world_size: int) -> tuple[int, bool]:
    chosen, _, unchanged = search(
        200 if rank == 0 else 70, Runtime("ddp", torch.device("cpu"), rank, rank, world_size, "gloo")
    )
    return chosen, unchanged


def test_ranks_agree_on_the_batch_that_fits_on_all_of_them(tmp_path: Path):
    (chosen0, unchanged0), (chosen1, unchanged1) = run_ranks(_search_on_rank, 2, tmp_path)
    assert chosen0 == chosen1 and 70 * 0.9 * (1 - batch_size.PRECISION) <= chosen0 <= 63
    assert unchanged0 and unchanged1


def test_an_error_that_is_not_out_of_memory_is_raised_not_taken_for_a_full_gpu():
    def broken(model, batch):
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        batch_size.measure(
            tiny_model(),
            torch.optim.SGD(tiny_model().parameters(), lr=0.1),
            broken,
            None,
            Amp(None, "cpu"),
            lambda batch: batch,
            blobs(64, 0),
            None,
            Runtime("none", torch.device("cpu")),
            print,
        )


def test_without_cuda_auto_says_so_in_one_line_and_trains_with_the_default_batch(tmp_path: Path, capsys):
    config = config_for(tmp_path, 1, batch_size="auto", epochs=1, lr_scaling="linear")
    trainer = MultiGPUTrainer(tiny_model(), blobs(128, 0), None, config)
    assert capsys.readouterr().out.splitlines()[0] == (
        "--batch-size auto needs a CUDA device (it measures GPU memory): using the default --batch-size 64"
    )
    assert trainer.config.batch_size == 64 and trainer.loader_batch == 64
    assert trainer.lr == pytest.approx(0.01 * 64 / 32)  # LR scaling applies to the batch chosen
    trainer.fit()
    saved = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert saved["config"]["batch_size"] == 64 and saved["global_step"] == 2
