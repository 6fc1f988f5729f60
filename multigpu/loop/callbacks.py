"""Callbacks: code of your own that the trainer calls at a handful of places in `fit()`.

A callback is any object with any subset of these methods, each given the trainer:

    on_fit_start(trainer)       after a resume, before the first step
    on_step_end(trainer)        after each optimizer step (keep it cheap: no .item(), no .cpu())
    on_epoch_end(trainer)       after an epoch's training, before its evaluation
    on_validation_end(trainer)  after an epoch's evaluation (trainer.metrics holds it), before its checkpoint
    on_save(trainer)            after a checkpoint is written (trainer.checkpointer.last_saved names it)
    on_fit_end(trainer)         after training ended and was reported (not when a signal stopped it)

A callback with `state_dict()` and `load_state_dict(state)` has its state saved in
every checkpoint (under "callbacks", plain Python types only) and loaded on resume.
A callback ends training by calling `trainer.stop_training("why")`; the ranks
agree at the epoch's end, so they all stop together after the same epoch.
A callback that sets `trainer.eval_model` to a module of its own has evaluation (and so best.pt) and
`trainer.predict` use it instead of the trained model (EMA does).
The built-in features (early stopping, EMA) are callbacks themselves: read them as examples
(docs/data.md, "Your own task").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Callable, Protocol

import torch

from multigpu.loop.metrics import Monitor
from multigpu.loop.progress import Progress
from multigpu.parallel import sharding

HOOKS = ("on_fit_start", "on_step_end", "on_epoch_end", "on_validation_end", "on_save", "on_fit_end")


class Trainer(Protocol):
    """What a callback is given: the trainer (train_multi_gpu.MultiGPUTrainer), of which the built-in callbacks
    use these; yours may use any of its attributes (docs/data.md, "Callbacks")."""

    model: torch.nn.Module
    progress: Progress
    metrics: dict[str, float]
    monitor: Monitor
    eval_model: torch.nn.Module | None

    def stop_training(self, reason: str) -> None: ...


class Callbacks:
    """The run's callbacks, with each hook's implementations listed once (a hook nobody implements costs an
    empty loop), and their checkpointed state."""

    def __init__(self, callbacks: Sequence[Any]):
        self.callbacks = list(callbacks)
        self.hooks: dict[str, list[Callable[[Any], None]]] = {
            hook: [
                getattr(callback, hook)
                for callback in self.callbacks
                if callable(getattr(callback, hook, None))
            ]
            for hook in HOOKS
        }

    def call(self, hook: str, trainer: Trainer) -> None:
        """Call every callback's `hook` with the trainer, in the order the callbacks were given."""
        for method in self.hooks[hook]:
            method(trainer)

    def keys(self) -> list[str]:
        """Each callback's name in the checkpoint: its class name, numbered from the second of a class on."""
        keys: list[str] = []
        for callback in self.callbacks:
            name = type(callback).__name__
            seen = sum(1 for key in keys if key == name or key.startswith(f"{name}#"))
            keys.append(f"{name}#{seen + 1}" if seen else name)
        return keys

    def state_dict(self) -> dict[str, Any]:
        """{name: state} of the callbacks that have a state_dict."""
        return {
            key: callback.state_dict()
            for key, callback in zip(self.keys(), self.callbacks)
            if callable(getattr(callback, "state_dict", None))
        }

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Give each callback that can load a state its own from a checkpoint; one the checkpoint lacks
        (a callback added since) starts fresh."""
        for key, callback in zip(self.keys(), self.callbacks):
            if key in states and callable(getattr(callback, "load_state_dict", None)):
                callback.load_state_dict(states[key])


class EarlyStopping:
    """Stop when the monitored validation metric (the one that picks best.pt, --monitor) has not improved by
    more than `min_delta` for `patience` evaluated epochs in a row (--early-stop-patience, --early-stop-min-delta).
    best.pt keeps the best epoch's weights; the counter is in the checkpoint, so a resumed run continues it."""

    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.best_epoch = 0
        self.epochs_without_improvement = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        if (
            self.epochs_without_improvement >= self.patience
        ):  # resumed after it stopped: nothing more to train
            trainer.stop_training(self._why(trainer))

    def on_validation_end(self, trainer: Trainer) -> None:
        if not trainer.metrics:
            return
        name = trainer.monitor.choose(trainer.metrics)
        value = trainer.metrics[name]
        if self._improves(trainer, value):
            self.best, self.best_epoch, self.epochs_without_improvement = value, trainer.progress.epoch, 0
            return
        self.epochs_without_improvement += 1
        if self.epochs_without_improvement >= self.patience:
            trainer.stop_training(self._why(trainer))

    def _improves(self, trainer: Trainer, value: float) -> bool:
        """Better than the best so far by more than min_delta, in the monitor's direction."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        lower = trainer.monitor.lower_is_better()
        return value < self.best - self.min_delta if lower else value > self.best + self.min_delta

    def _why(self, trainer: Trainer) -> str:
        delta = f" by more than {self.min_delta:g}" if self.min_delta else ""
        best = (
            "no finite value yet"
            if self.best is None
            else f"best {self.best:.4g} after epoch {self.best_epoch}"
        )
        return (
            f"early stopping: {trainer.monitor.name} has not improved{delta} for "
            f"{self.epochs_without_improvement} epoch(s) (--early-stop-patience {self.patience}); {best}, "
            f"kept in best.pt"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "epochs_without_improvement": self.epochs_without_improvement,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.epochs_without_improvement = state["epochs_without_improvement"]


class EMA:
    """An exponential moving average of the weights (--ema-decay): after each optimizer step every floating-point
    parameter of the average moves `1 - decay` of the way to the trained one, in one on-device `_foreach_lerp_`
    (no host sync; torch.optim.swa_utils.AveragedModel would read its step counter on the host every update).
    Buffers (BatchNorm statistics) are the trained model's, copied after each step. Evaluation, best.pt
    and predict use the average; the checkpoint holds it under "callbacks" (predict_multi_gpu.py uses it too)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.model: torch.nn.Module | None = None  # the average, a copy of the trained module
        self.loaded: dict[str, torch.Tensor] | None = None  # from a checkpoint, until fit starts
        self._averaged: list[torch.Tensor] = []  # the average's floating-point parameters (or shards)
        self._trained: list[torch.Tensor] = []  # the trained ones they follow
        self._buffers: tuple[
            list[torch.Tensor], ...
        ] = ()  # (the average's, the trained model's); () under fsdp

    def on_fit_start(self, trainer: Trainer) -> None:
        trained = _plain(trainer.model)
        if sharding.is_sharded(trained):  # fsdp: the average stays sharded like the weights
            self._start_sharded(trainer, trained)
            return
        if self.model is None:
            self.model = copy.deepcopy(trained).eval()
            self.model.requires_grad_(False)
        if self.loaded is not None:
            self.model.load_state_dict(self.loaded)
            self.loaded = None
        floating = [(name, p) for name, p in trained.named_parameters() if p.is_floating_point()]
        averaged = dict(self.model.named_parameters())
        self._averaged = [averaged[name] for name, _ in floating]
        self._trained = [p.detach() for _, p in floating]
        self._buffers = tuple(map(list, zip(*zip(self.model.buffers(), trained.buffers()))))
        trainer.eval_model = self.model

    def _start_sharded(self, trainer: Trainer, trained: torch.nn.Module) -> None:
        if self.model is None:
            self.model = sharding.AveragedShards(trained)
        if self.loaded is not None:
            self.model.load_state_dict(self.loaded)
            self.loaded = None
        assert isinstance(self.model, sharding.AveragedShards)  # made above, or by an earlier fit
        self._averaged = self.model.shards
        self._buffers = ()  # buffers: the trained model's own, used as they are
        trainer.eval_model = self.model

    def on_step_end(self, trainer: Trainer) -> None:
        trained = (
            self.model.trained_shards() if isinstance(self.model, sharding.AveragedShards) else self._trained
        )
        torch._foreach_lerp_(self._averaged, trained, 1.0 - self.decay)
        if self._buffers:  # kept equal at every step, so a resume from any checkpoint evaluates alike
            averaged_buffers, trained_buffers = self._buffers
            torch._foreach_copy_(averaged_buffers, trained_buffers)

    def state_dict(self) -> dict[str, Any]:
        weights = self.model.state_dict() if self.model is not None else self.loaded
        return {"decay": self.decay, "weights": weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state["weights"]


def ema_weights(state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The EMA's weights in a checkpoint, None when it was trained without --ema-decay."""
    return state.get("callbacks", {}).get(EMA.__name__, {}).get("weights")


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose weights train: torch.compile's wrapper holds it as _orig_mod."""
    return getattr(model, "_orig_mod", model)
