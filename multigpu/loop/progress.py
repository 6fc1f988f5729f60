"""Where training stands: the epoch, the optimizer step, the position in the epoch and the best value so far."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint (multigpu/engine/state.py)."""

    epoch: int = 0  # epochs whose training is done (== epochs at the end)
    global_step: int = 0  # optimizer steps taken
    samples_in_epoch: int = (
        0  # global samples of the current epoch already trained on, in the sampler's order
    )
    best_value: float | None = None  # of the monitored validation metric
    evaluated: bool = True  # False between an epoch's last step and the end of its evaluation

    def reached_max_steps(self, max_steps: int) -> bool:
        """--max-steps (0: none) is reached: the run ends mid-epoch, as an epoch's end would end it."""
        return bool(max_steps) and self.global_step >= max_steps

    def finished(self, epochs: int, max_steps: int) -> bool:
        """The run is done: --epochs (or --max-steps) trained, and the last of it evaluated and saved."""
        return self.evaluated and (self.epoch >= epochs or self.reached_max_steps(max_steps))
