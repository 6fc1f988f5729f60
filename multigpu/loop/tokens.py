"""Losses over tokens: which targets are token ids, how many a step counts, and each micro-batch's share.

A language model's samples hold different numbers of target tokens (padding and the ignore index -100, as
Hugging Face's collators write them). Weighting each micro-batch's mean loss by its samples, right for
images, gives a sample of 3 target tokens the weight of one of 300, and the result changes with the batch
size, the accumulation steps and the world size. With `--loss-weighting tokens` a step's loss is the mean
over every counted token of the step (all micro-batches of the window, all ranks), as Hugging Face's Trainer
computes it since transformers 4.46 (`num_items_in_batch`); `auto` picks it for token targets
(docs/language-models.md, "Losses over tokens"):

- the window's micro-batches are fetched before its first forward, their counted targets (`labels != -100`,
  for a causal LM that shifts its labels itself the shifted ones) summed, and the sum over the ranks started
  as one small all-reduce that the first forward overlaps;
- each micro-batch's loss is its token-loss sum over the step's count, times the ranks whose gradients DDP
  and FSDP average: a model whose `forward` takes `num_items_in_batch` gets the count and returns that itself,
  a `loss_fn(outputs, targets, num_items=...)` likewise; a loss with a `reduction` is summed; a model's own
  mean loss is multiplied back by its micro-batch's count.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch

from multigpu.data.batches import sample_batch
from multigpu.errors import UsageError
from multigpu.loop.forward import LABEL_KEYS, ModelForward, check_first_batch, own_loss, plain_module
from multigpu.parallel.distributed import start_all_reduce_sum

IGNORE_INDEX = -100  # the target that counts nowhere: PyTorch's cross-entropy default, Hugging Face's padding


class SequenceCrossEntropy(torch.nn.CrossEntropyLoss):
    """The trainer's default loss: cross-entropy, also for class scores in the last dimension of a sequence,
    (B, T, V) logits against (B, T) token ids, which torch's own reads as (B, C=T, ...) and refuses."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() > 2 and input.dim() == target.dim() + 1 and input.shape[:-1] == target.shape:
            return super().forward(input.flatten(0, -2), target.flatten())
        return super().forward(input, target)


def targets_in(batch: Any) -> torch.Tensor | None:
    """The targets a batch holds before any forward: the second of an (inputs, targets) pair, or a dict's
    `shift_labels` (already shifted, as Hugging Face's padding-free collators give them) or labels entry."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        found = batch[1]
    elif isinstance(batch, Mapping):
        found = next((batch[key] for key in ("shift_labels", *LABEL_KEYS) if key in batch), None)
    else:
        found = None
    return found if isinstance(found, torch.Tensor) else None


def are_tokens(targets: torch.Tensor | None) -> bool:
    """Token ids: integer targets with a sequence dimension, or holding the ignore index (one host sync: read
    once, when the weighting is decided)."""
    if targets is None or targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return False
    return targets.dim() >= 2 or bool((targets == IGNORE_INDEX).any())


def shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model shifts its labels itself (position t predicts label t + 1): a transformers model whose
    loss is the causal LM's, named so (`loss_type`) or listed among the causal LMs (GPT2LMHeadModel's loss_type
    is None, and transformers then uses the causal LM's loss all the same), and no encoder-decoder."""
    module = plain_module(model)
    if not from_transformers(module):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    loss_type = getattr(module, "loss_type", None)
    named = loss_type is not None and LOSS_MAPPING.get(loss_type) is ForCausalLMLoss
    listed = any(cls.__name__ in causal_names for cls in type(module).__mro__)
    return (named or listed) and not getattr(getattr(module, "config", None), "is_encoder_decoder", False)


def from_transformers(module: torch.nn.Module) -> bool:
    """A transformers model, or a class built on one (FSDP's and users' subclasses)."""
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def takes_num_items(model: torch.nn.Module) -> bool:
    """Whether `forward` takes `num_items_in_batch`: named, or a transformers model that accepts loss keywords
    (its `accepts_loss_kwargs`, else a `**kwargs`: the Trainer's rule)."""
    module = plain_module(model)
    parameters = inspect.signature(module.forward).parameters
    if "num_items_in_batch" in parameters:
        return True
    if not from_transformers(module):
        return False
    if hasattr(module, "accepts_loss_kwargs"):
        return bool(module.accepts_loss_kwargs)
    return any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values())


class LossWeighting:
    """Whether a loss is a mean over samples or over tokens (--loss-weighting), decided once from a batch's
    targets under `auto`, and how a batch's tokens are counted. The step and the evaluation share it."""

    def __init__(self, setting: str, model: torch.nn.Module):
        self.setting = setting  # auto, samples or tokens: TrainConfig checked it
        self.mode: str | None = None if setting == "auto" else setting  # None: auto, not decided yet
        self.shift = shifts_labels(model)

    @property
    def tokens(self) -> bool:
        return self.mode == "tokens"

    def decide(self, batch: Any) -> str:
        """The mode for batches like `batch` (decided at the first call under auto); UsageError where tokens are
        asked for and the batch shows no targets to count."""
        targets = targets_in(batch)
        if self.mode is None:
            self.mode = "tokens" if are_tokens(targets) else "samples"
        if self.tokens and targets is None:
            raise UsageError(
                "--loss-weighting tokens counts the targets before the forward, and the batch shows "
                "none: give (inputs, targets) pairs or a dict with a labels entry, or use "
                "--loss-weighting samples"
            )
        return self.mode

    def counted(self, targets: torch.Tensor) -> torch.Tensor:
        """The targets that count (not the ignore index), shifted as the model shifts them: a device tensor."""
        return (targets[..., 1:] if self.shift else targets).ne(IGNORE_INDEX).sum()

    def describe(self) -> str:
        """The plan line's words."""
        if self.mode is None:
            return "loss weighting auto: decided at the first batch"
        if not self.tokens:
            return f"loss: the mean over samples{' (auto)' if self.setting == 'auto' else ''}"
        chosen = " (auto: the targets are token ids)" if self.setting == "auto" else ""
        shift = ", shifted as the causal LM shifts them" if self.shift else ""
        return (
            f"loss: the mean over the step's target tokens, all micro-batches and ranks{chosen}; -100 "
            f"ignored{shift}"
        )


def _present(targets: torch.Tensor | None) -> torch.Tensor:
    assert targets is not None  # weighted by tokens: every batch holds its targets
    return targets


class WindowTokens:
    """The counted tokens of one step's micro-batches on this rank, and their sum over the ranks, whose
    all-reduce starts here and is waited for at the first `step_total()`."""

    def __init__(self, weighting: LossWeighting, window: list[Any]):
        targets = [_present(targets_in(batch)) for batch in window]
        self.each = [weighting.counted(found) for found in targets]
        self.local = self.each[0] if len(self.each) == 1 else torch.stack(self.each).sum()
        self.positions = sum(found.numel() for found in targets)  # padding included
        self._total = self.local.clone()
        self._work = start_all_reduce_sum(self._total)
        if self._work is None:  # one process: nothing to wait for
            self._total.clamp_(min=1)

    def step_total(self) -> torch.Tensor:
        """The step's counted tokens over every rank, at least 1 (a device tensor: no host sync). A step whose
        targets are all -100 then adds a loss of 0 and no gradient, instead of 0/0."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._total.clamp_(min=1)
        return self._total


class TokenLoss:
    """One micro-batch's forward and its share of the step's loss: its token-loss sum over the step's counted
    tokens, times `ranks` (the processes whose gradients DDP or FSDP average)."""

    def __init__(
        self,
        forward: Callable[[Any, Any], tuple[Any, Any]],
        loss_fn: Any,
        model: torch.nn.Module,
        ranks: int,
        pass_num_items: bool,
    ):
        self.forward, self.loss_fn, self.ranks = forward, loss_fn, ranks
        self.num_items_to_model = (
            pass_num_items and isinstance(forward, ModelForward) and takes_num_items(model)
        )
        self.num_items_to_loss = _takes_keyword(loss_fn, "num_items")
        self.summed = _summed(loss_fn)
        self.checked = False

    def __call__(self, model: torch.nn.Module, batch: Any, tokens: WindowTokens, index: int) -> torch.Tensor:
        total = tokens.step_total() if self.num_items_to_model else None
        if total is not None:  # the model divides by the step's count itself (transformers' loss functions)
            # Only the built-in ModelForward gets the partial (num_items_to_model), and it only calls it.
            model = functools.partial(model, num_items_in_batch=total)  # type: ignore[assignment]  # see above
        outputs, targets = self.forward(model, batch)
        if not self.checked:  # once: a mismatch is one clear line, not an error deep in the loss
            check_first_batch(outputs, targets, self.loss_fn)
            self.checked = True
        own = own_loss(outputs) if not isinstance(outputs, torch.Tensor) else None
        if total is not None and own is not None:
            return own * self.ranks
        total = tokens.step_total()
        if own is not None:  # a mean over the micro-batch's tokens: back to their sum
            return sum_of_mean(own, tokens.each[index]) * (self.ranks / total)
        if self.num_items_to_loss:
            return self.loss_fn(outputs, targets, num_items=total) * self.ranks
        if self.summed is not None:
            return self.summed(outputs, targets) * (self.ranks / total)
        return sum_of_mean(self.loss_fn(outputs, targets), tokens.each[index]) * (self.ranks / total)


def sum_of_mean(mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A mean over `count` tokens back to their sum; 0 for none, where the mean is 0/0 = NaN (a micro-batch whose
    targets are all -100 adds nothing, and its gradient is 0, as cross-entropy's backward gives ignored targets)."""
    return torch.where(count > 0, mean * count, mean.new_zeros(()))


