"""The LR scaling rule: the one place its formula lives.

The trainer uses `scaled_lr`, and the launcher runs `python -m multigpu.lr_scaling`
(which imports no torch, so it answers at once), so the LR the launcher prints
is exactly the LR the run will use.
"""

from __future__ import annotations

import argparse
import math

from multigpu.config import TrainConfig


def scaled_lr(lr: float, rule: str, effective_batch: int, base_batch: int) -> float:
    """--lr scaled from the batch it was tuned for to the effective batch.

    linear: lr * effective/base (Goyal et al., for SGD); sqrt: lr * sqrt(effective/base),
    gentler, usual for Adam-like optimizers; none: lr unchanged.
    """
    ratio = effective_batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown LR scaling rule {rule!r}")


def describe_lr(config: TrainConfig, effective_batch: int) -> str:
    """One line saying which LR is used and how it was derived."""
    lr = scaled_lr(config.lr, config.lr_scaling, effective_batch, config.lr_base_batch)
    if config.lr_scaling == "none":
        return f"lr {lr:g} (as given; --lr-scaling none)"
    return (f"lr {lr:g} = {config.lr:g} x {config.lr_scaling}({effective_batch}/{config.lr_base_batch}) "
            f"(--lr-scaling {config.lr_scaling})")


def _main() -> None:
    """`python -m multigpu.lr_scaling --lr 0.1 --lr-scaling linear --effective-batch 256 --lr-base-batch 32`"""
    parser = argparse.ArgumentParser(description="print the LR a run would use")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none")
    parser.add_argument("--effective-batch", type=int, required=True)
    parser.add_argument("--lr-base-batch", type=int, default=32)
    args = parser.parse_args()
    # repr: the shortest text that round-trips, so the printed LR is bit-exactly the one used.
    print(repr(scaled_lr(args.lr, args.lr_scaling, args.effective_batch, args.lr_base_batch)))


if __name__ == "__main__":
    _main()
