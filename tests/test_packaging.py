"""Installed with pip, the framework imports from anywhere and a user's own data.py or models.py cannot shadow it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, RUN_TIMEOUT, assert_ok

USER_SCRIPT = """
import data, models  # the user's own modules, beside this script
import torch
from torch.utils.data import TensorDataset
from train_multi_gpu import MultiGPUTrainer, TrainConfig

inputs, targets = data.make(128)
with MultiGPUTrainer(models.make(), TensorDataset(inputs, targets), TensorDataset(inputs, targets),
                     TrainConfig(epochs=4, batch_size=16, lr=0.05, save_dir="out", progress=False)) as trainer:
    summary = trainer.fit()
print("user data:", data.__file__.endswith("user/data.py"), "val_acc:", summary["val_acc"])
"""


def install(tmp_path: Path) -> Path:
    """`pip install .` of a copy of the checkout (pip builds in the source tree) into a folder of its own."""
    source = tmp_path / "source"
    everywhere = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pt")

    def ignore(
        folder: str, names: list[str]
    ) -> set[str]:  # a run's checkpoints/ at the top, not the subpackage
        at_top = {"tests", "checkpoints", "datasets", "runs", "site"} if Path(folder) == REPO else set()
        return set(everywhere(folder, names)) | (at_top & set(names))

    shutil.copytree(REPO, source, ignore=ignore)
    target = tmp_path / "site"
    subprocess.run(
        [
            PYTHON,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )
    return target


def test_installed_package_trains_a_user_script_with_its_own_data_py(tmp_path):
    site = install(tmp_path)
    assert not (site / "data").exists() and not (site / "models").exists()  # no generic top-level names
    assert (site / "multigpu" / "data" / "sampler.py").exists() and (site / "train_multi_gpu.py").exists()
    user = tmp_path / "user"
    user.mkdir()
    (user / "data.py").write_text(
        "import torch\n\ndef make(n):\n    x = torch.randn(n, 8, generator="
        "torch.Generator().manual_seed(0))\n    return x, (x[:, 0] > 0).long()\n"
    )
    (user / "models.py").write_text(
        "import torch\n\ndef make():\n    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),"
        " torch.nn.Linear(16, 2))\n"
    )
    (user / "train.py").write_text(USER_SCRIPT)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [PYTHON, "train.py"], cwd=user, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    assert_ok(result)
    assert "user data: True val_acc:" in result.stdout
    assert float(result.stdout.split("val_acc:")[1]) > 0.8
    command = subprocess.run(
        [str(site / "bin" / "multigpu-train"), "--help"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert_ok(command)
    assert all(
        group in command.stdout for group in ("devices:", "data:", "model:", "optimisation:", "output:")
    )
    predict = subprocess.run(
        [str(site / "bin" / "multigpu-predict"), "--help"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert_ok(predict)
    assert "--checkpoint" in predict.stdout and "--imagefolder" in predict.stdout


def test_the_package_never_imports_an_entry_script():
    """The sweep's workers train through multigpu.launch.runner, below main_multi_gpu.py and the sweep's own command
    line, so no import goes round a circle through the scripts at the top of the checkout."""
    import ast

    entries = {path.stem for path in REPO.glob("*_multi_gpu.py")} - {
        "train_multi_gpu"
    }  # the engine is a library
    assert {"main_multi_gpu", "sweep_multi_gpu", "predict_multi_gpu"} <= entries
    found = []
    for path in sorted((REPO / "multigpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            found += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] in entries]
    assert found == []


def test_pyproject_installs_every_subpackage_of_the_checkout() -> None:
    """A subpackage missing from pyproject's list is left out of `pip install .`, and the installed trainer
    fails at its first import of it (what the whole-install test above finds after a minute; this in a moment)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "multigpu").rglob("__init__.py")
    }
    on_disk |= {"multigpu.data", "multigpu.models"}  # data/ and models/, installed inside multigpu
    assert listed == on_disk
