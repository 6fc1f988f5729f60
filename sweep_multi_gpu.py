"""Experiment sweeps: many independent training runs (seeds x a grid) spread over the devices.

    python sweep_multi_gpu.py --num-seeds 5 --grid lr=1e-3,3e-3 -- --epochs 10
    python sweep_multi_gpu.py --help

Everything after `--` goes to each run's main_multi_gpu.py. See docs/sweeps.md, "Sweeps".
Exit status: 0 all succeeded, 1 some failed (listed), 2 bad input, 128+N stopped by signal N.
"""

import sys

from multigpu.sweep.cli import main


def cli() -> None:
    """The `multigpu-sweep` console command (pip install .): the same as `python sweep_multi_gpu.py`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
