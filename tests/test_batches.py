"""Batches of any structure: moved whole, split into outputs and targets, and refused clearly when they do not fit."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset

from conftest import blobs, config_for, tiny_model
from multigpu.batches import batch_size, check_first_batch, concat, default_forward, split, to_device
from train_multi_gpu import MultiGPUTrainer

Pair = namedtuple("Pair", "inputs targets")


def test_every_tensor_of_a_nested_batch_is_moved_and_the_structure_kept():
    batch = {"a": (torch.ones(3, 2), [torch.zeros(3)]), "b": Pair(torch.ones(3), torch.zeros(3)), "name": "x"}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"][0].device.type == moved["a"][1][0].device.type == moved["b"].targets.device.type == "meta"
    assert isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list) and isinstance(moved["b"], Pair)
    assert moved["name"] == "x"
    assert batch_size(batch) == 3 and batch_size([{"x": torch.ones(5, 1)}]) == 5


def test_a_dict_batch_goes_in_as_keyword_arguments_and_its_labels_are_the_targets():
    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return kwargs["x"] * 2

    outputs, targets = default_forward(model, {"x": torch.ones(2), "labels": torch.tensor([1, 0])})
    assert set(seen) == {"x", "labels"} and outputs.tolist() == [2.0, 2.0] and targets.tolist() == [1, 0]


class InputsOnly(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        return (torch.ones(16),)


def test_a_batch_without_targets_is_one_clear_value_error_at_the_first_step(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), InputsOnly(), None, config_for(tmp_path, 1))
    with pytest.raises(ValueError, match=r"a batch must be an \(inputs, targets\) pair or a dict, got a list of "
                                         r"1 item\(s\); pass forward_fn="):
        trainer.fit()


def test_a_model_with_fewer_outputs_than_classes_is_named_at_the_first_batch(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(classes=3), blobs(32, 0, classes=4), None, config_for(tmp_path, 1))
    with pytest.raises(ValueError, match="target class 3 does not fit the model's 3 outputs"):
        trainer.fit()
    with pytest.raises(ValueError, match=r"targets of shape \(4, 2\) do not fit outputs of shape \(4, 3\)"):
        check_first_batch(torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long), torch.nn.CrossEntropyLoss())


def test_forward_fn_says_how_any_batch_goes_through_the_model(tmp_path):
    data = blobs(64, 0)

    class Triples(Dataset):
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, index: int):
            inputs, target = data[index]
            return {"features": inputs, "weight": 1.0}, "ignored", target

    trainer = MultiGPUTrainer(tiny_model(), Triples(), Triples(), config_for(tmp_path, 1, epochs=3),
                              forward_fn=lambda model, batch: (model(batch[0]["features"]), batch[2]))
    assert trainer.fit()["val_acc"] > 0.9


def test_split_cuts_every_tensor_in_consecutive_parts_and_concat_joins_them_back():
    batch = {"a": (torch.arange(5.0), [torch.arange(10).reshape(5, 2)]), "b": Pair(torch.ones(5), torch.zeros(5)),
             "name": "x"}
    parts = split(batch, [2, 0, 3])
    assert [batch_size(part) for part in parts] == [2, 0, 3]
    assert parts[2]["a"][0].tolist() == [2.0, 3.0, 4.0] and isinstance(parts[1]["b"], Pair)
    assert all(part["name"] == "x" for part in parts)
    joined = concat(parts)
    assert torch.equal(joined["a"][1][0], batch["a"][1][0]) and isinstance(joined["a"][1], list)
    assert isinstance(joined["b"], Pair) and joined["name"] == "x"
    with pytest.raises(ValueError, match="without a batch dimension"):
        concat([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(ValueError, match="values that differ between batches"):
        concat(["first", "second"])
