"""torchft's Lighthouse, as its `torchft_lighthouse` program runs it, started without torchft's Python package.

    python multigpu/launch/lighthouse.py --min_replicas 1 --bind [::]:29510 [torchft_lighthouse's flags]

`torchft_lighthouse` imports torchft, whose package imports torch first: seconds on a busy machine before the
Lighthouse listens, while the replica groups wait for it. The Lighthouse itself is torchft's compiled core; this
loads that file alone and runs the same `lighthouse_main` (it reads this command line's flags), in a tenth of a
second. Used by multigpu/launch/replica_groups.py; torch-free.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Any


def torchft_core() -> Any:
    """torchft's compiled core (its Lighthouse, Manager server and clients), loaded from its file; None when
    torchft is not installed."""
    package = importlib.util.find_spec("torchft")
    locations = package.submodule_search_locations or [] if package else []
    files = sorted(
        path for location in locations for path in glob.glob(os.path.join(location, "_torchft*.so"))
    )
    if not files:
        return None
    spec = importlib.util.spec_from_file_location("torchft._torchft", files[0])
    core = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(core)  # type: ignore[union-attr]
    return core


def main() -> int:
    core = torchft_core()
    if core is None:
        print(
            "error: torchft is not installed: pip install 'multigpu[ft]' (or pip install torchft)",
            file=sys.stderr,
        )
        return 2
    return core.lighthouse_main()


if __name__ == "__main__":
    sys.exit(main())
