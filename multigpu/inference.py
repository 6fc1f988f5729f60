"""`from multigpu.inference import BatchParallel`: the public name of multi-device inference, whose code is
multigpu/loop/inference.py."""

from multigpu.loop.inference import BatchParallel

__all__ = ["BatchParallel"]
