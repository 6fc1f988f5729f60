"""Where the modules of the flat package of version 0.2 went, and the two that moved after: each old import
path is one line below.

`import multigpu.distributed`, `from multigpu.checkpoint import load` and `python -m multigpu.export` keep
working: the old name is the very module object at its new place (a module split in two is looked up in
both, in order). Nothing inside the project imports through these; they are for code written against the
old names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

MOVED: dict[str, str | tuple[str, ...]] = {
    "multigpu.amp": "multigpu.loop.amp",
    "multigpu.autotune": "multigpu.tuning.autotune",
    "multigpu.batch_size": "multigpu.tuning.batch_size",
    "multigpu.batches": ("multigpu.loop.forward", "multigpu.data.batches"),
    "multigpu.callbacks": "multigpu.loop.callbacks",
    "multigpu.checkpoint": "multigpu.checkpoints.checkpoint",
    "multigpu.checkpointer": "multigpu.checkpoints.checkpointer",
    "multigpu.collective_check": "multigpu.parallel.collective_check",
    "multigpu.console": "multigpu.launch.console",
    "multigpu.cpu_memory": "multigpu.tuning.cpu_memory",
    "multigpu.distributed": ("multigpu.parallel.distributed", "multigpu.parallel.wrapping"),
    "multigpu.evaluation": "multigpu.loop.evaluation",
    "multigpu.event_file": "multigpu.monitoring.event_file",
    "multigpu.export": "multigpu.checkpoints.export",
    "multigpu.faults": "multigpu.resilience.faults",
    "multigpu.flops": "multigpu.monitoring.flops",
    "multigpu.fork_safety": "multigpu.resilience.fork_safety",
    "multigpu.gc_pauses": "multigpu.tuning.gc_pauses",
    "multigpu.gradient_nodes": "multigpu.parallel.gradient_nodes",
    "multigpu.hang_report": "multigpu.resilience.hang_report",
    "multigpu.heartbeat": "multigpu.resilience.heartbeat",
    "multigpu.inference": "multigpu.loop.inference",
    "multigpu.launch_rules": (
        "multigpu.launch.launch_rules",
        "multigpu.launch.answers",
        "multigpu.launch.command",
        "multigpu.launch.slurm",
    ),
    "multigpu.meters": "multigpu.monitoring.meters",
    "multigpu.metrics": "multigpu.loop.metrics",
    "multigpu.optim": "multigpu.loop.optim",
    "multigpu.plan": "multigpu.monitoring.plan",
    "multigpu.prediction": "multigpu.loop.prediction",
    "multigpu.preemption": "multigpu.resilience.preemption",
    "multigpu.reporting": "multigpu.monitoring.reporting",
    "multigpu.run_settings": "multigpu.checkpoints.run_settings",
    "multigpu.runner": "multigpu.launch.runner",
    "multigpu.savedir": ("multigpu.checkpoints.savedir", "multigpu.checkpoints.run_folders"),
    "multigpu.sharded": "multigpu.checkpoints.sharded",
    "multigpu.sharding": "multigpu.parallel.sharding",
    "multigpu.snapshot": "multigpu.loop.snapshot",
    "multigpu.stateful": "multigpu.checkpoints.stateful",
    "multigpu.streaming": "multigpu.data.streaming",
    "multigpu.telemetry": "multigpu.monitoring.telemetry",
    "multigpu.torchrun": "multigpu.launch.torchrun",
    "multigpu.watchdog": "multigpu.resilience.watchdog",
    # since: part of the module's form on its devices (multigpu/parallel/wrapping.py)
    "multigpu.loop.float8": "multigpu.parallel.float8",
    "multigpu.loop.gradient_nodes": "multigpu.parallel.gradient_nodes",
}


def _targets(name: str) -> tuple[str, ...]:
    target = MOVED[name]
    return (target,) if isinstance(target, str) else target


class _SplitModule(types.ModuleType):
    """An old module whose contents now live in several: each name is looked up in them, in order."""

    def __init__(self, name: str, targets: Sequence[types.ModuleType]):
        super().__init__(name, f"moved to {', '.join(module.__name__ for module in targets)}")
        self._targets = list(targets)

    def __getattr__(self, attribute: str) -> Any:
        for module in self._targets:
            if hasattr(module, attribute):
                return getattr(module, attribute)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attribute!r}")


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as its module's new place; `python -m OLD` runs the new module's code."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        first = importlib.util.find_spec(_targets(fullname)[0])
        return importlib.util.spec_from_loader(fullname, self, origin=first.origin if first else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        modules = [importlib.import_module(target) for target in _targets(spec.name)]
        if len(modules) > 1:
            return _SplitModule(spec.name, modules)
        self._own_spec = modules[0].__spec__  # the import machinery gives the module the alias's spec next
        return modules[0]

    def exec_module(self, module: types.ModuleType) -> None:
        if not isinstance(module, _SplitModule):
            module.__spec__ = (
                self._own_spec
            )  # its own again: importlib.reload and pickling find the real file

    def get_code(self, fullname: str) -> Any:
        spec = importlib.util.find_spec(_targets(fullname)[0])
        return spec.loader.get_code(spec.name)  # type: ignore[union-attr]


def install() -> None:
    """Put the finder first, once: an installed copy's old files must not answer for a moved module."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
