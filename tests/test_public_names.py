"""The public names at their short paths (multigpu/export.py, multigpu/inference.py): plain modules that hand
over the very objects, and no import hook for the internal paths of version 0.2."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from conftest import PYTHON, REPO, cli_env


def test_the_public_names_are_the_objects_where_they_live():
    from multigpu.config import TrainConfig
    from multigpu.data import build_datasets
    from multigpu.inference import BatchParallel
    from multigpu.loop.inference import BatchParallel as loop_parallel
    from train_multi_gpu import MultiGPUTrainer
    from train_multi_gpu import TrainConfig as engine_config

    assert BatchParallel is loop_parallel
    assert TrainConfig is engine_config
    assert build_datasets.__module__ == "multigpu.data"
    assert MultiGPUTrainer.__module__ == "train_multi_gpu"


@pytest.mark.parametrize("old", ["multigpu.distributed", "multigpu.checkpoint", "multigpu.savedir"])
def test_an_internal_path_of_version_0_2_no_longer_imports(old: str):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert not [finder for finder in sys.meta_path if type(finder).__module__.startswith("multigpu")]


def test_python_m_multigpu_export_runs_the_export_command_and_the_old_torchrun_path_runs_as_a_script():
    export = subprocess.run(
        [PYTHON, "-m", "multigpu.export", "--help"],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert export.returncode == 0, export.stderr
    assert export.stdout.startswith("usage: python -m multigpu.export")
    old_path = REPO / "multigpu" / "torchrun.py"
    new_path = REPO / "multigpu" / "launch" / "torchrun.py"
    old = subprocess.run([PYTHON, str(old_path)], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    new = subprocess.run([PYTHON, str(new_path)], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert old.returncode == new.returncode == 2
    assert old.stderr == new.stderr
    assert "--log-file" in old.stderr
