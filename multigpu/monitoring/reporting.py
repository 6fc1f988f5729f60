"""What the user sees: console lines, the progress bar, TensorBoard and the other trackers (--logger), all
from rank 0 only.

Other ranks get a Reporter that does nothing, so call sites need no `if rank == 0`
(and cannot accidentally put a collective inside one, PITFALLS 6).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from multigpu.config import TrainConfig
from multigpu.errors import TrainingStopped, UsageError
from multigpu.loop.metrics import COUNTS
from multigpu.monitoring.meters import Interval
from multigpu.monitoring.trackers import Trackers
from multigpu.parallel.distributed import gather_objects


class Reporter:
    """Rank 0's console log, tqdm bar and TensorBoard writer."""

    def __init__(self, config: TrainConfig, enabled: bool, first_line: str | None = None):
        self.enabled = enabled
        self.log_dir, self.log_root = config.tensorboard_dir, config.tensorboard_root
        # The bar redraws itself with \r: in a log file (stdout redirected, CI, nohup) that leaves fragments and
        # blank lines, so there each log interval is a plain line instead.
        self.show_progress = enabled and config.progress and sys.stdout.isatty()
        self.bar: Any = None
        self._writer: Any = None
        self.tensorboard = "tensorboard" in config.loggers
        # The other trackers get every scalar TensorBoard gets (multigpu/monitoring/trackers.py); their run ids are
        # checkpoint state, so they open at the first scalars, after a resume has loaded them.
        self.trackers = Trackers(config, enabled, self.line)
        self._importing: threading.Thread | None = None  # import_writer_in_background's
        # A resumed run sets this: TensorBoard then drops the events a crashed run logged
        # after its last checkpoint, so steps never repeat after a resume (PITFALLS 15).
        self.purge_step: int | None = None
        # This run's first and latest training loss and validation results: did it learn (plan.learning_warning)?
        self.start_loss: float | None = None  # its first step's: where it started (the untrained model's)
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.loss_intervals = (
            0  # logged intervals: with one, the training loss has nothing to be compared with
        )
        self.first_val: dict[str, float] | None = None
        self.last_val: dict[str, float] | None = None
        if first_line:  # where the run saves, said first (checkpoints/run_folders.py's run_folder)
            self.line(first_line)

    def learning_state(self) -> dict[str, Any]:
        """Where this run started, as the end's check of whether it learned reads it (plan.no_learning_signs):
        kept in the checkpoint, so that a resumed run (any engine: torchrun, Ray, a healed replica group) is
        judged against its first recorded loss, not the first of its last segment."""
        return {
            "start_loss": self.start_loss,
            "first_loss": self.first_loss,
            "loss_intervals": self.loss_intervals,
            "first_val": self.first_val,
        }

    def load_learning_state(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's `learning_state` (None: a checkpoint from before it was kept, the resumed segment's
        own is used)."""
        if not state:
            return
        self.start_loss = state.get("start_loss", self.start_loss)
        self.first_loss = state.get("first_loss", self.first_loss)
        self.loss_intervals = int(state.get("loss_intervals") or self.loss_intervals)
        self.first_val = state.get("first_val", self.first_val)

    def check_trackers(self) -> None:
        """Before training: rank 0 tries each --logger tracker's store, within seconds (tracker_probe); every
        rank stops with its refusal (UsageError), so nothing waits on a tracker that is not there."""
        refusal = next(filter(None, gather_objects(self.trackers.refusal())), None)
        if refusal is not None:
            raise UsageError(refusal)

    def import_writer_in_background(self) -> None:
        """Load TensorBoard's modules (40-60 ms) beside the first steps, whose kernels release the interpreter lock,
        rather than at the first sync point, where the other ranks would wait for rank 0. Only for a run without
        loader workers: a fork during an import could leave its lock held in the worker. Not a daemon: a script
        that ends first waits for it, rather than meeting it half-way through C code at interpreter finalization."""
        if self.enabled:
            self._importing = threading.Thread(
                target=importlib.import_module,
                args=("multigpu.monitoring.event_file",),
                name="import TensorBoard",
            )
            self._importing.start()

    @property
    def writer(self) -> Any:
        """The TensorBoard event file, opened on first use (after a resume has set purge_step); None off rank 0."""
        if self._writer is None and self.enabled and self.tensorboard:
            from multigpu.monitoring.event_file import EventFile  # imports TensorBoard: only where it is used

            self._writer = EventFile(self.log_dir, purge_step=self.purge_step, inside=self.log_root)
        return self._writer

    def line(self, text: str) -> None:
        """One line on the console (through tqdm so it does not tear the bar)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def start_epoch(self, epoch: int, epochs: int, total_steps: int | None, done_steps: int) -> None:
        """The epoch's progress bar (`total_steps` None: steps and their rate, no total)."""
        if self.show_progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=done_steps,
                desc=f"epoch {epoch + 1}/{epochs}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stdout,
            )

    def advance(self, steps: int, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(steps)

    def end_epoch(self) -> None:
        """The epoch's training is done: its bar closes, and TensorBoard gets its last intervals before
        evaluation (which may be long) starts."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.flush()

    def scalars(self, values: dict[str, float], step: int) -> None:
        """TensorBoard scalars of one step, written as one event (a write per scalar costs about 30 us), and the
        same to every other tracker."""
        if not self.enabled or not values:
            return
        with self._writing():
            if self.writer is not None:
                self.writer.scalars(values, step)
        self.trackers.start(self.purge_step)
        self.trackers.scalars(values, step)

    def interval(
        self,
        step: int,
        first_step: int,
        interval: Interval,
        lr: float,
        devices: int,
        skipped: int | None,
        loss_scale: float | None,
        more: dict[str, float] | None = None,
    ) -> None:
        """A logging interval: TensorBoard scalars (`more` too), the bar's postfix (or a line without the bar),
        fp16 skips. Other ranks format nothing: their lines would go nowhere; every rank keeps the (reduced)
        loss, so every rank's fit() says alike whether the run learned."""
        loss = interval.mean_loss
        self.start_loss = interval.first_step_loss if self.start_loss is None else self.start_loss
        self.first_loss, self.last_loss = loss if self.first_loss is None else self.first_loss, loss
        self.loss_intervals += 1
        if not self.enabled:
            return
        per_sec = interval.samples / max(interval.seconds, 1e-9)
        fp16: dict[str, float] = (
            {}
            if skipped is None or loss_scale is None  # set together, under fp16
            else {"train/skipped_steps": skipped, "train/loss_scale": loss_scale}
        )
        self.scalars(
            {
                "train/loss": loss,
                "train/lr": lr,
                "train/samples_per_sec": per_sec,
                "train/samples_per_sec_per_device": per_sec / devices,
                **fp16,
                **(more or {}),
            },
            step,
        )
        if skipped is not None:
            if skipped:
                self.line(
                    f"steps {first_step}-{step}: the fp16 loss scaler skipped {skipped} step(s) with inf/NaN "
                    f"gradients (weights unchanged there); loss scale now {loss_scale:g}"
                )
        shown = {"loss": f"{loss:.4f}", "lr": f"{lr:.3g}", "samples/s": f"{per_sec:.0f}"}
        tokens = (
            f", {interval.tokens / max(interval.seconds, 1e-9):,.0f} tokens/s" if interval.by_tokens else ""
        )
        if interval.by_tokens:
            shown["tokens/s"] = tokens.split()[1]
        self.advance(len(interval.step_losses), shown)
        if not self.show_progress:
            self.line(f"step {step}: loss {loss:.4f}, lr {lr:.3g}, {per_sec:.0f} samples/s{tokens}")

    def epoch_metrics(
        self,
        epoch: int,
        epochs: int,
        result: dict[str, float],
        step: int,
        mid_epoch: bool = False,
        why: str = "--max-steps",
    ) -> None:
        """An epoch's validation results: `val/<name>` scalars and one line (`mid_epoch`: inside epoch `epoch` +
        1, at `step`, where `why` evaluated: --max-steps ended training there, or --eval-every-steps)."""
        values = {name: value for name, value in result.items() if name not in COUNTS}
        self.first_val, self.last_val = self.first_val or values, values
        self.scalars({f"val/{name}": value for name, value in values.items()}, step)
        shown = ", ".join(f"val {name} {value:.4f}" for name, value in values.items())
        where = (
            f"epoch {epoch + 1}/{epochs} {'to' if why == '--max-steps' else 'at'} step {step} ({why})"
            if mid_epoch
            else f"epoch {epoch}/{epochs}"
        )
        tokens = f", {result['tokens']:,} tokens" if "tokens" in result else ""
        self.line(f"{where}: {shown} ({result['count']} samples{tokens})")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A TensorBoard write that fails (full disk, lost permission) stops the run with one line, exit 1:
        checkpoints are written before the epoch's logs are flushed, so none is lost."""
        try:
            yield
        except OSError as error:
            self._writer = None  # its file is broken: closing it would raise again
            raise TrainingStopped(
                f"could not write TensorBoard logs to {self.log_dir}: {error.strerror or error}; "
                f"the checkpoints are kept (free some space, or choose another --log-dir)"
            ) from None

    def hparams(self, config: TrainConfig, metrics: dict[str, float]) -> None:
        """The config as TensorBoard hparams (None shown as ''), with the final metrics."""
        from torch.utils.tensorboard.summary import hparams

        params = {key: ("" if value is None else value) for key, value in config.to_dict().items()}
        metric_values = {f"hparam/{key}": value for key, value in metrics.items()}
        self.trackers.summary(metric_values)  # their parameters were given when their runs were created
        with self._writing():
            if self.writer is None:
                return
            # Written to the run's own file: SummaryWriter.add_hparams would open a second event file.
            for summary in hparams(params, metric_values):
                self.writer.add_summary(summary)
            self.writer.scalars(metric_values)

    def flush(self) -> None:
        with self._writing():
            if self._writer is not None:
                self._writer.flush()

    def close(self) -> None:
        """Close the bar and the TensorBoard file, and wait for the background import (threads of ours end here)."""
        if self._importing is not None:
            self._importing.join()
        self.end_epoch()
        self.trackers.close()
        writer, self._writer = self._writer, None
        if writer is not None:
            with self._writing():
                writer.close()
