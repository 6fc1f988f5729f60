"""Callbacks: code of your own that the trainer calls at a handful of places in `fit()`.

A callback is any object with any subset of these methods, each given the trainer:

    on_fit_start(trainer)       after a resume, before the first step
    on_step_end(trainer)        after each optimizer step (keep it cheap: no .item(), no .cpu())
    on_epoch_end(trainer)       after an epoch's training, before its evaluation
    on_validation_end(trainer)  after an epoch's evaluation (trainer.metrics holds it), before its checkpoint
    on_save(trainer)            after a checkpoint is written (trainer.checkpointer.last_saved names it)

A callback with `state_dict()` and `load_state_dict(state)` has its state saved in
every checkpoint (under "callbacks", plain Python types only) and loaded on resume.
A callback ends training by calling `trainer.stop_training("why")`; the ranks
agree at the epoch's end, so they all stop together after the same epoch.
The built-in features (early stopping) are callbacks themselves: read them as examples
(MULTI_GPU_GUIDE.md, "Your own task").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from train_multi_gpu import MultiGPUTrainer

HOOKS = ("on_fit_start", "on_step_end", "on_epoch_end", "on_validation_end", "on_save")


class Callbacks:
    """The run's callbacks, with each hook's implementations listed once (a hook nobody implements costs an
    empty loop), and their checkpointed state."""

    def __init__(self, callbacks: Sequence[Any]):
        self.callbacks = list(callbacks)
        self.hooks: dict[str, list[Callable[[Any], None]]] = {
            hook: [getattr(callback, hook) for callback in self.callbacks if callable(getattr(callback, hook, None))]
            for hook in HOOKS}

    def call(self, hook: str, trainer: "MultiGPUTrainer") -> None:
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
        return {key: callback.state_dict() for key, callback in zip(self.keys(), self.callbacks)
                if callable(getattr(callback, "state_dict", None))}

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
        self.best: Optional[float] = None
        self.best_epoch = 0
        self.epochs_without_improvement = 0

    def on_fit_start(self, trainer: "MultiGPUTrainer") -> None:
        if self.epochs_without_improvement >= self.patience:  # resumed after it stopped: nothing more to train
            trainer.stop_training(self._why(trainer))

    def on_validation_end(self, trainer: "MultiGPUTrainer") -> None:
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

    def _improves(self, trainer: "MultiGPUTrainer", value: float) -> bool:
        """Better than the best so far by more than min_delta, in the monitor's direction."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        lower = trainer.monitor.lower_is_better()
        return value < self.best - self.min_delta if lower else value > self.best + self.min_delta

    def _why(self, trainer: "MultiGPUTrainer") -> str:
        delta = f" by more than {self.min_delta:g}" if self.min_delta else ""
        best = "no finite value yet" if self.best is None else f"best {self.best:.4g} after epoch {self.best_epoch}"
        return (f"early stopping: {trainer.monitor.name} has not improved{delta} for "
                f"{self.epochs_without_improvement} epoch(s) (--early-stop-patience {self.patience}); {best}, "
                f"kept in best.pt")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch,
                "epochs_without_improvement": self.epochs_without_improvement}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.epochs_without_improvement = state["epochs_without_improvement"]


def builtin_callbacks(config: Any) -> list[Any]:
    """The callbacks the config's flags ask for (a TrainConfig), before the user's own."""
    if config.early_stop_patience > 0:
        return [EarlyStopping(config.early_stop_patience, config.early_stop_min_delta)]
    return []
