"""The torchrun entry of an experiment that is a K-process DDP run (--gpus-per-run K > 1).

    torchrun --standalone --nproc_per_node=K -m multigpu.sweep.child -- SUMMARY.json [--report-to TRIAL] \
        [training flags]

It trains as main_multi_gpu.py does (multigpu.launch.runner: same flags, same messages, same exit status), except
that rank 0 also writes the run's final metrics to SUMMARY.json for the worker that started it. A search's run
reports its epochs to its trial (TRIAL: multigpu.sweep.study.TrialLink as JSON; multigpu/sweep/pruning.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from multigpu.sweep.pruning import TrialReporter
from multigpu.sweep.records import write_json_atomic
from multigpu.sweep.study import TrialLink

REPORT_TO = "--report-to"  # then the trial, as JSON, that a search's run reports to


def main(argv: Sequence[str] | None = None) -> int:
    """Train on the training flags; rank 0 writes the summary file."""
    from multigpu.launch.runner import train_from_argv

    args = list(sys.argv[1:] if argv is None else argv)
    summary_path, *train_argv = (
        args[1:] if args[:1] == ["--"] else args
    )  # torchrun passes its "--" on, or not
    reporter = None
    if train_argv[:1] == [REPORT_TO]:
        reporter = TrialReporter(TrialLink.from_json(train_argv[1]))
        train_argv = train_argv[2:]

    def record(summary: dict[str, Any]) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            write_json_atomic(summary_path, {**summary, **(reporter.outcome() if reporter else {})})

    return train_from_argv(train_argv, on_summary=record, callbacks=[reporter] if reporter else [])


if __name__ == "__main__":
    sys.exit(main())
