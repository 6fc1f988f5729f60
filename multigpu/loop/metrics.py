"""Evaluation metrics that reduce exactly across ranks.

A metric is a function `(outputs, targets) -> per-sample values` (a tensor with
one value per sample) or `-> (sum, count)`. Evaluation adds up sums and counts
over every batch and rank and divides once at the end, never a mean of means,
so any world size gives the single-process numbers (docs/data.md,
"Exact evaluation").

Built-ins: `acc` (top-1 accuracy; also spelt `accuracy`), `acc_top5` (any k:
`acc_topK`, also `topK`), `mse`, `mae`. Without a choice: class scores (N, C)
with integer targets get `acc`; outputs shaped like their targets get `mse`
and `mae`; anything else gets the loss alone. The loss is always computed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Union

import torch

Metric = Callable[[Any, Any], Union[torch.Tensor, tuple[Any, Any]]]
MetricsSpec = Union[None, Sequence[Union[str, Metric]], Mapping[str, Union[str, Metric]]]
LOWER_IS_BETTER = ("loss", "mse", "mae", "error", "perplexity")
COUNTS = ("count", "tokens")  # what an evaluation counted, beside its metrics: never logged as val_count


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """1.0 where the top-scoring class is the target, per sample."""
    return (outputs.argmax(-1) == targets).double()


def top_k_accuracy(k: int) -> Metric:
    """1.0 where the target is among the k top-scoring classes, per sample."""

    def metric(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top = outputs.topk(min(k, outputs.shape[-1]), dim=-1).indices
        return (top == targets.unsqueeze(-1)).any(-1).double()

    return metric


def _errors(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # (N, 1) outputs against (N,) targets would broadcast to N x N: compare them sample by sample.
    targets = targets.reshape(outputs.shape) if targets.numel() == outputs.numel() else targets
    return (outputs.double() - targets.double()).reshape(outputs.shape[0], -1)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Squared error, averaged over each sample's values."""
    return _errors(outputs, targets).pow(2).mean(1)


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Absolute error, averaged over each sample's values."""
    return _errors(outputs, targets).abs().mean(1)


def builtin(name: str) -> Metric:
    """The built-in metric called `name`; ValueError naming the choices otherwise."""
    if name in ("acc", "accuracy"):
        return accuracy
    if name in ("mse", "mae"):
        return {"mse": mse, "mae": mae}[name]
    top = re.fullmatch(r"(?:acc_)?top(\d+)", name)
    if top:
        return top_k_accuracy(int(top.group(1)))
    raise ValueError(
        f"unknown metric {name!r}: built-ins are acc, acc_topK (e.g. acc_top5), mse, mae; "
        f"or pass a function (outputs, targets) -> per-sample values"
    )


def key_of(name: str) -> str:
    """The result key of a built-in's name: accuracy -> acc, top5 -> acc_top5."""
    top = re.fullmatch(r"(?:acc_)?top(\d+)", name)
    return "acc" if name == "accuracy" else f"acc_top{top.group(1)}" if top else name


def resolve(spec: MetricsSpec, outputs: Any, targets: Any) -> dict[str, Metric]:
    """{result key: metric} for `spec`, or the defaults for outputs/targets like these."""
    if spec is None:
        return {name: builtin(name) for name in default_names(outputs, targets)}
    items = spec.items() if isinstance(spec, Mapping) else ((None, metric) for metric in spec)
    chosen: dict[str, Metric] = {}
    for name, metric in items:
        if isinstance(metric, str):
            if metric == "loss":
                continue  # always computed
            name, metric = name or key_of(metric), builtin(metric)
        chosen[name or str(getattr(metric, "__name__", f"metric{len(chosen)}"))] = metric
    return chosen


def default_names(outputs: Any, targets: Any) -> list[str]:
    """acc for class scores with class-index targets; mse and mae for outputs shaped like targets."""
    if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return []
    if (
        outputs.dim() == 2
        and outputs.shape[1] > 1
        and targets.dim() == 1
        and not targets.is_floating_point()
        and not targets.is_complex()
        and targets.dtype != torch.bool
    ):
        return ["acc"]
    if outputs.numel() == targets.numel() and outputs.is_floating_point() and targets.is_floating_point():
        return ["mse", "mae"]
    return []


def sum_and_count(metric: Metric, outputs: Any, targets: Any) -> tuple[torch.Tensor, Any]:
    """A metric's (sum, count) for one batch, whichever form it returns."""
    value = metric(outputs, targets)
    if isinstance(value, tuple):
        total, count = value
        return torch.as_tensor(total, dtype=torch.float64), count
    value = torch.as_tensor(value)
    return value.double().sum(), value.numel()


def lower_is_better(name: str) -> bool:
    """Direction of a monitored metric inferred from its name: losses and errors go down."""
    return any(word in name for word in LOWER_IS_BETTER)


class Monitor:
    """Which validation metric picks best.pt and which way is better: timm's eval_metric and decreasing."""

    def __init__(self, name: str | None, mode: str = "auto"):
        self.name, self.mode = name, mode

    def choose(self, results: Mapping[str, float]) -> str:
        """The monitored name (default val_acc when accuracy is computed, else val_loss; val_loss for a loss over
        tokens, whose accuracy is of single tokens), checked against `results`."""
        by_accuracy = "val_acc" in results and "val_perplexity" not in results
        self.name = self.name or ("val_acc" if by_accuracy else "val_loss")
        self.check(list(results))
        return self.name

    def check(self, names: Sequence[str]) -> None:
        """UsageError unless the monitored name, when one is set, is among `names` (the run's validation results).
        The default is not chosen here: a resumed run may still take its checkpoint's."""
        if self.name is not None and self.name not in names:
            from multigpu.errors import UsageError

            raise UsageError(
                f"--monitor {self.name} is not a validation metric of this run; it has {', '.join(names)}"
            )

    def lower_is_better(self) -> bool:
        """The direction of the monitored metric: --monitor-mode, or from its name."""
        return self.mode == "min" or (self.mode == "auto" and lower_is_better(self.name or ""))

    def new_best(self, metrics: Mapping[str, float], best: float | None) -> float | None:
        """The monitored value of `metrics` when it beats `best` (the best so far; None: nothing yet), else None
        (also without metrics: a run without a validation set)."""
        if not metrics:
            return None
        value = metrics[self.choose(metrics)]
        return value if self.improves(value, best) else None

    def improves(self, value: float, best: float | None) -> bool:
        """Whether `value` beats `best` (None: nothing yet); a NaN never does."""
        lower = self.lower_is_better()
        return math.isfinite(value) and (best is None or (value < best if lower else value > best))
