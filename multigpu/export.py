"""`python -m multigpu.export CKPT_DIR OUT.pt`: a sharded checkpoint folder as one checkpoint file.

OUT.pt is what rank 0's one-file writer would have written: the whole model
(`torch.load(OUT.pt, weights_only=True)["model"]`, what predict_multi_gpu.py
reads), the optimizer's state keyed by parameter name, and the rest of the run
(progress, schedule, config), so training may also resume from it. One process
reads every shard: it needs the memory of the whole model and optimizer state.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from multigpu import checkpoint, sharded
from multigpu.errors import UsageError

USAGE = "usage: python -m multigpu.export CKPT_DIR OUT.pt"


def export(folder: str, out: str) -> str:
    """Write the sharded checkpoint `folder` to the file `out` (atomically); the line that says so."""
    if not checkpoint.is_sharded(folder):
        raise UsageError(f"{folder} is not a sharded checkpoint folder (last/, best/, step-N/ of a run with "
                         f"--checkpoint-format sharded): name one")
    state = sharded.load_whole(folder)
    checkpoint.check_writable(os.path.dirname(os.path.abspath(out)), flag="OUT.pt")
    checkpoint.atomic_save(state, out)
    return (f"exported {folder} (step {state['global_step']}, {len(state['model'])} tensors) to {out}: "
            f"{checkpoint.megabytes(os.path.getsize(out))}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Bad input is one line on stderr and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        print(export(*args))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
