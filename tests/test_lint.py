"""The linters see the whole code: ruff (lint and format) reads every Python file git tracks, and mypy's `files`
(pyproject.toml) name every module of the package, data/, models/, the tests and the entry scripts.

The run itself (scripts/run_tests.sh runs `ruff check .`, `ruff format --check .` and `mypy` first) proves only
that what they read is clean: an exclusion that matches too much reads as clean too (`checkpoints`, meant for the
runs' folder, once left out multigpu/checkpoints/ and tests/checkpoints/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML itself")

TYPED = ("multigpu/", "data/", "models/", "tests/")  # and the Python files at the checkout's top


def tracked_python_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (its tracked files)")
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, text=True, capture_output=True, check=True, timeout=60
    )
    return sorted(listed.stdout.split())


def test_ruff_reads_every_tracked_python_file() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed: bash scripts/ensure_env.sh lint")
    shown = subprocess.run(
        [str(ruff), "check", "--show-files", "."], cwd=REPO, text=True, capture_output=True, timeout=60
    )
    read = {str(Path(line).relative_to(REPO)) for line in shown.stdout.split() if line.endswith(".py")}
    assert set(tracked_python_files()) - read == set()


def test_mypy_files_name_every_module_of_the_package_and_the_tests() -> None:
    named = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    wanted = [path for path in tracked_python_files() if path.startswith(TYPED) or "/" not in path]
    unnamed = [
        path for path in wanted if not any(path == name or path.startswith(name + "/") for name in named)
    ]
    assert unnamed == []
