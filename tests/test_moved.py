"""The flat package's old import paths (multigpu/moved.py): each is the very module at its new place, a module
split in two answers for both halves, and `python -m multigpu.export` still runs."""

from __future__ import annotations

import importlib
import subprocess

import pytest

from conftest import PYTHON, REPO, cli_env
from multigpu.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_is_its_modules_new_place(old: str):
    module = importlib.import_module(old)
    moved_to = MOVED[old]
    targets = moved_to if isinstance(moved_to, tuple) else (moved_to,)
    first = importlib.import_module(targets[0])
    if len(targets) == 1:
        assert module is first  # one module: state shared, not copied
        assert module.__spec__ is not None and module.__spec__.name == targets[0]
    for target in map(importlib.import_module, targets):
        public = [name for name in vars(target) if not name.startswith("_")]
        assert all(getattr(module, name) is getattr(target, name) for name in public), target.__name__


def test_the_old_names_the_guide_and_scripts_used_still_import():
    from multigpu.checkpoint import CheckpointError, load  # noqa: F401
    from multigpu.distributed import prepare_model, setup  # noqa: F401  (a module split in two)
    from multigpu.inference import BatchParallel
    from multigpu.loop.inference import BatchParallel as moved
    from multigpu.savedir import SaveDirLock, choose_run_dir  # noqa: F401

    assert BatchParallel is moved
    from multigpu.loop import float8, gradient_nodes  # part of the module's form on its devices since
    from multigpu.parallel import float8 as float8_now
    from multigpu.parallel import gradient_nodes as gradient_nodes_now

    assert float8 is float8_now and gradient_nodes is gradient_nodes_now


def test_python_m_old_path_runs_the_moved_module_and_the_old_torchrun_path_runs_as_a_script():
    export = subprocess.run(
        [PYTHON, "-m", "multigpu.export", "--help"],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert export.returncode == 0 and export.stdout.startswith("usage: python -m multigpu.export"), (
        export.stderr
    )
    old, new = (
        subprocess.run(
            [PYTHON, str(path)], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
        )
        for path in (REPO / "multigpu" / "torchrun.py", REPO / "multigpu" / "launch" / "torchrun.py")
    )
    assert (old.returncode, old.stderr) == (new.returncode, new.stderr) == (
        2,
        new.stderr,
    ) and "--log-file" in old.stderr
