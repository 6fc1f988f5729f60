"""Save-dir ownership, run folders and --overwrite's set-aside copy (multigpu/checkpoints/savedir.py), with real
processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    PYTHON,
    REPO,
    RUN_TIMEOUT,
    SAVE_DIR_HOLDER,
    TINY,
    cli_command,
    cli_env,
    contents,
    hold_save_dir,
    run_cli,
)
from multigpu.checkpoints import checkpoint, run_folders, savedir
from multigpu.checkpoints.savedir import SaveDirLock
from multigpu.config import TrainConfig
from multigpu.errors import UsageError


def acquire_in_process(save_dir: Path) -> tuple[SaveDirLock, list[str]]:
    lines: list[str] = []
    return SaveDirLock(str(save_dir)).acquire(lines.append), lines


def test_a_second_run_is_refused_in_one_line_naming_the_owner_and_touches_nothing(tmp_path):
    holder = hold_save_dir(tmp_path / "ckpt")
    lock_file = tmp_path / "ckpt" / savedir.LOCK_NAME
    before = (lock_file.read_bytes(), sorted(os.listdir(tmp_path / "ckpt")))
    with pytest.raises(UsageError) as refused:
        acquire_in_process(tmp_path / "ckpt")
    message = str(refused.value)
    assert "\n" not in message
    assert (
        f"--save-dir {tmp_path / 'ckpt'} is in use by another run (pid {holder.pid} on {socket.gethostname()}, "
        f"started " in message
    )
    assert (lock_file.read_bytes(), sorted(os.listdir(tmp_path / "ckpt"))) == before
    holder.communicate("", timeout=RUN_TIMEOUT)  # the first run ends normally: the save-dir is free again
    assert holder.returncode == 0
    lock, lines = acquire_in_process(tmp_path / "ckpt")
    lock.release()
    assert lines == []


def test_a_sigkilled_owners_lock_is_taken_over_with_one_line(tmp_path):
    holder = hold_save_dir(tmp_path / "ckpt")
    holder.send_signal(signal.SIGKILL)
    holder.wait(RUN_TIMEOUT)
    lock, lines = acquire_in_process(tmp_path / "ckpt")
    assert lock.held
    lock.release()
    assert len(lines) == 1 and "taking over from a run that ended without releasing it" in lines[0]
    assert f"pid {holder.pid} on {socket.gethostname()}" in lines[0]


def test_an_exception_releases_the_save_dir(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with SaveDirLock(str(tmp_path)).acquire():
            raise RuntimeError("boom")
    owner = savedir.read_owner(str(tmp_path))
    assert owner is not None and owner.released and owner.pid == os.getpid()
    holder = hold_save_dir(tmp_path)  # another process takes it without a take-over line ("held" comes first)
    out, err = holder.communicate("", timeout=RUN_TIMEOUT)
    assert holder.returncode == 0 and out == "", err


def test_one_process_cannot_own_a_save_dir_twice(tmp_path):
    with SaveDirLock(str(tmp_path)).acquire():
        with pytest.raises(UsageError, match="already used by this process"):
            SaveDirLock(str(tmp_path / ".")).acquire()


def test_a_torchrun_restart_of_the_same_job_keeps_the_save_dir(tmp_path):
    # Attempt 0 takes the save-dir and dies by SIGKILL; torchrun restarts it; attempt 1 must own it again.
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, sys\n"
        "from multigpu.checkpoints.savedir import SaveDirLock\n"
        "lock = SaveDirLock(sys.argv[1]).acquire(lambda line: print('line:', line, flush=True))\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "lock.release()\n"
    )
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "--max-restarts=1",
            str(script),
            str(tmp_path / "ckpt"),
        ],
        cwd=REPO,
        env=cli_env({"PYTHONPATH": str(REPO)}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("line:")]
    assert len(lines) == 1 and "torchrun restart 1: continuing in --save-dir" in lines[0], result.stdout
    assert "taken over from this job's attempt 0" in lines[0]


def test_a_restart_waits_for_its_earlier_attempt_but_another_job_is_refused(tmp_path):
    holder = hold_save_dir(tmp_path, {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "0"})
    other_job = subprocess.run(
        [PYTHON, "-c", SAVE_DIR_HOLDER, str(tmp_path)],
        cwd=REPO,
        input="",
        text=True,
        capture_output=True,
        timeout=RUN_TIMEOUT,
        env=cli_env({"TORCHELASTIC_RUN_ID": "job-b", "TORCHELASTIC_RESTART_COUNT": "1"}),
    )
    assert other_job.returncode != 0 and f"in use by another run (pid {holder.pid}" in other_job.stderr
    restarted = subprocess.Popen(
        [PYTHON, "-c", SAVE_DIR_HOLDER, str(tmp_path)],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env({"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "1"}),
    )
    holder.kill()  # as torchrun stops the earlier attempt's workers
    holder.wait(RUN_TIMEOUT)
    out, err = restarted.communicate("", timeout=RUN_TIMEOUT)
    assert restarted.returncode == 0, err
    assert out.splitlines()[0].startswith("torchrun restart 1: continuing in --save-dir")


def write_record(save_dir: Path, age_seconds: float, **fields) -> None:
    """The lock file as a run on another node leaves it (its lock, if any, is not visible from here)."""
    record = {"pid": 4242, "host": "other-node", "started": "2024-01-01 00:00:00", **fields}
    path = save_dir / savedir.LOCK_NAME
    path.write_text(json.dumps(record))
    when = time.time() - age_seconds
    os.utime(path, (when, when))


def test_another_nodes_run_with_a_fresh_heartbeat_is_refused(tmp_path):
    write_record(tmp_path, age_seconds=1)
    with pytest.raises(
        UsageError,
        match=r"in use by another run \(pid 4242 on other-node, started 2024-01-01 "
        r"00:00:00; its heartbeat is \d+ s old",
    ):
        acquire_in_process(tmp_path)


def test_a_lost_nodes_run_is_stale_once_its_heartbeat_is_old(tmp_path):
    write_record(tmp_path, age_seconds=savedir.STALE_SECONDS + 5)
    lock, lines = acquire_in_process(tmp_path)
    lock.release()
    assert (
        len(lines) == 1
        and "taking over from a run that ended without releasing it (pid 4242 on other-node" in lines[0]
    )


def test_a_restart_on_another_node_takes_over_its_jobs_fresh_record(tmp_path, monkeypatch):
    write_record(tmp_path, age_seconds=1, job="job-a", restart=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock, lines = acquire_in_process(tmp_path)
    lock.release()
    assert len(lines) == 1 and "taken over from this job's attempt 0, pid 4242 on other-node" in lines[0]


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(savedir, "HEARTBEAT_SECONDS", 0.05)
    lock, _ = acquire_in_process(tmp_path)
    lock_file = tmp_path / savedir.LOCK_NAME
    os.utime(lock_file, (0, 0))
    deadline = time.monotonic() + 10
    while lock_file.stat().st_mtime == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # waiting for the heartbeat thread's next beat
    lock.release()
    assert lock_file.stat().st_mtime > time.time() - 60


# ---------------------------------------------------------------- run folders
def test_run_folders_are_numbered_and_the_newest_is_found(tmp_path):
    root = tmp_path / "checkpoints"
    assert run_folders.newest_run_dir(str(root)) is None
    first, second = run_folders.new_run_dir(str(root)), run_folders.new_run_dir(str(root))
    assert (first, second) == (str(root / "run-1"), str(root / "run-2"))
    (root / "run-10").mkdir()
    (root / "run-x").mkdir()
    (root / "run-11").write_text("a file, not a run folder")
    assert run_folders.newest_run_dir(str(root)) == str(root / "run-10")
    assert run_folders.new_run_dir(str(root)) == str(root / "run-12")  # run-11 is taken, by a file


def trained_with(folder: Path, **settings) -> TrainConfig:
    """A run folder whose last.pt was saved with `settings` (a real torch.save file holding just the config)."""
    config = TrainConfig(**settings)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"config": config.to_dict()}, folder / "last.pt")
    return config


def test_choose_run_dir_starts_a_new_folder_and_resume_auto_continues_the_newest_run_with_its_settings(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    root = tmp_path / "checkpoints"
    path, line = run_folders.choose_run_dir(
        str(root), TrainConfig(resume="auto")
    )  # nothing to continue: a new one
    assert path == str(root / "run-1") and line.startswith(f"--save-dir not given: this run writes to {path}")
    trained_with(root / "run-1", lr=0.01)
    trained_with(root / "run-2", lr=0.1, epochs=5)
    (root / "run-3").mkdir()  # a run that saved nothing: nothing to continue there
    path, line = run_folders.choose_run_dir(
        str(root), TrainConfig(resume="auto", lr=0.1)
    )  # epochs may differ
    assert path == str(root / "run-2") and line == (
        f"--save-dir not given: continuing {path}, the newest run with these settings"
    )
    path, line = run_folders.choose_run_dir(str(root), TrainConfig(resume="auto", lr=0.01, num_workers=2))
    assert path == str(root / "run-1") and line.endswith(f"({root / 'run-2'} has other settings)")
    with pytest.raises(UsageError) as refused:
        run_folders.choose_run_dir(str(root), TrainConfig(resume="auto", lr=0.05, seed=3))
    assert str(refused.value) == (
        f"--resume auto without --save-dir: no run under {root} has this command's "
        f"settings; the newest, {root / 'run-2'}, differs in lr: 0.1 -> 0.05; seed: 0 -> 3: "
        f"continue it with these settings by naming it (--save-dir {root / 'run-2'} "
        f"--resume auto), or drop --resume auto to start a new run"
    )
    assert sorted(os.listdir(root)) == ["run-1", "run-2", "run-3"]  # the refusal created nothing
    path, _ = run_folders.choose_run_dir(str(root), TrainConfig(lr=0.1))  # no --resume: always a new folder
    assert path == str(root / "run-4")


def test_a_restart_continues_its_own_jobs_run_folder(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for number, job in ((1, "job-a"), (2, "job-b")):
        (root / f"run-{number}").mkdir(parents=True)
        write_record(root / f"run-{number}", age_seconds=1, job=job, released=True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    path, line = run_folders.choose_run_dir(str(root), TrainConfig())
    assert path == str(root / "run-1") and line.startswith("torchrun restart 1")


# ---------------------------------------------------------------- --overwrite
def old_run(save_dir: Path) -> dict[Path, bytes]:
    """A previous run's files: checkpoints, TensorBoard logs and the launcher's command; returns their bytes."""
    for name in ("last.pt", "best.pt", "step-000000005.pt"):
        (save_dir / name).write_bytes(name.encode() * 100)
    (save_dir / "tb").mkdir()
    (save_dir / "tb" / "events.out.tfevents.1").write_bytes(b"old events")
    (save_dir / "launch_command.sh").write_text("torchrun ...")
    return contents(save_dir)


def test_set_aside_keeps_the_old_checkpoints_until_dropped(tmp_path):
    old_run(tmp_path)
    folder = run_folders.set_aside(str(tmp_path), extra=(str(tmp_path / "tb"),))
    assert folder is not None and os.path.basename(folder).startswith(".replaced-")
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(folder), "launch_command.sh"])
    assert (Path(folder) / "best.pt").read_bytes() == b"best.pt" * 100
    assert run_folders.checkpoint_files(str(tmp_path)) == []
    assert run_folders.set_aside_folders(str(tmp_path)) == [folder]
    run_folders.drop_set_aside(folder)
    assert sorted(os.listdir(tmp_path)) == ["launch_command.sh"]
    assert run_folders.set_aside(str(tmp_path)) is None


def test_put_back_returns_every_file_over_what_the_ending_run_wrote(tmp_path):
    before = old_run(tmp_path)
    times = (tmp_path / "last.pt").stat().st_mtime_ns
    folder = run_folders.set_aside(str(tmp_path), extra=(str(tmp_path / "tb"),))
    (tmp_path / "tb").mkdir()  # the ending run's own logs, and a checkpoint it was writing
    (tmp_path / "tb" / "events.out.tfevents.2").write_bytes(b"new events")
    (tmp_path / "last.pt").write_bytes(b"half a checkpoint")
    run_folders.put_back(folder)
    assert contents(tmp_path) == before and not os.path.exists(folder)
    assert (tmp_path / "last.pt").stat().st_mtime_ns == times  # the same file, renamed back


def test_a_killed_overwrite_runs_set_aside_files_go_back_at_the_next_start(tmp_path):
    before = old_run(tmp_path)
    folder = run_folders.set_aside(str(tmp_path), extra=(str(tmp_path / "tb"),))
    (tmp_path / "tb").mkdir()  # the killed run's logs
    adopted, lines = run_folders.leftovers(str(tmp_path), adopt=False)
    assert adopted is None and contents(tmp_path) == before
    assert lines == [
        f"--save-dir {tmp_path}: put the previous run's files back from {folder}, where an --overwrite "
        f"run that ended before its first checkpoint had left them"
    ]


def test_a_set_aside_folder_beside_newer_checkpoints_is_named_with_the_command_that_puts_it_back(tmp_path):
    before = old_run(tmp_path)
    folder = run_folders.set_aside(str(tmp_path), extra=(str(tmp_path / "tb"),))
    (tmp_path / "tb").mkdir()  # a newer run saved, then died before it dropped the set-aside copy
    (tmp_path / "last.pt").write_bytes(b"a newer run's checkpoint")
    adopted, (line,) = run_folders.leftovers(str(tmp_path), adopt=False)
    assert adopted is None and (tmp_path / "last.pt").read_bytes() == b"a newer run's checkpoint"
    prefix = (
        f"--save-dir {tmp_path} still holds {folder}, checkpoints an --overwrite run set aside before newer "
        f"ones were written (left as they are); to go back to them: "
    )
    assert line.startswith(prefix)
    subprocess.run(["bash", "-c", line.removeprefix(prefix)], check=True)  # the command, as a user runs it
    assert contents(tmp_path) == before and run_folders.set_aside_folders(str(tmp_path)) == []


def test_a_torchrun_restart_of_an_overwrite_run_keeps_its_own_set_aside_copy(tmp_path, monkeypatch):
    old_run(tmp_path)
    folder = run_folders.set_aside(str(tmp_path), extra=(str(tmp_path / "tb"),))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    adopted, lines = run_folders.leftovers(str(tmp_path), adopt=True)
    assert adopted == folder and run_folders.checkpoint_files(str(tmp_path)) == []
    assert lines == [
        f"torchrun restart 1: the previous run's files stay in {folder} until this run's first "
        f"checkpoint is written"
    ]


# ---------------------------------------------------------------- through the command line
@pytest.mark.slow
def test_a_second_cli_run_is_refused_while_the_first_trains_on_untouched(tmp_path):
    save_dir = tmp_path / "ckpt"
    first = subprocess.Popen(
        cli_command(
            [*TINY, "--epochs", "1000", "--log-every", "1", "--seed", "1", "--save-dir", str(save_dir)]
        ),
        cwd=REPO,
        env=cli_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for line in first.stdout:  # the plan is printed once the run owns its save-dir
            if "steps/epoch" in line:
                break
        second = run_cli([*TINY, "--epochs", "1", "--seed", "2", "--save-dir", str(save_dir)])
        first.send_signal(signal.SIGTERM)  # a clean stop: last.pt written, exit 0
        out, err = first.communicate(timeout=RUN_TIMEOUT)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(
        f"error: --save-dir {save_dir} is in use by another run (pid {first.pid} on "
    )
    assert first.returncode == 0, err
    assert checkpoint.load(str(save_dir / "last.pt"))["config"]["seed"] == 1  # the first run's own file
