"""Batches of any structure: moving them to the device, and how one becomes outputs, targets and a loss.

A batch is an `(inputs, targets)` pair, a dict (Hugging Face style), or any
nesting of tuples, lists and dicts of tensors. The default way through the
model (`default_forward`):

- `(inputs, targets)`: `outputs = model(inputs)` (or `model(**inputs)` when inputs is a dict);
- a dict: `outputs = model(**batch)`, and the targets are its "labels"/"label"/"targets"/"target" entry.

The loss is the model's own when its outputs carry one (`outputs.loss` or
`outputs["loss"]`), else `loss_fn(outputs, targets)`. Anything else: pass
`forward_fn=lambda model, batch: (outputs, targets)` to the trainer
(MULTI_GPU_GUIDE.md, "Your own task").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

LABEL_KEYS = ("labels", "label", "targets", "target")
ForwardFn = Callable[[torch.nn.Module, Any], tuple[Any, Any]]


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (non_blocking: pinned host memory overlaps the copy)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {key: to_device(value, device) for key, value in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in `batch`: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = batch_size(value)
        if size >= 0:
            return size
    return -1


def split(batch: Any, sizes: list[int]) -> list[Any]:
    """`batch` cut along its first dimension into consecutive parts of `sizes` samples, each with the
    batch's structure (views, no copies); what is not a tensor is shared by every part."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(sizes))
    if isinstance(batch, Mapping):
        columns = {key: split(value, sizes) for key, value in batch.items()}
        parts = [{key: column[i] for key, column in columns.items()} for i in range(len(sizes))]
        return parts if type(batch) is dict else [type(batch)(part) for part in parts]
    if isinstance(batch, (list, tuple)):
        rows = zip(*(split(value, sizes) for value in batch)) if batch else [()] * len(sizes)
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    return [batch] * len(sizes)


def concat(parts: list[Any]) -> Any:
    """The inverse of `split`: parts of one structure joined along the first dimension of each tensor.

    ValueError for a tensor without a batch dimension (a batch's loss, say): it cannot be
    given back per sample.
    """
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("an output without a batch dimension (a 0-dim tensor) cannot be joined sample by "
                             "sample; return per-sample outputs, or pass a forward_fn that selects them")
        return torch.cat(parts)
    if isinstance(first, Mapping):
        joined = {key: concat([part[key] for part in parts]) for key in first}
        return joined if type(first) is dict else type(first)(joined)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat(list(column)) for column in zip(*parts)))
    if isinstance(first, (list, tuple)):
        return type(first)(concat(list(column)) for column in zip(*parts))
    if first is None or all(part == first for part in parts[1:]):
        return first
    raise ValueError(f"outputs must be tensors or tuples/lists/dicts of them to be joined sample by sample; "
                     f"got {type(first).__name__} values that differ between batches")


def default_forward(model: torch.nn.Module, batch: Any) -> tuple[Any, Any]:
    """(outputs, targets) of a pair or dict batch; one clear ValueError for any other structure."""
    if isinstance(batch, Mapping):
        return model(**batch), next((batch[key] for key in LABEL_KEYS if key in batch), None)
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        inputs, targets = batch
        return (model(**inputs) if isinstance(inputs, Mapping) else model(inputs)), targets
    shape = f"a {type(batch).__name__} of {len(batch)} item(s)" if isinstance(batch, (list, tuple)) \
        else f"a {type(batch).__name__}"
    raise ValueError(f"a batch must be an (inputs, targets) pair or a dict, got {shape}; pass "
                     f"forward_fn=lambda model, batch: (outputs, targets) to say how yours goes through the model")


def own_loss(outputs: Any) -> Optional[torch.Tensor]:
    """The loss a model returned with its outputs (Hugging Face's `.loss`), or None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return getattr(outputs, "loss", None)


def predictions(outputs: Any) -> Any:
    """What metrics compare with the targets: `.logits`/["logits"] when the outputs carry them."""
    if isinstance(outputs, Mapping):
        return outputs.get("logits", outputs)
    logits = getattr(outputs, "logits", None)
    return outputs if logits is None else logits


def compute_loss(outputs: Any, targets: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]]) -> torch.Tensor:
    """The model's own loss, else `loss_fn(outputs, targets)`."""
    loss = own_loss(outputs)
    if loss is not None:
        return loss
    if loss_fn is None or targets is None:
        raise ValueError("the model returned no loss and the batch has no targets to compare with: give the batch "
                         f"a {'/'.join(LABEL_KEYS[:2])} entry, or a forward_fn that returns (outputs, targets)")
    return loss_fn(outputs, targets)


def check_first_batch(outputs: Any, targets: Any, loss_fn: Any) -> None:
    """One clear ValueError where class-index targets do not fit the model's class count.

    Checked once, on the first batch (one host sync at start): later the same
    mistake would surface as an IndexError deep inside the loss.
    """
    logits = predictions(outputs)
    if not (isinstance(logits, torch.Tensor) and isinstance(targets, torch.Tensor)) or own_loss(outputs) is not None:
        return
    if isinstance(loss_fn, torch.nn.CrossEntropyLoss) and logits.dim() == 2 and not targets.is_floating_point():
        if targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
            raise ValueError(f"targets of shape {tuple(targets.shape)} do not fit outputs of shape "
                             f"{tuple(logits.shape)}: cross-entropy needs one class index per sample")
        top = int(targets.max()) if targets.numel() else -1
        if top >= logits.shape[1] or (targets.numel() and int(targets.min()) < 0):
            raise ValueError(f"target class {top} does not fit the model's {logits.shape[1]} outputs: build the "
                             f"model with as many outputs as the data set has classes")
