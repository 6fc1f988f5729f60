"""MultiGPUTrainer.predict (multigpu/loop/prediction.py): every sample once, in dataset order, bit-identical to one
process for 1, 2 and 3 real gloo processes; in memory on every rank, or streamed to a file by rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset, TensorDataset

from conftest import blobs, config_for, run_ranks, tiny_model
from multigpu.loop import prediction
from train_multi_gpu import MultiGPUTrainer

SET_SIZES = (1, 7, 101)  # one sample, fewer than a batch, a prime number of them


class DictOutputs(nn.Module):
    """A two-head model returning a dict: logits, a tuple of per-sample features, and the batch's (0-dim) loss,
    which is no output; predict() keeps every other key, not the logits alone."""

    def __init__(self) -> None:
        super().__init__()
        self.body = tiny_model()

    def forward(self, inputs: torch.Tensor) -> dict[str, Any]:
        hidden = self.body[1](self.body[0](inputs))
        logits = self.body[2](hidden)
        return {"logits": logits, "features": (hidden, inputs.sum(1)), "loss": logits.sum()}


def _models() -> dict[str, nn.Module]:
    models = {"tensor": tiny_model(), "dict": DictOutputs()}
    for model in models.values():
        model.train()  # predict() must switch to eval mode and back
    return models


def _predict_everything(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    """For each model and set size: the in-memory result on this rank, and the streamed file (rank 0 reads it).

    The streamed run uses chunks of a few batches, so the file is written in many pieces.
    """
    results: dict[str, Any] = {}
    for name, model in _models().items():
        trainer = MultiGPUTrainer(model, blobs(64, 0), None, config_for(tmp_path, world_size, batch_size=4))
        for size in SET_SIZES:
            results[f"{name}/{size}"] = trainer.predict(blobs(size, size))
            assert trainer.model.training
            path = tmp_path / f"{name}-{size}-{world_size}.predictions"
            prediction.CHUNK_SAMPLES = 2 * 4 * world_size  # two rounds of batches per chunk
            try:
                assert trainer.predict(blobs(size, size), output_path=str(path)) is None
            finally:
                prediction.CHUNK_SAMPLES = 8192
            if rank == 0:
                results[f"{name}/{size}/file"] = prediction.load_predictions(str(path))
                assert not path.with_name(path.name + ".partial").exists()
    return results


def assert_same(actual: Any, expected: Any) -> None:
    """Bit-identical tensors in the same structure."""
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    else:
        assert len(actual) == len(expected)
        for left, right in zip(actual, expected):
            assert_same(left, right)


@pytest.mark.slow
def test_predict_on_1_2_and_3_processes_equals_one_process_exactly_in_memory_and_streamed(tmp_path):
    single = _predict_everything(0, 1, tmp_path / "single")
    for name, model in _models().items():
        for size in SET_SIZES:
            inputs = blobs(size, size).tensors[0]
            with torch.no_grad():
                direct = model.eval()(inputs)
            result = single[f"{name}/{size}"]
            if name == "tensor":
                assert result.shape == (size, 4)
                torch.testing.assert_close(result, direct)  # the model's outputs, in dataset order
            else:
                assert list(result) == ["logits", "features"] and result["features"][1].shape == (size,)
                torch.testing.assert_close(result["logits"], direct["logits"])
                torch.testing.assert_close(result["features"][1], direct["features"][1])
            assert_same(single[f"{name}/{size}/file"], result)
    for world_size in (2, 3):
        for rank, ranks_results in enumerate(run_ranks(_predict_everything, world_size, tmp_path, tmp_path)):
            for key, expected in single.items():
                if key.endswith("/file") and rank != 0:
                    assert key not in ranks_results  # only rank 0 holds the streamed outputs
                    continue
                assert_same(ranks_results[key], expected)


def test_dataparallel_mode_on_the_cpu_and_amp_predict_through_the_trainers_own_paths(tmp_path):
    data = blobs(29, 3)
    one_device = MultiGPUTrainer(tiny_model(), blobs(64, 0), data, config_for(tmp_path / "one", 1)).predict()
    dp = MultiGPUTrainer(tiny_model(), blobs(64, 0), data, config_for(tmp_path / "dp", 1, multi_gpu="dp"))
    assert dp.runtime.mode == "none"  # no GPUs: DataParallel falls back to one device
    assert torch.equal(dp.predict(), one_device)
    torch.testing.assert_close(
        dp.predict(batch_size=5), one_device
    )  # other batches, the same samples in order
    bf16 = MultiGPUTrainer(tiny_model(), blobs(64, 0), data, config_for(tmp_path / "bf16", 1, amp="bf16"))
    outputs = bf16.predict()
    assert outputs.dtype == torch.bfloat16  # the training autocast
    torch.testing.assert_close(outputs.float(), one_device, atol=0.1, rtol=0.05)
    assert one_device.device.type == "cpu" and dp.predict(to="meta").device.type == "meta"


class DictSamples(Dataset):
    """Hugging Face style samples: {"x", "labels"}; the model takes them as keywords and returns its own loss."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((16,), float(index)), "labels": torch.tensor(index % 4)}


class OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_batches_of_any_structure_give_their_per_sample_outputs(tmp_path):
    trainer = MultiGPUTrainer(OwnLoss(), DictSamples(), None, config_for(tmp_path, 1, batch_size=3))
    outputs = trainer.predict(DictSamples())  # the outputs' whole structure; the batch's loss is no output
    assert list(outputs) == ["logits"]
    with torch.no_grad():
        torch.testing.assert_close(
            outputs["logits"], trainer.model.net(torch.arange(10.0)[:, None].expand(10, 16))
        )
    plain = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path / "inputs-only", 1))
    inputs = blobs(9, 2).tensors[0]
    assert torch.equal(plain.predict(TensorDataset(inputs)), plain.predict(blobs(9, 2)))  # no targets needed


def test_without_a_dataset_or_with_an_empty_one_predict_says_so(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1))
    with pytest.raises(ValueError, match="predict\\(\\) needs a dataset"):
        trainer.predict()
    with pytest.raises(ValueError, match="empty data set"):
        trainer.predict(blobs(0, 0))


def test_a_predictions_file_that_is_not_one_or_is_cut_short_is_refused(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1))
    path = tmp_path / "out.predictions"
    trainer.predict(blobs(20, 1), output_path=str(path))
    path.with_name("cut").write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="is truncated"):
        prediction.load_predictions(str(path.with_name("cut")))
    path.with_name("text").write_text("index,predicted\n")
    with pytest.raises(ValueError, match="is not a predictions file"):
        prediction.load_predictions(str(path.with_name("text")))


def test_a_transformers_models_predictions_are_its_tensors_not_its_cache(tmp_path):
    from conftest import TokenDicts, tiny_gpt2

    trainer = MultiGPUTrainer(tiny_gpt2(), TokenDicts(8, 0), None, config_for(tmp_path, 1, batch_size=4))
    outputs = trainer.predict(TokenDicts(6, 1))  # GPT-2 also returns past_key_values, a cache object
    assert list(outputs) == ["logits"] and outputs["logits"].shape == (6, 12, 32)
