"""multigpu/launch/torchrun.py: torchrun whose exit status is the workers', its own reports kept in a log file.

Real torchrun, real trainer processes (2 gloo ranks); the launcher's own runs
through it are in tests/test_launch_multi_gpu.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from conftest import PYTHON, REPO, RUN_TIMEOUT, cli_env, torchrun_command
from multigpu.errors import HANG_EXIT_STATUS
from multigpu.launch.torchrun import verdict, worker_status
from multigpu.resilience.faults import FAULT_ENV


def failure(exitcode: int, timestamp: int) -> ProcessFailure:
    found = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="<N/A>")
    found.timestamp = timestamp
    return found


def test_the_verdict_is_the_first_observed_failure_and_a_kill_reads_as_a_shell_says() -> None:
    assert verdict({}) == (0, "")
    # Within one second the first observed wins: torchrun then stopped the other with SIGTERM.
    assert verdict({1: failure(1, 100), 0: failure(-15, 100)}) == (1, "rank 1")
    assert verdict({0: failure(-15, 101), 1: failure(2, 100)}) == (2, "rank 1")
    assert verdict({3: failure(-9, 7)}, ranks="local rank") == (137, "local rank 3")
    assert worker_status(-2) == 130 and worker_status(2) == 2
    # A hang: the watchdog's rank stopped the run and ended the stuck rank, whose kill may be observed first.
    assert verdict({1: failure(-9, 100), 0: failure(HANG_EXIT_STATUS, 100)}) == (HANG_EXIT_STATUS, "rank 0")


def test_a_killed_worker_is_named_with_its_status_and_torchruns_report_stays_in_the_log(
    tmp_path: Path,
) -> None:
    log = tmp_path / "torchrun.log"
    result = subprocess.run(
        torchrun_command(log, "--save-dir", str(tmp_path / "ckpt")),
        cwd=tmp_path,
        env=cli_env({FAULT_ENV: "1:2"}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 137, result.stderr  # rank 1 died by SIGKILL, as the fault injector kills
    assert f"torchrun: rank 1 exited with status 137 (torchrun's report: {log})" in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    report = log.read_text()
    assert "ChildFailedError" in report and "exitcode  : -9" in report


# How Hugging Face datasets imports dill; torch imports it too when it is installed (requirements.txt has it).
DILL_THEN_REDIRECT = """
import logging, sys
import dill  # noqa: F401  (adds a logging._StderrHandler, whose stream cannot be set, to its logger 'dill')
from multigpu.launch.torchrun import _send_logs_to
agent = logging.getLogger("torch.distributed.elastic.agent")
agent.addHandler(logging.StreamHandler(sys.stderr))
_send_logs_to(open(sys.argv[1], "a", buffering=1))
agent.warning("the agent says")
logging.getLogger("dill").warning("dill says")
"""


def test_torchruns_logs_go_to_the_file_whatever_handlers_other_libraries_installed(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    result = subprocess.run(
        [PYTHON, "-c", DILL_THEN_REDIRECT, str(log)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert log.read_text().splitlines() == ["the agent says", "dill says"]
