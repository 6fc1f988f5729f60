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
from typing import Any, Callable

from multigpu import sweep
from multigpu.launch import ray_train

__all__ = ["cli", "main", "main_guarded", "run"]  # noqa: F822 -- the last two from __getattr__


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
    from multigpu.launch.runner import train_from_argv

    return train_from_argv(argv, on_summary)


def __getattr__(name: str) -> Any:
    """`main_guarded` and `run`, the runner's, imported at their first use: a driver of Ray workers or of a sweep
    never loads the trainer (only its workers do)."""
    if name in ("main_guarded", "run"):
        from multigpu.launch import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cli() -> None:
    """The `multigpu-train` console command (pip install .): the same as `python main_multi_gpu.py`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
