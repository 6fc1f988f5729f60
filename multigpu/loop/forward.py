"""How a batch of any structure becomes outputs, targets and a loss (its structure itself: data/batches.py).

A batch is an `(inputs, targets)` pair, a dict (Hugging Face style), or any
nesting of tuples, lists and dicts of tensors. The trainer's way through the
model without a `forward_fn` (`fitted_forward`) reads the model's `forward`
signature once, as Hugging Face's Trainer does:

- `(inputs, targets)`: `model(inputs)`, whatever `inputs` is, as a hand-written
  loop does; a dict `inputs` is spread as keywords only when its keys are
  `forward`'s parameters (`model(**inputs)`);
- a dict: `model(**batch)` with only the keys `forward` accepts, and the
  targets are its "labels"/"label"/"targets"/"target"/"y" entry;
- either way, a `forward` with a targets parameter (`targets`, `labels`,
  `target`, `y`, nanoGPT's `forward(idx, targets=None)`) is given the targets.

The loss is the model's own when its outputs carry one (`outputs.loss`,
`outputs["loss"]`, or the scalar tensor of a tuple such as nanoGPT's
`(logits, loss)`), and then `loss_fn` is not applied; else
`loss_fn(outputs, targets)`. Anything else is one ValueError at the first batch
naming the `forward_fn=lambda model, batch: (outputs, targets)` that would fit
(docs/data.md, "Your own task").
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F

from multigpu.data.batches import sample_batch
from multigpu.errors import UsageError
from multigpu.parallel import lora

LABEL_KEYS = ("labels", "label", "targets", "target", "y")  # where a dict batch keeps its targets
TARGET_PARAMETERS = ("targets", "labels", "target", "y")  # a forward parameter that takes the targets
ForwardFn = Callable[[torch.nn.Module, Any], tuple[Any, Any]]


class ModelForward:
    """The way through one model without a `forward_fn`: its `forward` signature, read once here, decides what
    each batch passes to it (the module docstring). Called per step: no inspection there, a few set operations.

    `ModelForward(None)` knows no signature: pairs go in as `model(inputs)` (`model(**inputs)` for dict
    inputs) and dicts as `model(**batch)`, every key passed (`default_forward`).
    """

    def __init__(self, model: Any) -> None:
        self.signature = _signature(model)
        params = list(self.signature.parameters.values()) if self.signature is not None else []
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.names = frozenset(p.name for p in named)
        self.any_keyword = self.signature is None or any(p.kind is p.VAR_KEYWORD for p in params)
        # Every key goes in only to a forward(**kwargs) that names none: beside named parameters, Hugging Face's
        # Trainer, too, passes only the named ones.
        self.every_key = self.any_keyword and not self.names
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.first = positional[0] if positional else None  # the parameter `model(inputs)` fills
        self.takes_inputs = bool(positional) or any(p.kind is p.VAR_POSITIONAL for p in params)
        # The parameter that takes the targets (nanoGPT's `targets`, Hugging Face's `labels`), never the inputs'.
        self.target = next(
            (name for name in TARGET_PARAMETERS if name in self.names and name != self.first), None
        )
        self.required = [p.name for p in named if p.default is p.empty and p.name != self.target]
        self.checked = self.signature is None
        # A transformers model builds a key/value cache at every forward unless told not to (its config's
        # use_cache, on by default for generation): a training step has no use for it, and Hugging Face's
        # Trainer turns it off too. Given per call, so the model's own config (and its saved config.json) stays.
        uses_cache = hasattr(getattr(plain_module(model), "config", None), "use_cache")
        self.no_cache = (
            {"use_cache": False} if uses_cache and ("use_cache" in self.names or self.every_key) else {}
        )

    def __call__(self, model: Any, batch: Any) -> tuple[Any, Any]:
        if (
            not self.checked
        ):  # the first batch: anything the signature cannot take is one clear error, not a TypeError
            self.check(batch)
            self.checked = True
        if (
            isinstance(batch, (list, tuple)) and len(batch) == 2
        ):  # checked first: the usual batch, and the cheap test
            inputs, targets = batch
            if type(inputs) is torch.Tensor or not isinstance(inputs, Mapping) or not self.spreads(inputs):
                if self.target is None or targets is None:
                    return model(inputs, **self.no_cache), targets
                return model(inputs, **{self.target: targets}, **self.no_cache), targets
            return model(**self.keywords(inputs, targets)), targets
        if isinstance(batch, Mapping):
            targets = next((batch[key] for key in LABEL_KEYS if key in batch), None)
            return model(**self.keywords(batch, targets)), targets
        raise BatchMismatch(
            self.mismatch(
                batch, "a batch must be an (inputs, targets) pair or a dict", "(model(...), targets)"
            )
        )

    def spreads(self, inputs: Mapping) -> bool:
        """Whether dict inputs are keyword arguments: their keys name `forward`'s parameters, the required ones
        included; else the dict is one argument, as `model(inputs)` in a hand-written loop."""
        if self.signature is None:
            return True
        given = self.names.intersection(inputs)
        return bool(given or self.any_keyword) and all(name in given for name in self.required)

    def keywords(self, values: Mapping, targets: Any) -> dict[str, Any]:
        """The entries of `values` that `forward` accepts, and the targets where it takes them."""
        kwargs = (
            dict(values)
            if self.every_key
            else {key: value for key, value in values.items() if key in self.names}
        )
        if self.target is not None and targets is not None and self.target not in kwargs:
            kwargs[self.target] = targets
        if self.no_cache and "use_cache" not in kwargs:
            kwargs.update(self.no_cache)
        return kwargs

    def check(self, batch: Any) -> None:
        """BatchMismatch (a ValueError) where `forward` needs what the batch does not give."""
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            inputs, targets = batch
            if isinstance(inputs, Mapping) and self.spreads(inputs):
                return
            missing = [name for name in self.required if name != self.first]
            if not self.takes_inputs or missing:
                needs = ", ".join(missing) or "its inputs as a positional argument"
                raise BatchMismatch(
                    self.mismatch(
                        batch,
                        f"forward needs {needs}, which model(inputs) does not give",
                        "(model(...), batch[1])",
                    )
                )
        elif isinstance(batch, Mapping):
            missing = [name for name in self.required if name not in batch]
            if missing:
                raise BatchMismatch(
                    self.mismatch(
                        batch,
                        f"forward needs {', '.join(missing)}, which the batch's keys do not give",
                        "(model(...), batch[...])",
                    )
                )

    def mismatch(self, batch: Any, problem: str, fits: str) -> str:
        """One line: what is wrong, the batch's structure, the signature, and the forward_fn that would fit."""
        fitted = (
            f" to fit the model's forward{_plain_signature(self.signature)}"
            if self.signature is not None
            else ""
        )
        return (
            f"{problem}, got {describe(batch)}; pass forward_fn=lambda model, batch: {fits}{fitted} "
            f'(docs/data.md, "Your own task")'
        )


