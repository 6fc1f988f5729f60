"""multigpu/safe_files.py, and a symbolic link planted for every file name the project writes: each real writer
refuses it in one line naming the link, and the file (or folder) it points to keeps its bytes and mode."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pytest

import main_multi_gpu
from conftest import PYTHON, REPO, TINY_SWEEP_RUN
from multigpu import safe_files
from multigpu.checkpoints import checkpoint
from multigpu.checkpoints.savedir import SaveDirLock
from multigpu.errors import UsageError
from multigpu.launch import torchrun
from multigpu.loop.prediction import written_whole
from multigpu.sweep import cli as sweep_cli
from multigpu.sweep import records
from multigpu.sweep.plan import Experiment
from multigpu.sweep.worker import Task, run_task

VICTIM_BYTES = b"another user's file\n"


def plant(link: Path, victims: Path, folder: bool = False) -> Path:
    """What another user of a shared file system would do: a symbolic link at `link`, named like a file the
    project is about to write, to a file (or folder) of their choosing in `victims`."""
    target = Path(tempfile.mkdtemp(prefix="victim-", dir=victims)) / link.name
    if folder:
        target.mkdir()
        (target / "keep.txt").write_bytes(VICTIM_BYTES)
    else:
        target.write_bytes(VICTIM_BYTES)
        target.chmod(0o640)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return target


def snapshot(target: Path) -> object:
    """The target's contents and modes: a file's bytes, or a folder's listing with each file's bytes."""
    if target.is_dir():
        return sorted((path.name, path.read_bytes(), path.stat().st_mode) for path in target.iterdir())
    return target.read_bytes(), target.stat().st_mode


def refusal_of(link: Path) -> str:
    return f"refusing to write {link}: it is a symbolic link (to {os.readlink(link)}); remove it or choose another path"


def said(action: Callable[[], object]) -> str:
    """The one line a writer refused with: its UsageError, or what the action returns (a CLI's stderr)."""
    try:
        return str(action())
    except UsageError as error:
        return str(error)


# ---------------------------------------------------------------- the helper
def test_open_no_follow_writes_and_appends_like_open_and_refuses_a_link(tmp_path):
    path = tmp_path / "log.txt"
    with safe_files.open_no_follow(str(path), "a") as file:
        file.write("one\n")
    with safe_files.open_no_follow(str(path), "ab") as file:
        file.write(b"two\n")
    assert path.read_text() == "one\ntwo\n"
    with pytest.raises(FileExistsError):
        safe_files.open_no_follow(str(path), "x")
    link = tmp_path / "planted.txt"
    target = plant(link, tmp_path)
    for mode in ("w", "a", "x", "wb"):
        with pytest.raises(UsageError) as refused:
            safe_files.open_no_follow(str(link), mode)
        assert str(refused.value) == refusal_of(link)
    assert snapshot(target) == (VICTIM_BYTES, stat.S_IFREG | 0o640)


def test_replacing_writes_whole_files_or_nothing(tmp_path):
    path = tmp_path / "data.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with safe_files.replacing(str(path), "w") as file:
            file.write("half")
            raise RuntimeError("the writer failed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["data.json"]  # no temporary file left
    safe_files.write_atomically(str(path), "new", 0o600)
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert safe_files.create_once(str(tmp_path / "once"), "first") is True
    assert safe_files.create_once(str(tmp_path / "once"), "second") is False
    assert (tmp_path / "once").read_text() == "first" and sorted(os.listdir(tmp_path)) == [
        "data.json",
        "once",
    ]


def test_make_folder_refuses_a_link_below_the_users_folder_and_follows_the_users_own(tmp_path):
    users = tmp_path / "users-link"
    users.symlink_to(tmp_path, target_is_directory=True)  # a link the user names: followed
    safe_files.make_folder(str(users / "run" / "tb"), inside=str(users / "run"))
    assert (tmp_path / "run" / "tb").is_dir()
    target = plant(tmp_path / "run" / "point", tmp_path, folder=True)
    with pytest.raises(UsageError) as refused:
        safe_files.make_folder(str(tmp_path / "run" / "point" / "seed-0"), inside=str(tmp_path / "run"))
    assert str(refused.value) == refusal_of(tmp_path / "run" / "point")
    assert snapshot(target) == [("keep.txt", VICTIM_BYTES, stat.S_IFREG | 0o644)]  # nothing created in it


def test_the_launchers_writer_makes_an_executable_file_and_refuses_a_link_in_one_line(tmp_path):
    path = tmp_path / "new" / "launch_command.sh"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    written = subprocess.run(
        [PYTHON, "-m", "multigpu.safe_files", "write", str(path), "--executable"],
        input=b"#!/bin/sh\n",
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert written.returncode == 0 and path.read_bytes() == b"#!/bin/sh\n" and os.access(path, os.X_OK)
    link = tmp_path / "planted.sh"
    target = plant(link, tmp_path)
    refused = subprocess.run(
        [PYTHON, "-m", "multigpu.safe_files", "write", str(link), "--executable"],
        input="rm -rf ~\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (refused.returncode, refused.stderr) == (2, refusal_of(link) + "\n")
    assert snapshot(target) == (VICTIM_BYTES, stat.S_IFREG | 0o640)


# ---------------------------------------------------------------- every file name the project writes
def launcher(tmp_path: Path, *args: str) -> str:
    """launch_multi_gpu.sh with every answer given (CPU only), up to writing its file: its stderr's last line."""
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            "bash",
            str(REPO / "launch_multi_gpu.sh"),
            "--yes",
            "--gpus",
            "1",
            "--epochs",
            "1",
            "--save-dir",
            str(tmp_path / "save"),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    return result.stderr.splitlines()[-1].removeprefix("launch_multi_gpu.sh: ")


def trainer(tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """A real training run (in process) into the save-dir: refused at its start, before anything is written."""
    assert main_multi_gpu.main([*TINY_SWEEP_RUN, "--no-progress", "--save-dir", str(tmp_path / "save")]) == 2
    return capsys.readouterr().err.strip().removeprefix("error: ")


def sweep(tmp_path: Path, capsys: pytest.CaptureFixture, *flags: str) -> str:
    """The sweep's command line (in process), refused before any run starts."""
    assert sweep_cli.main(["--sweep-dir", str(tmp_path / "sweep"), *flags, "--", *TINY_SWEEP_RUN]) == 2
    return capsys.readouterr().err.strip().removeprefix("error: ")


def sweep_run(tmp_path: Path) -> str:
    """One attempt of a sweep's experiment, as its worker runs it: the outcome's error."""
    save_dir = tmp_path / "sweep" / "lr=0.1" / "seed-0"
    result = run_task(Task(Experiment("lr=0.1", 0, str(save_dir), ("--save-dir", str(save_dir))), attempt=1))
    assert result["status"] == "failed" and result["exit_status"] == 2
    return result["error"]


# name -> (the link planted, whether it points to a folder, the real writer that meets it)
PLANTED = {
    "save-dir .run.lock": ("save/.run.lock", False, lambda tmp, _: SaveDirLock(str(tmp / "save")).acquire()),
    "save-dir last.pt": (
        "save/last.pt",
        False,
        lambda tmp, _: checkpoint.atomic_save({}, str(tmp / "save/last.pt")),
    ),
    "save-dir tb/": ("save/tb", True, trainer),
    "torchrun.log": (
        "save/torchrun.log",
        False,
        lambda tmp, _: torchrun.run(
            ["--log-file", str(tmp / "save/torchrun.log"), "--standalone", "--nproc_per_node=1", "train.py"]
        ),
    ),
    "launch_command.sh": ("save/launch_command.sh", False, lambda tmp, _: launcher(tmp)),
    "launch_slurm.sbatch": ("save/launch_slurm.sbatch", False, lambda tmp, _: launcher(tmp, "--slurm")),
    "predict <output>.partial": (
        "out/p.csv.partial",
        False,
        lambda tmp, _: written_whole(str(tmp / "out/p.csv")).__enter__(),
    ),
    "sweep results.jsonl": (
        "sweep/results.jsonl",
        False,
        lambda tmp, _: records.append_result(
            str(tmp / "sweep/results.jsonl"), {"experiment": "seed-0", "finished": 1}
        ),
    ),
    "sweep progress.json": (
        "sweep/progress.json",
        False,
        lambda tmp, _: records.write_json_atomic(str(tmp / "sweep/progress.json"), {}),
    ),
    "sweep sweep.json": ("sweep/sweep.json", False, lambda tmp, capsys: sweep(tmp, capsys)),
    "sweep .lock": ("sweep/.lock", False, lambda tmp, capsys: sweep(tmp, capsys)),
    "sweep .summary.lock": (
        "sweep/.summary.lock",
        False,
        lambda tmp, _: records.summary_lock(str(tmp / "sweep")).__enter__(),
    ),
    "sweep sweep.sbatch": ("sweep/sweep.sbatch", False, lambda tmp, capsys: sweep(tmp, capsys, "--slurm")),
    "sweep slurm/": ("sweep/slurm", True, lambda tmp, capsys: sweep(tmp, capsys, "--slurm")),
    "sweep train.log": ("sweep/lr=0.1/seed-0/train.log", False, lambda tmp, _: sweep_run(tmp)),
    "sweep run folder": ("sweep/lr=0.1", True, lambda tmp, _: sweep_run(tmp)),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_a_link_planted_for_a_file_the_project_writes_is_refused_and_its_target_untouched(
    case, tmp_path, capsys
):
    name, folder, write = PLANTED[case]
    link = tmp_path / name
    target = plant(link, tmp_path, folder)
    before = snapshot(target)
    assert said(lambda: write(tmp_path, capsys)) == refusal_of(link)
    assert snapshot(target) == before
    assert link.is_symlink() and os.readlink(link) == str(target)  # the link itself is left for its owner


def test_every_write_in_the_project_goes_through_safe_files():
    """The cases above cover the writers there are: a new open-for-writing elsewhere must use the helper."""
    writes = re.compile(
        r"os\.open\([^)]*O_(CREAT|WRONLY|RDWR|APPEND|TRUNC)|\bopen\([^)]*[\"'][wax]b?\+?[\"']"
        r"|mkstemp\(|\.write_(text|bytes)\(|os\.chmod\(|>>? *\"\$|FileSystemWriter\b"
    )
    sources = [
        *REPO.glob("*.py"),
        *REPO.glob("*.sh"),
        *(path for folder in ("multigpu", "data", "models") for path in (REPO / folder).rglob("*.py")),
    ]
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sources
        if path.name != "safe_files.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if writes.search(line) and "os.devnull" not in line
    ]  # /dev/null is no file a run creates
    # The one exemption: DCP's FileSystemWriter writes a sharded checkpoint's files itself, in
    # multigpu/checkpoints/sharded.py only, and only inside the temporary folder that safe_files.make_folder made
    # for that save (renamed into
    # place by safe_files.replace_folder), a folder of the project's own naming where no link was planted.
    dcp_writers = [
        line
        for line in found
        if line.startswith("multigpu/checkpoints/sharded.py:") and "FileSystemWriter" in line
    ]
    assert len(dcp_writers) == 2, found  # the writer a save uses, and the fault injector's subclass of it
    assert [line for line in found if line not in dcp_writers] == []


def test_a_folder_replaces_a_planted_link_not_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(VICTIM_BYTES)
    (tmp_path / "last").symlink_to(victim)
    (tmp_path / "last.tmp").mkdir()
    (tmp_path / "last.tmp" / "shard").write_bytes(b"new")
    safe_files.replace_folder(str(tmp_path / "last.tmp"), str(tmp_path / "last"))
    assert not (tmp_path / "last").is_symlink() and (tmp_path / "last" / "shard").read_bytes() == b"new"
    assert (victim / "keep.txt").read_bytes() == VICTIM_BYTES and not (tmp_path / "last.old.tmp").exists()
