"""Command line: train a registered model on a registered data set with MultiGPUTrainer.

    python main_multi_gpu.py                                  # one device (or DataParallel over all GPUs)
    torchrun --nproc_per_node=4 main_multi_gpu.py --multi-gpu ddp
    python main_multi_gpu.py --help                           # every flag = a TrainConfig field
    python main_multi_gpu.py --ray-workers 2                  # as 2 Ray Train workers (docs/launcher.md, "Ray")

Exit status: 0 done (or stopped cleanly by a signal), 1 training failed, 2 bad input.
The training itself is multigpu/launch/runner.py's (the sweep's workers train through it too).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Callable

from multigpu import sweep
from multigpu.launch import ray_train
from multigpu.launch.runner import main_guarded, run, train_from_argv

__all__ = ["cli", "main", "main_guarded", "run"]


def main(argv: Sequence[str] | None = None, on_summary: Callable[[dict], None] | None = None) -> int:
    """Entry point: bad input is one line and exit 2, a failed run one line and exit 1.

    A sweep flag (--num-seeds, --max-gpus, --grid, ...) makes it a sweep (docs/sweeps.md, "Sweeps"); --ray-workers N
    a run on Ray (docs/launcher.md, "Ray").
    `on_summary` receives the final metrics of a finished run.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if sweep.requested(argv):
        from multigpu.sweep.cli import main_mixed

        return main_mixed(argv)
    if ray_train.requested(argv):
        return ray_train.main(argv)
    return train_from_argv(argv, on_summary)


def cli() -> None:
    """The `multigpu-train` console command (pip install .): the same as `python main_multi_gpu.py`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