def plain_module(model: Any) -> Any:
    """The module inside DDP, DataParallel and torch.compile's wrapper, and the model a PeftModel adapts (--lora-r:
    its forward, its loss and whether it shifts labels are that model's)."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
        if inner is None and isinstance(
            model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
        ):
            inner = model.module
        if inner is None and lora.is_adapted(model):
            inner = lora.base_of(model)
        if inner is None:
            return model
        model = inner


def _signature(model: Any) -> inspect.Signature | None:
    """The signature of the plain module's `forward` (under DDP, DataParallel or torch.compile), None if unknown."""
    if model is None:
        return None
    model = plain_module(model)
    try:
        return inspect.signature(getattr(model, "forward", model))
    except (TypeError, ValueError):  # a builtin without one: the plain pair/dict handling
        return None


def _plain_signature(signature: inspect.Signature) -> inspect.Signature:
    """`signature` without annotations: `(idx, targets=None)`, short enough for one line."""
    return signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )


def describe(batch: Any) -> str:
    """A batch's structure in words: `a dict with keys input_ids, label`, `a tuple of (Tensor, Tensor)`."""
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {', '.join(map(str, batch))}"
    if isinstance(batch, (list, tuple)):
        return f"a {type(batch).__name__} of ({', '.join(_kind(item) for item in batch)})"
    return f"a {type(batch).__name__}"


def _kind(item: Any) -> str:
    return f"dict with keys {', '.join(map(str, item))}" if isinstance(item, Mapping) else type(item).__name__


def fitted_forward(model: torch.nn.Module) -> ModelForward:
    """The trainer's default `forward_fn` for `model`, fitted to its `forward` signature."""
    return ModelForward(model)


default_forward = ModelForward(
    None
)  # (outputs, targets) of a pair or dict batch, for a model not known in advance


