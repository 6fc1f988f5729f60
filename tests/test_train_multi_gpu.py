"""MultiGPUTrainer through its Python API: a user's own module and data sets, in one and several processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import blobs, config_for, run_ranks, tiny_model
from train_multi_gpu import MultiGPUTrainer


VAL_SIZES = (4, 5, 7, 101)  # not multiples of 2 or 3, one smaller than 2 batches


def _evaluate(rank: int, world_size: int, tmp_path: Path) -> list[dict]:
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, world_size))
    return [trainer.evaluate(blobs(size, 1)) for size in VAL_SIZES]


def test_evaluate_counts_every_sample_once_for_any_world_size(tmp_path):
    single = _evaluate(0, 1, tmp_path)
    assert [result["count"] for result in single] == list(VAL_SIZES)
    assert len({result["acc"] for result in single}) > 1  # the sets differ, so equality below means something
    for world_size in (2, 3):
        for rank_results in run_ranks(_evaluate, world_size, tmp_path, tmp_path):
            assert rank_results == single  # counts, accuracy and loss: bit-identical on every rank


def test_fit_trains_a_users_module_and_returns_final_metrics(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(256, 0), blobs(100, 1), config_for(tmp_path, 1, epochs=3))
    before = trainer.evaluate()
    metrics = trainer.fit()
    assert metrics["epochs"] == 3
    assert metrics["val_acc"] > 0.9 > before["acc"]
    assert metrics["val_loss"] < before["loss"]
    assert metrics["best_val_acc"] >= metrics["val_acc"]
    assert metrics["samples_per_sec"] > 0
    assert trainer.evaluate()["acc"] == metrics["val_acc"]
    assert {"last.pt", "best.pt"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}


def test_bf16_autocast_trains_on_the_cpu(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(256, 0), blobs(100, 1), config_for(tmp_path, 1, amp="bf16"))
    assert trainer.amp_dtype == torch.bfloat16
    assert trainer.fit()["val_acc"] > 0.9


def test_fp16_on_the_cpu_falls_back_to_bf16_with_one_line(tmp_path, capsys):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, amp="fp16", epochs=1))
    assert trainer.amp_dtype == torch.bfloat16
    assert not trainer.scaler.is_enabled()
    lines = [line for line in capsys.readouterr().out.splitlines() if "fp16" in line]
    assert lines == ["--amp fp16 needs a CUDA device; using bf16 autocast on the CPU instead"]
    trainer.fit()  # no validation set: trains and saves without evaluating


def _train_and_return_weights(rank: int, world_size: int, tmp_path: Path) -> dict:
    trainer = MultiGPUTrainer(tiny_model(), blobs(128, 0), blobs(50, 1), config_for(tmp_path / f"w{world_size}",
                                                                                  world_size, epochs=1))
    trainer.fit()
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def test_ddp_ranks_end_with_identical_weights(tmp_path):
    rank0, rank1 = run_ranks(_train_and_return_weights, 2, tmp_path, tmp_path)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
