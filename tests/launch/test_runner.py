"""multigpu/launch/runner.py: one training run inside a process group someone else made (Ray's, for
`--ray-workers`) joins it and leaves it standing for its maker to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import run_ranks
from multigpu.config import parse_config
from multigpu.launch import runner


def _run_in_the_given_group(rank: int, world_size: int, save_dir: Path) -> dict[str, object]:
    args = [
        "--multi-gpu",
        "ddp",
        "--epochs",
        "1",
        "--train-size",
        "64",
        "--val-size",
        "16",
        "--batch-size",
        "16",
    ]
    summary = runner.run(
        parse_config([*args, "--mode", "flatten", "--no-progress", "--save-dir", str(save_dir)])
    )
    return {
        "trained": "val_acc" in summary,
        "group after": dist.is_initialized(),
        "world": dist.get_world_size(),
    }


@pytest.mark.slow
def test_a_run_inside_a_group_it_did_not_make_leaves_the_group_to_its_maker(tmp_path: Path) -> None:
    results = run_ranks(_run_in_the_given_group, 2, tmp_path, tmp_path / "run")  # the test makes the group
    assert results == [{"trained": True, "group after": True, "world": 2}] * 2
