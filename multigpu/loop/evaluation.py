"""Exact distributed evaluation: every sample once, the same numbers for any world size.

The set is cut into the same fixed batches whatever the world size, and rank r
evaluates batches r, r+W, ... with no padding (DistributedSampler would repeat
samples, docs/data.md "Exact evaluation"). Each batch's sums and counts go
into one row of a table; the table is all-reduced (each row comes from one rank,
the others add zeros) and summed in batch order, so 1, 2 or 3 ranks give
bit-identical numbers. No collective runs per batch, so ranks with one batch
more or less cannot hang. A loss over tokens (--loss-weighting) adds up token-loss sums and counted
tokens the same way: the mean over every token, for any world size and evaluation batch.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from multigpu.data import build_loader
from multigpu.data.batches import batch_size, sample_batch, to_device
from multigpu.data.sampler import ShardedBatchSampler
from multigpu.data.streaming import StreamShard, is_stream
from multigpu.errors import UsageError
from multigpu.loop import metrics as metric_lib
from multigpu.loop import snapshot
from multigpu.loop.amp import Amp
from multigpu.loop.forward import (
    ForwardFn,
    check_first_batch,
    compute_loss,
    own_loss,
    predictions,
    stand_in_forward,
)
from multigpu.loop.tokens import LossWeighting, targets_in, token_accuracy, token_loss_sum
from multigpu.parallel.distributed import Runtime, all_reduce_sum, gather_objects
from multigpu.parallel.wrapping import uncompiled
from multigpu.resilience.preemption import StopRequest

CHECK_SAMPLES = 8  # validation samples that check_names runs through the model at start


class Evaluator:
    """Evaluates a model on a data set: {"loss", each metric, "count"}, exact over ranks. With a loss over
    tokens (`weighting`, multigpu/loop/tokens.py) the loss is the mean over every counted target token, with
    its `perplexity`, the default metric is the accuracy over those tokens, and "tokens" counts them."""

    def __init__(
        self,
        runtime: Runtime,
        amp: Amp,
        forward: ForwardFn,
        loss_fn: Any,
        metrics: metric_lib.MetricsSpec = None,
        num_workers: int | None = None,
        collate_fn: Callable | None = None,
        move: Callable[[Any], Any] | None = None,
        weighting: LossWeighting | None = None,
    ):
        self.runtime, self.amp, self.forward, self.loss_fn = runtime, amp, forward, loss_fn
        self.spec, self.num_workers, self.collate_fn = metrics, num_workers, collate_fn
        # How a batch reaches the device: the trainer's (channels-last batches for a channels-last model).
        self.move = move or functools.partial(to_device, device=runtime.device)
        self.names: list[str] | None = None  # result keys, agreed by all ranks at the first evaluation
        self._metrics: dict[str, metric_lib.Metric] = {}
        self._first_batch_checked = False
        self.classes: int | None = None  # the width of (N, C) class scores: what accuracy at chance means
        self.per_sample_loss = _per_sample(loss_fn)
        self.weighting = weighting

    def check_names(
        self, model: torch.nn.Module, dataset: Dataset | None, monitor: metric_lib.Monitor
    ) -> None:
        """Run the loss and every metric on the first few samples of `dataset`, and look the monitored name up in
        the results they give, so that a wrong name, a failing metric function or a batch without targets stops
        the run before training, not after its first epoch.

        Every rank takes the same samples and runs no collective, so all reach the same verdict. It leaves no
        trace: the RNG states (a random transform), the model's buffers and its mode are restored, and the
        training data order is not touched.
        """
        if dataset is None or is_stream(dataset) or len(dataset) == 0:  # type: ignore[arg-type]  # map-style
            return  # a stream is checked at its first evaluation: reading it here would use up a pass
        with snapshot.kept(model, self.runtime.device), torch.no_grad(), uncompiled():
            try:
                batch = sample_batch(dataset, CHECK_SAMPLES, self.collate_fn)
            except UsageError:
                raise
            except (
                Exception
            ):  # a data set that reads only inside loader workers: checked at the first evaluation
                return
            model.eval()
            self._batch_sums(model, self.move(batch))
        perplexity = ("perplexity",) if self.by_tokens else ()
        monitor.check([f"val_{name}" for name in ("loss", *perplexity, *self._metrics)])

    @torch.no_grad()
    def run(
        self, model: torch.nn.Module, dataset: Dataset, batch_size_: int, stop: StopRequest | None = None
    ) -> dict[str, float] | None:
        """Loss and metrics over every sample of `dataset`; every rank must call it.

        With `stop` (during fit), the ranks agree after each round of batches
        whether SIGTERM/SIGINT reached any of them, and return None at once if so:
        a long validation set cannot outlast torchrun's grace period.
        """
        rt = self.runtime
        if is_stream(dataset):
            return self._run_stream(model, dataset, batch_size_)
        batches = ShardedBatchSampler(len(dataset), batch_size_, rt.rank, rt.world_size)  # type: ignore[arg-type]  # map-style
        loader = iter(
            build_loader(
                dataset, rt.device, self.num_workers, batch_sampler=batches, collate_fn=self.collate_fn
            )
        )
        was_training = model.training
        model.eval()
        rows: dict[int, list[torch.Tensor]] = {}
        try:
            # Round r is batch r*W + rank on each rank: every rank runs the same number of rounds, so the
            # stop vote after each round is a collective all of them reach (a rank may sit the last one out).
            for round_start in range(0, batches.num_batches, rt.world_size):
                row = round_start + rt.rank
                if row < batches.num_batches:
                    rows[row] = self._batch_sums(model, self.move(next(loader)))
                elif rt.forward_is_collective:  # fsdp: the others' forwards wait for this rank's all-gathers
                    with self.amp.autocast():
                        stand_in_forward(self.forward, model, dataset, self.collate_fn, self.move)
                if stop is not None and _agreed(stop.requested, rt):
                    return None
        finally:
            model.train(was_training)
        return self._reduce(rows, batches.num_batches)

    def _run_stream(self, model: torch.nn.Module, dataset: Any, batch_size_: int) -> dict[str, float]:
        """A stream, split over ranks and workers as training splits it, each sample counted once. Ranks may end
        at different batches: no collective until the sums, so no stop vote either."""
        rt = self.runtime
        shard = StreamShard(dataset, rt.rank, rt.world_size, tagged=False)
        loader = build_loader(
            shard,
            rt.device,
            self.num_workers,
            batch_size=batch_size_,
            collate_fn=self.collate_fn,
            persistent_workers=False,
        )
        was_training = model.training
        model.eval()
        try:
            rows = {index: self._batch_sums(model, self.move(batch)) for index, batch in enumerate(loader)}
        finally:
            model.train(was_training)
        sums = [torch.stack(column).sum().reshape(1) for column in zip(*rows.values())]
        return self._reduce({0: [value[0] for value in sums]} if sums else {}, 1)

    @property
    def by_tokens(self) -> bool:
        return self.weighting is not None and self.weighting.tokens

    def _batch_sums(self, model: torch.nn.Module, batch: Any) -> list[torch.Tensor]:
        """[loss sum, samples, counted tokens, then sum and count of each metric] of one batch."""
        if self.weighting is not None and self.weighting.mode is None:  # auto, before any training batch
            self.weighting.decide(batch)
        with self.amp.autocast():
            outputs, targets = self.forward(model, batch)
        samples = batch_size(batch)
        scores = _float(predictions(outputs))
        if (
            not self._first_batch_checked
        ):  # the first batch this rank sees: checked, and the metrics resolved from it
            check_first_batch(outputs, targets, self.loss_fn)
            self._metrics = self._resolve_metrics(scores, targets)
            self.classes = (
                scores.shape[-1] if isinstance(scores, torch.Tensor) and scores.dim() == 2 else None
            )
            self._first_batch_checked = True
        sums = [*self._loss_and_counts(outputs, targets, batch, samples)]
        for name in self.names or self._metrics:
            total, count = metric_lib.sum_and_count(self._metrics[name], scores, targets)
            sums += [total.to(torch.float64), torch.as_tensor(count, dtype=torch.float64)]
        return sums

    def _resolve_metrics(self, scores: Any, targets: Any) -> dict[str, metric_lib.Metric]:
        """The metrics asked for, or the defaults: over tokens, the accuracy of the counted tokens."""
        if self.spec is None and self.by_tokens and isinstance(scores, torch.Tensor) and scores.dim() >= 3:
            return {"acc": token_accuracy(self.weighting.shift)}  # type: ignore[union-attr]  # by_tokens: one is set
        return metric_lib.resolve(self.spec, scores, targets)

    def _loss_and_counts(self, outputs: Any, targets: Any, batch: Any, samples: int) -> list[torch.Tensor]:
        """[loss sum, samples, counted tokens] of one batch: the loss summed over its samples, or over its
        counted tokens when the loss is over tokens (0 tokens otherwise)."""
        count = torch.tensor(samples, dtype=torch.float64)
        if not self.by_tokens:
            return [self._loss_sum(outputs, targets, samples), count, torch.zeros((), dtype=torch.float64)]
        weighting: LossWeighting = self.weighting  # type: ignore[assignment]  # by_tokens: there is one
        counted = weighting.counted(targets_in(batch))  # type: ignore[arg-type]  # a batch over tokens holds them
        loss_sum = token_loss_sum(_float(outputs), targets, self.loss_fn, counted, weighting.shift)
        return [loss_sum, count, counted.double()]

    def _loss_sum(self, outputs: Any, targets: Any, samples: int) -> torch.Tensor:
        if own_loss(outputs) is None and self.per_sample_loss is not None:
            losses = self.per_sample_loss(_float(outputs), targets).double()
            if losses.dim():
                return losses.sum()
        return compute_loss(_float(outputs), targets, self.loss_fn).double() * samples

    def _reduce(self, rows: dict[int, list[torch.Tensor]], num_batches: int) -> dict[str, float]:
        if self.names is None:
            # A rank with no batch (a set smaller than the world) learns the metric names from the others.
            local = list(self._metrics) if rows else None
            self.names = next((names for names in gather_objects(local) if names is not None), [])
        device = self.runtime.device
        table = torch.zeros(num_batches, 3 + 2 * len(self.names), dtype=torch.float64, device=device)
        for row, sums in rows.items():
            table[row] = torch.stack([value.to(device) for value in sums])
        totals = all_reduce_sum(table).sum(0).tolist()
        loss_sum, count, tokens = totals[0], totals[1], totals[2]
        divisor = tokens if self.by_tokens else count
        result = {"loss": loss_sum / divisor if divisor else float("nan")}
        if self.by_tokens:
            result["perplexity"] = _perplexity(result["loss"])
        for index, name in enumerate(self.names):
            total, n = totals[3 + 2 * index], totals[4 + 2 * index]
            result[name] = total / n if n else float("nan")
        result["count"] = int(count)
        if self.by_tokens:
            result["tokens"] = int(tokens)
        return result


def _agreed(requested: bool, runtime: Runtime) -> bool:
    """Whether any rank was asked to stop (one small all-reduce; none in a single process)."""
    if runtime.world_size == 1:
        return requested
    return all_reduce_sum(torch.tensor([float(requested)], device=runtime.device)).item() > 0


def _perplexity(loss: float) -> float:
    """exp(the mean loss over tokens); inf where that overflows (an untrained model's loss can be large)."""
    return math.exp(loss) if loss < 700 else float("inf")


def _per_sample(loss_fn: Any) -> Callable | None:
    """The loss with reduction='none' where it has one, so evaluation sums per-sample losses."""
    if getattr(loss_fn, "reduction", None) == "mean":
        per_sample = copy.copy(loss_fn)
        per_sample.reduction = "none"
        return per_sample
    return None


def _float(value: Any) -> Any:
    """Autocast outputs in float32 for the sums (a bf16 sum of a thousand losses is off in the 3rd digit)."""
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
