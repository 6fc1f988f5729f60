"""`python -m multigpu.export CKPT OUT`: the command's public name; the code is multigpu/checkpoints/export.py."""

import sys

from multigpu.checkpoints.export import main

if __name__ == "__main__":
    sys.exit(main())
