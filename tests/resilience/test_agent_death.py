"""A torchrun worker whose agent is gone stops within seconds with its checkpoint (multigpu/resilience/agent_death.py),
and the trainer's flags that torchrun's own options start with reach the trainer: one real torchrun job of 2 gloo
ranks whose whole process group is SIGKILLed, as a killed launcher's is."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser

from conftest import TINY, cli_command, cli_env, event_files

STOPPED_WITHIN = 30  # seconds from the agent's death to the last worker's exit, on a loaded 2-core machine
CHILDREN_LISTED = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def torchrun_options() -> list[str]:
    return [option for action in get_args_parser()._actions for option in action.option_strings]


def trainer_flags() -> list[str]:
    """Every flag that main_multi_gpu.py --help lists (and its help mentions)."""
    import main_multi_gpu

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as ended:
        main_multi_gpu.main(["--help"])
    assert ended.value.code == 0 and "--multi-gpu" in printed.getvalue()
    return sorted(set(re.findall(r"(?:^|[ ,\[])(--[a-z][a-z0-9-]*)", printed.getvalue(), flags=re.MULTILINE)))


def newest_step(save_dir: Path) -> int:
    steps = [int(path.stem.split("-")[1]) for path in save_dir.glob("step-*.pt")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def orphaned(tmp_path_factory):
    """torchrun started in a session of its own (as the launcher is), its process group SIGKILLed once a step
    checkpoint exists: (save dir, log dir, the workers' exit seconds after the kill, newest step before the kill)."""
    tmp = tmp_path_factory.mktemp("orphaned")
    save_dir = tmp / "run"
    log_dir = tmp / "elsewhere"  # --log-dir is also torchrun's own option: the trainer's, after the script
    flags = ["--monitor-metric", "val_loss", "--log-dir", str(log_dir)]
    argv = [
        *TINY,
        "--multi-gpu",
        "ddp",
        "--epochs",
        "100000",
        "--save-every-steps",
        "4",
        "--save-dir",
        str(save_dir),
    ]
    with open(tmp / "output.txt", "w") as output:
        agent = subprocess.Popen(
            cli_command([*argv, *flags], nproc=2),
            env=cli_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while newest_step(save_dir) < 8 and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # polls for the file the run writes, not a wait for a race to settle
        workers = [
            int(pid) for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        ]
        before = newest_step(save_dir)
        assert len(workers) == 2 and before >= 8, (tmp / "output.txt").read_text()
        os.killpg(agent.pid, signal.SIGKILL)  # the agent's group: the workers are in sessions of their own
        killed_at = time.monotonic()
        agent.wait()
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < killed_at + 120:
            time.sleep(0.1)
        stopped_after = time.monotonic() - killed_at
    finally:
        for pid in workers if "workers" in locals() else []:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    return save_dir, log_dir, stopped_after, before, (tmp / "output.txt").read_text()


@pytest.mark.skipif(not CHILDREN_LISTED, reason="reads the workers from Linux's /proc/PID/task/TID/children")
def test_workers_whose_agent_was_killed_stop_within_seconds_with_the_newest_checkpoint(orphaned):
    save_dir, _, stopped_after, before, output = orphaned
    assert stopped_after < STOPPED_WITHIN, f"the workers trained on for {stopped_after:.0f} s\n{output}"
    assert re.search(r"stopped by SIGTERM at step (\d+); checkpoint .*last\.pt written", output), output
    last = torch.load(save_dir / "last.pt", weights_only=True)  # whole: it loads
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+)", output).group(1))
    assert last["global_step"] == stopped_at >= before
    assert newest_step(save_dir) <= stopped_at


@pytest.mark.skipif(not CHILDREN_LISTED, reason="reads the workers from Linux's /proc/PID/task/TID/children")
def test_the_trainers_flags_that_torchruns_options_start_with_reach_the_trainer(orphaned):
    """--monitor-metric (a name no torchrun option starts with, where --monitor was ambiguous) and --log-dir
    (torchrun's own option too) after the script's name went to the trainer, not to torchrun."""
    save_dir, log_dir, _, _, output = orphaned
    assert torch.load(save_dir / "last.pt", weights_only=True)["monitor"] == "val_loss", output
    assert event_files(log_dir) and not (save_dir / "tb").exists()


def test_every_flag_of_the_trainers_help_passes_through_torchruns_parser():
    """torchrun's parser reads the script's flags too, and refuses a prefix of two of its options as an ambiguous
    abbreviation (PITFALLS 40): every flag of --help, with a value or `=value`, reaches the script unchanged. The
    flags are read from --help now, so a flag added later is checked too."""
    from multigpu.config import FLAG_ALIASES

    parser = get_args_parser()
    flags = trainer_flags()
    old_names = {alias for aliases in FLAG_ALIASES.values() for alias in aliases}
    assert {"--monitor-metric", "--epochs", "--log-dir"} | old_names <= set(flags), flags
    for flag in sorted(set(flags) - old_names):
        for words in ([flag, "1"], [f"{flag}=1"], [flag]):
            args = parser.parse_args(["--standalone", "--nproc_per_node=2", "main_multi_gpu.py", *words])
            assert args.training_script_args == words, flag
    # An old name is kept for python and the launcher (which writes the new one): torchrun's real parser refuses it
    # before the script runs, which is what this test guards against.
    for old_name in old_names:
        with pytest.raises(SystemExit):
            parser.parse_args(["--standalone", "main_multi_gpu.py", old_name, "val_loss"])
