"""What the user sees: console lines, the progress bar and TensorBoard, all from rank 0 only.

Other ranks get a Reporter that does nothing, so call sites need no `if rank == 0`
(and cannot accidentally put a collective inside one, PITFALLS 6).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from multigpu.config import TrainConfig


class Reporter:
    """Rank 0's console log, tqdm bar and TensorBoard writer."""

    def __init__(self, config: TrainConfig, enabled: bool):
        self.enabled = enabled
        self.log_dir = config.tensorboard_dir
        self.show_progress = enabled and config.progress
        self.bar: Any = None
        self._writer: Any = None
        # A resumed run sets this: TensorBoard then drops the events a crashed run logged
        # after its last checkpoint, so steps never repeat after a resume (PITFALLS 15).
        self.purge_step: Optional[int] = None

    @property
    def writer(self) -> Any:
        """The SummaryWriter, opened on first use (after a resume has set purge_step); None off rank 0."""
        if self._writer is None and self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, purge_step=self.purge_step)
        return self._writer

    def line(self, text: str) -> None:
        """One line on the console (through tqdm so it does not tear the bar)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def start_epoch(self, epoch: int, epochs: int, total_steps: int, done_steps: int) -> None:
        if self.show_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch + 1}/{epochs}",
                            unit="step", dynamic_ncols=True, file=sys.stdout)

    def advance(self, steps: int, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(steps)

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def hparams(self, config: TrainConfig, metrics: dict[str, float]) -> None:
        """The config as TensorBoard hparams (None shown as ''), with the final metrics."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        params = {key: ("" if value is None else value) for key, value in config.to_dict().items()}
        metric_values = {f"hparam/{key}": value for key, value in metrics.items()}
        # Written through our own writer: SummaryWriter.add_hparams would open a second event file.
        for summary in hparams(params, metric_values):
            self.writer.file_writer.add_summary(summary)
        for tag, value in metric_values.items():
            self.writer.add_scalar(tag, value)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self.end_epoch()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