def _takes_keyword(function: Any, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _summed(loss_fn: Any) -> Callable[[Any, Any], torch.Tensor] | None:
    """The loss with reduction='sum' where it has a reduction (torch's losses), else None."""
    if getattr(loss_fn, "reduction", None) != "mean":
        return None
    summed = copy.copy(loss_fn)
    summed.reduction = "sum"
    return summed


def token_accuracy(shift: bool) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Accuracy over the counted tokens: (right, counted) of (B, T, V) scores against (B, T) token ids, or of
    torch's own layout, (B, V, T) (`classes_last`), as the loss reads both; the ignore index left out, the scores
    of position t against the target t + 1 where the model shifts."""

    def metric(scores: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = classes_last(scores, targets)
        if shift:
            scores, targets = scores[..., :-1, :], targets[..., 1:]
        counted = targets.ne(IGNORE_INDEX)
        right = (scores.argmax(-1) == targets) & counted
        return right.sum(), counted.sum()

    metric.__name__ = "acc"
    return metric


def classes_last(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`scores` with the class dimension last: (B, V, T, ...) scores against (B, T, ...) targets, the layout
    `nn.CrossEntropyLoss` takes, moved to (B, T, ..., V); scores already so (their leading dimensions are the
    targets' shape, which decides where both fit) as they are."""
    sequence = scores.dim() == targets.dim() + 1 and scores.dim() > 2
    if not sequence or scores.shape[:-1] == targets.shape:
        return scores
    if scores.shape[0] == targets.shape[0] and scores.shape[2:] == targets.shape[1:]:
        return scores.movedim(1, -1)
    return scores


def token_loss_sum(
    outputs: Any, targets: torch.Tensor, loss_fn: Any, counted: torch.Tensor, shift: bool
) -> torch.Tensor:
    """A batch's token-loss sum for evaluation: the model's own mean loss times its count, else the loss
    summed (a loss with a reduction), else its mean times the count."""
    own = own_loss(outputs) if not isinstance(outputs, torch.Tensor) else None
    if own is not None:
        return sum_of_mean(own.double(), counted)
    summed = _summed(loss_fn)
    if summed is not None and shift and isinstance(outputs, torch.Tensor):
        return summed(outputs[..., :-1, :], targets[..., 1:]).double()
    if summed is not None:
        return summed(outputs, targets).double()
    return sum_of_mean(loss_fn(outputs, targets).double(), counted)


def default_loss() -> torch.nn.Module:
    """The loss of a run given no loss_fn."""
    return SequenceCrossEntropy()


def weighting_for(
    setting: str, model: torch.nn.Module, dataset: Any, collate_fn: Callable | None
) -> LossWeighting:
    """The run's weighting, decided under auto from the first samples of a map-style training set; a stream's
    (which cannot be sampled before training) is decided at its first batch."""
    weighting = LossWeighting(setting, model)
    try:
        batch = sample_batch(dataset, 2, collate_fn)
    except Exception:  # a stream, or a set that reads only in loader workers: decided at the first batch
        return weighting
    weighting.decide(batch)
    return weighting


def token_loss_for(
    forward: Callable[[Any, Any], tuple[Any, Any]],
    loss_fn: Any,
    model: torch.nn.Module,
    mode: str,
    world_size: int,
) -> TokenLoss:
    """The TokenLoss of a run in `mode` (ddp and fsdp average the gradients of `world_size` processes;
    DataParallel's replicas each return a loss, so the model is not handed the step's count there)."""
    ranks = world_size if mode in ("ddp", "fsdp") else 1
    return TokenLoss(forward, loss_fn, model, ranks, pass_num_items=mode != "dp")