def own_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned with its outputs (Hugging Face's `.loss`/`["loss"]`, the scalar tensor of
    nanoGPT's `(logits, loss)`), or None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    if type(outputs) is tuple or type(outputs) is list:
        index = _loss_index(outputs)
        return None if index is None else outputs[index]
    return getattr(outputs, "loss", None)


def _loss_index(outputs: tuple | list) -> int | None:
    """Where a tuple of outputs holds the batch's loss: its one 0-dim floating-point tensor."""
    scalars = [
        index
        for index, item in enumerate(outputs)
        if isinstance(item, torch.Tensor) and item.dim() == 0 and item.is_floating_point()
    ]
    return scalars[0] if len(scalars) == 1 and len(outputs) > 1 else None


def without_loss(outputs: Any) -> Any:
    """The outputs that belong to samples: all of them but the batch's loss (a `(logits, loss)` or nanoGPT's
    `(logits, None)` pair gives the logits alone)."""
    if isinstance(outputs, Mapping) and "loss" in outputs:
        return {key: value for key, value in outputs.items() if key != "loss"}
    if type(outputs) is tuple or type(outputs) is list:
        index = _loss_index(outputs)
        if index is None and len(outputs) == 2 and outputs[1] is None:
            index = 1
        if index is not None:
            rest = [item for position, item in enumerate(outputs) if position != index]
            return rest[0] if len(rest) == 1 else type(outputs)(rest)
    return outputs


def predictions(outputs: Any) -> Any:
    """What metrics compare with the targets: `.logits`/["logits"] when the outputs carry them, else the
    outputs less the batch's loss."""
    if isinstance(outputs, Mapping):
        return outputs.get("logits", outputs)
    logits = getattr(outputs, "logits", None)
    return without_loss(outputs) if logits is None else logits


def compute_loss(
    outputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None
) -> torch.Tensor:
    """The model's own loss, else `loss_fn(outputs, targets)`."""
    loss = None if isinstance(outputs, torch.Tensor) else own_loss(outputs)  # a plain tensor carries no loss
    if loss is not None:
        return loss
    if loss_fn is None or targets is None:
        raise ValueError(
            "the model returned no loss and the batch has no targets to compare with: give the batch "
            f"a {'/'.join(LABEL_KEYS[:2])} entry, or a forward_fn that returns (outputs, targets)"
        )
    return loss_fn(outputs, targets)


class BatchMismatch(UsageError, ValueError):
    """Outputs and targets that the loss cannot compare as meant: one line and exit 2 under the command line
    (main_guarded), and a ValueError for Python code that catches those."""


# torch's losses that compare outputs and targets value by value: given other shapes they broadcast (with only
# a UserWarning), so (N, 1) outputs against (N,) targets compare every output with every target.
ELEMENTWISE_LOSSES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss)
ELEMENTWISE_LOSS_FUNCTIONS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)


def check_first_batch(outputs: Any, targets: Any, loss_fn: Any) -> None:
    """One clear BatchMismatch where class-index targets do not fit the model's class count, where cross-entropy
    gets floating-point targets that are no class probabilities (labels stored as floats), or where a
    value-by-value loss (MSE, L1, Huber) would broadcast outputs and targets of different shapes.

    Checked once, on the first batch (one host sync at start): later the same
    mistake would surface as an IndexError deep inside the loss, or train on the wrong numbers.
    """
    logits = predictions(outputs)
    if (
        not (isinstance(logits, torch.Tensor) and isinstance(targets, torch.Tensor))
        or own_loss(outputs) is not None
    ):
        return
    cross_entropy = isinstance(loss_fn, torch.nn.CrossEntropyLoss) or loss_fn is F.cross_entropy
    if cross_entropy and targets.is_floating_point() and targets.shape != logits.shape:
        raise BatchMismatch(
            f"targets of dtype {str(targets.dtype).replace('torch.', '')} and shape "
            f"{tuple(targets.shape)} for outputs of shape {tuple(logits.shape)}: cross-entropy (the "
            f"default loss_fn) takes class indices, integers (e.g. targets.long() in the data set), "
            f"or class probabilities of the outputs' shape; for real-valued targets pass a loss_fn "
            f"such as torch.nn.MSELoss()"
        )
    if cross_entropy and logits.dim() == 2 and not targets.is_floating_point():
        if targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
            raise BatchMismatch(
                f"targets of shape {tuple(targets.shape)} do not fit outputs of shape "
                f"{tuple(logits.shape)}: cross-entropy needs one class index per sample"
            )
        top = int(targets.max()) if targets.numel() else -1
        if top >= logits.shape[1] or (targets.numel() and int(targets.min()) < 0):
            raise BatchMismatch(
                f"target class {top} does not fit the model's {logits.shape[1]} outputs: build the "
                f"model with as many outputs as the data set has classes"
            )
    elementwise = isinstance(loss_fn, ELEMENTWISE_LOSSES) or any(
        loss_fn is f for f in ELEMENTWISE_LOSS_FUNCTIONS
    )
    if elementwise and logits.shape != targets.shape:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise BatchMismatch(
            f"outputs of shape {tuple(logits.shape)} and targets of shape {tuple(targets.shape)} "
            f"differ: {name} would broadcast them and compare every output with every target; give "
            f"them one shape (e.g. outputs.squeeze(-1) in a forward_fn, or targets of shape "
            f"{tuple(logits.shape)} from the data set)"
        )


def stand_in_forward(
    forward: Callable[[torch.nn.Module, Any], Any],
    model: torch.nn.Module,
    dataset: Any,
    collate_fn: Callable | None,
    move: Callable[[Any], Any],
) -> None:
    """A forward of the data set's first sample whose result is dropped: a rank with no batch of its own in an
    evaluation or prediction round runs it, since every forward of a sharded model is a collective."""
    forward(model, move(sample_batch(dataset, 1, collate_fn)))
