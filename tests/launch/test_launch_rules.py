"""The launcher's rule set (multigpu/launch/launch_rules.py) imports no torch: launch_multi_gpu.sh asks it at
every answer, so a call must take milliseconds, not a torch import's seconds."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, cli_env

PROBE = """
import sys
from multigpu.launch import launch_rules
steps = [["check"], ["plan"], ["slurm", "--save-dir", "shared"], ["k8s", "--save-dir", "shared"]]
steps.append(["ray", "--gpus", "0"])
codes = [launch_rules.main(step) for step in steps]
print(codes, "torch" in sys.modules, file=sys.stderr)
"""


def test_each_step_of_the_launchers_rules_runs_without_importing_torch(tmp_path: Path):
    probe = subprocess.run(
        [PYTHON, "-c", PROBE], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.strip().splitlines()[-1] == "[0, 0, 0, 0, 0] False", probe.stderr


# Every way the launcher runs a training: a run here, its SLURM job, its TrainJob, Ray, and replica groups.
WAYS = {
    "a run here": ["plan", "--nproc", "1"],
    "--slurm": ["slurm", "--save-dir", "/shared/run"],
    "--k8s": ["k8s", "--save-dir", "/shared/run"],
    "--ray": ["ray", "--gpus", "0"],
    "--fault-tolerance": ["plan", "--fault-tolerance", "1", "--nproc", "1"],
}


def test_the_launchers_own_flags_after_the_separator_are_refused_on_every_way_and_the_docs_say_so(
    tmp_path, monkeypatch
):
    """--epochs, --batch-size ... after -- would win in the trainer's parser over the launcher's own answer and make
    the shown batch and LR a lie: refused in the same line by every way of launching (--fault-tolerance took them,
    and its command then held both values), and docs/launcher.md and the launcher's --help name exactly those."""
    from multigpu.config import flag
    from multigpu.errors import UsageError
    from multigpu.launch import launch_rules
    from multigpu.launch.answers import LAUNCHER_OWNED

    monkeypatch.chdir(tmp_path)  # a refused launch writes nothing: no checkpoints/ appears here
    values = {
        "multi_gpu": "ddp",
        "gpu_ids": "0",
        "lr_scaling": "sqrt",
        "save_dir": str(tmp_path / "elsewhere"),
    }
    for way, argv in WAYS.items():
        for name in LAUNCHER_OWNED:
            trainer = [f"--{flag(name)}", values.get(name, "2")]
            step, settings = launch_rules.parse([*argv, "--", *trainer])
            refused = (
                f"^--{flag(name)} after -- (would override the launcher's setting|is the launcher's to set)"
            )
            with pytest.raises(UsageError, match=refused):
                list(launch_rules.records(step, settings))
            assert settings.trainer_args == trainer, way
    step, settings = launch_rules.parse([*WAYS["--fault-tolerance"], "--epochs", "2"])
    commands = [record for record in launch_rules.records(step, settings) if record.startswith("command")]
    assert commands and "--epochs 2" in commands[0]  # before --: the launcher's flag, in the command once
    docs = " ".join((REPO / "docs" / "launcher.md").read_text().split())
    said = re.search(r"Options the launcher sets itself \(([^)]*)\) are refused after `--`", docs)
    assert said is not None
    assert sorted(re.findall(r"`(--[a-z-]+)`", said.group(1))) == sorted(
        f"--{flag(n)}" for n in LAUNCHER_OWNED
    )
    usage = subprocess.run(
        ["bash", str(REPO / "launch_multi_gpu.sh"), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    tail = " ".join(usage.split("Everything after --")[1].split("Exit status")[0].split())
    assert all(f"--{flag(name)}" in tail for name in LAUNCHER_OWNED), tail
    assert list(tmp_path.iterdir()) == []


def test_the_launcher_writes_the_metric_flags_new_name_that_torchrun_passes_on(tmp_path, monkeypatch):
    """`bash launch_multi_gpu.sh --yes -- --monitor val_loss`: torchrun would refuse --monitor as an abbreviation of
    its --monitor-interval; the command the launcher runs says --monitor-metric, and torchrun's parser hands it to
    the trainer."""
    import shlex

    from torch.distributed.run import get_args_parser

    from multigpu.launch import launch_rules

    monkeypatch.chdir(tmp_path)
    step, settings = launch_rules.parse(
        ["plan", "--nproc", "2", "--", "--monitor", "val_loss", "--monitor=val_acc"]
    )
    command = next(record for record in launch_rules.records(step, settings) if record.startswith("command="))
    words = shlex.split(command.removeprefix("command="))
    torchrun_argv = words[
        words.index("--log-file") + 2 :
    ]  # multigpu/launch/torchrun.py's: torchrun's own argv
    args = get_args_parser().parse_args(torchrun_argv)
    assert args.training_script_args[-3:] == ["--monitor-metric", "val_loss", "--monitor-metric=val_acc"]
