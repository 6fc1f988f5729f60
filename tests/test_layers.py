"""The package's architecture, read from its imports (multigpu/__init__.py has the map): every import, also those
inside functions and under TYPE_CHECKING, runs down the layers, so no module imports itself round a circle."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# From the bottom up; a module may import its own layer and the layers below. The package root holds the
# shared vocabulary (config, errors, safe_files, lr_scaling, rng, config_checks); models/ sits with data/.
LAYERS = (
    "root",
    "resilience",
    "parallel",
    "data",
    "loop",
    "checkpoints",
    "monitoring",
    "tuning",
    "engine",
    "train_multi_gpu",
    "launch",
    "sweep",
    "entry",
)
ENTRY_SCRIPTS = ("main_multi_gpu", "predict_multi_gpu", "sweep_multi_gpu")
# The package's own set-up, and the path torchrun.py had before 0.3 (a saved launch_command.sh still runs).
PACKAGE_PLUMBING = ("multigpu", "multigpu.torchrun")
# Short public paths (python -m multigpu.export, multigpu.inference.BatchParallel): nothing inside imports them.
PUBLIC_DOORWAYS = ("multigpu.export", "multigpu.inference")


def modules() -> dict[str, Path]:
    """Every module of the package, data/ and models/ as multigpu.data and multigpu.models, and the scripts."""
    found = {}
    for folder, prefix in (
        ("multigpu", "multigpu"),
        ("data", "multigpu.data"),
        ("models", "multigpu.models"),
    ):
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = path
    found.update({script: REPO / f"{script}.py" for script in ("train_multi_gpu", *ENTRY_SCRIPTS)})
    return found


def layer(module: str) -> str | None:
    if module in ENTRY_SCRIPTS or module in PUBLIC_DOORWAYS:
        return "entry"
    if module == "train_multi_gpu":
        return module
    parts = module.split(".")
    if module in PACKAGE_PLUMBING or len(parts) < 2:
        return None
    if parts[1] == "models":
        return "data"
    return parts[1] if len(parts) > 2 or parts[1] in LAYERS else "root"


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports, wherever in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found |= {name for name in names if name in known} or ({node.module} & known.keys())
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & known.keys()
    return found


def test_every_import_runs_down_the_layers():
    known = modules()
    upward = []
    for module, path in known.items():
        below = layer(module)
        for imported in imports(path, known) - {module}:
            if below is None or layer(imported) is None:
                continue
            if LAYERS.index(layer(imported)) > LAYERS.index(below):
                upward.append(f"{module} ({below}) imports {imported} ({layer(imported)})")
    assert upward == []


def test_no_module_imports_itself_round_a_circle():
    known = modules()
    graph = {
        module: imports(path, known) - {module} - set(PACKAGE_PLUMBING) for module, path in known.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                circles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []
