"""Batches of any structure: moved whole, split into outputs and targets, and refused clearly when they do not fit."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset

from conftest import blobs, config_for, tiny_model
from multigpu.data.batches import batch_size, concat, split, to_device
from multigpu.loop.forward import (
    BatchMismatch,
    check_first_batch,
    compute_loss,
    default_forward,
    fitted_forward,
    predictions,
)
from train_multi_gpu import MultiGPUTrainer

Pair = namedtuple("Pair", "inputs targets")


def test_every_tensor_of_a_nested_batch_is_moved_and_the_structure_kept():
    batch = {"a": (torch.ones(3, 2), [torch.zeros(3)]), "b": Pair(torch.ones(3), torch.zeros(3)), "name": "x"}
    moved = to_device(batch, torch.device("meta"))
    assert (
        moved["a"][0].device.type == moved["a"][1][0].device.type == moved["b"].targets.device.type == "meta"
    )
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
    with pytest.raises(
        ValueError,
        match=r"a batch must be an \(inputs, targets\) pair or a dict, got a list of "
        r"\(Tensor\); pass forward_fn=",
    ):
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

    trainer = MultiGPUTrainer(
        tiny_model(),
        Triples(),
        Triples(),
        config_for(tmp_path, 1, epochs=3),
        forward_fn=lambda model, batch: (model(batch[0]["features"]), batch[2]),
    )
    assert trainer.fit()["val_acc"] > 0.9


class TakesInputIds(torch.nn.Module):  # Hugging Face-style, without labels: forward(input_ids)
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids)


class NanoGPTStyle(TakesInputIds):  # forward(idx, targets=None) -> (logits, loss)
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.net(idx)
        return logits, (None if targets is None else torch.nn.functional.cross_entropy(logits, targets))


class TakesTheDict(TakesInputIds):  # written for `for x, y in loader: model(x)` with dict x
    def forward(self, batch: dict) -> torch.Tensor:  # type: ignore[override]  # the whole dict batch
        return self.net(batch["x"] * batch["scale"])


def test_without_a_forward_fn_the_models_forward_signature_decides_what_each_batch_passes():
    x, y = torch.randn(6, 16), torch.tensor([0, 1, 2, 3, 0, 1])
    model = TakesInputIds()  # a dict batch: only the keys forward accepts; the targets from its label key
    outputs, targets = fitted_forward(model)(
        model, {"input_ids": x, "label": y, "attention_mask": torch.ones(6)}
    )
    assert torch.equal(outputs, model(x)) and targets is y
    model = NanoGPTStyle()
    forward = fitted_forward(torch.nn.DataParallel(model))  # read through the wrapper, from the plain module
    outputs, targets = forward(
        model, (x, y)
    )  # targets go in; the model's loss is the loss, its logits the metrics'
    assert torch.equal(
        compute_loss(outputs, targets, None), torch.nn.functional.cross_entropy(model(x)[0], y)
    )
    assert torch.equal(predictions(outputs), model(x)[0]) and torch.equal(predictions(model(x)), model(x)[0])
    model = TakesTheDict()  # a pair whose inputs is a dict: model(inputs), as a hand-written loop does
    outputs, _ = fitted_forward(model)(model, ({"x": x, "scale": torch.full((6, 1), 2.0)}, y))
    assert torch.equal(outputs, model.net(x * 2))
    model = TakesInputIds()  # ... spread as keywords where its keys are forward's parameters
    outputs, _ = fitted_forward(model)(model, ({"input_ids": x}, y))
    assert torch.equal(outputs, model(x))
    seen = []

    def named_and_more(input_ids: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        seen.append(
            sorted(kwargs)
        )  # beside named parameters, **kwargs gets no other key (Hugging Face's rule)
        return input_ids

    outputs, targets = fitted_forward(named_and_more)(
        named_and_more, {"input_ids": x, "label": y, "extra": x}
    )
    assert outputs is x and targets is y and seen == [[]]
    assert fitted_forward(lambda **kwargs: kwargs)(lambda **kwargs: kwargs, {"a": x, "y": y})[0] == {
        "a": x,
        "y": y,
    }


def test_what_no_signature_can_take_is_one_value_error_naming_batch_signature_and_forward_fn():
    class TwoInputs(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    model = TwoInputs()
    with pytest.raises(
        BatchMismatch,
        match=r"forward needs mask, which model\(inputs\) does not give, got a tuple of "
        r"\(Tensor, Tensor\); pass forward_fn=lambda model, batch: .* to fit the "
        r"model's forward\(x, mask\) \(",
    ):
        fitted_forward(model)(model, (torch.ones(2), torch.ones(2)))
    with pytest.raises(
        ValueError,
        match=r"forward needs mask, which the batch's keys do not give, got a dict with "
        r"keys x, label; pass forward_fn=",
    ):
        fitted_forward(model)(model, {"x": torch.ones(2), "label": torch.ones(2)})


def test_split_cuts_every_tensor_in_consecutive_parts_and_concat_joins_them_back():
    batch = {
        "a": (torch.arange(5.0), [torch.arange(10).reshape(5, 2)]),
        "b": Pair(torch.ones(5), torch.zeros(5)),
        "name": "x",
    }
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
