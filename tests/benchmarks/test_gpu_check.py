"""benchmarks/gpu_check.sh: the one command that proves the GPU path (issue 8).

The CPU dry run runs every row's code path with tiny sizes, so the GPU check
cannot rot between the rare times a GPU is available: the table must list
every registered row, none may FAIL, and the JSON must hold the same rows.
The other tests cover what a dry run cannot reach: the one line on a machine
without CUDA, a row that raises, a run that overstays its time (its whole
process tree is killed) and the wheels carried in .whl/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, cli_env, needs_shellcheck, shellcheck_path

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402  (after the path set-up)

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
CPU_STATUSES = {gpu_check.PASS, gpu_check.NOT_APPLICABLE, gpu_check.NO_CUDA}


def run_script(
    *args: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table_rows(markdown: str) -> dict[str, str]:
    """{check: status} from the Markdown table."""
    cells = [line.split(" | ") for line in markdown.splitlines() if line.startswith("| ") and " | " in line]
    return {row[0][2:]: row[1] for row in cells[1:]}  # the first is the header


@pytest.mark.slow
def test_cpu_dry_run_lists_every_row_and_none_fails(tmp_path: Path) -> None:
    output = tmp_path / "out" / "gpu_check.md"
    # Two rows at a time: a dry-run row is mostly one process on one core, and this machine has two. The budget
    # is the loan's (a GPU machine's minutes), not this test's subject: a loaded CI machine took 1,200 s of rows
    # where a quiet one takes a third, and rows left without time would FAIL for the clock alone.
    result = run_script(
        "--cpu-dry-run", "--jobs", "2", "--budget", "1800", "--output", str(output), timeout=2000
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    statuses = table_rows(output.read_text())
    assert list(statuses) == gpu_check.row_names()
    assert set(statuses.values()) <= CPU_STATUSES, statuses
    # One device trains on the CPU as well: those rows are real passes, not skips.
    assert statuses["train fp32"] == statuses["train bf16"] == gpu_check.PASS
    assert output.read_text() in result.stdout  # the table is printed too
    report = json.loads(output.with_suffix(".json").read_text())
    assert report["mode"] == "cpu-dry-run"
    assert [row["name"] for row in report["rows"]] == gpu_check.row_names()
    fp32 = next(row for row in report["rows"] if row["name"] == "train fp32")["raw"]
    assert fp32["losses"][-1] < gpu_check.LOSS_DROP * fp32["losses"][0]


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    output = tmp_path / "gpu_check.md"
    result = run_script("--output", str(output), env=cli_env({"CUDA_VISIBLE_DEVICES": ""}), timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1 and "no CUDA device" in result.stdout, result.stdout
    assert not output.exists()


@pytest.mark.slow
def test_rows_side_by_side_are_for_the_dry_run_only() -> None:
    for args in (["--jobs", "2"], ["--jobs", "0", "--cpu-dry-run"]):
        result = run_script(*args, timeout=120)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.splitlines() == [
            f"gpu_check: --jobs {args[1]}: give 1 or more, and more than 1 only "
            f"with --cpu-dry-run (on GPUs the rows time themselves, so they run "
            f"one at a time) (see --help)"
        ]


def test_rows_run_side_by_side_come_back_in_their_order(tmp_path: Path) -> None:
    started = threading.Barrier(2, timeout=30)  # each row waits for the other to start: side by side
    b_done, finished = threading.Event(), []

    def a(ctx: gpu_check.Context) -> gpu_check.Verdict:
        started.wait()
        assert b_done.wait(timeout=30)  # the first row ends last
        finished.append("a")
        return gpu_check.Verdict(gpu_check.PASS, "a")

    def b(ctx: gpu_check.Context) -> gpu_check.Verdict:
        started.wait()
        finished.append("b")
        b_done.set()
        return gpu_check.Verdict(gpu_check.PASS, "b")

    ctx = gpu_check.Context(True, False, 0, 0.0, tmp_path, time.monotonic() + 60)
    rows = gpu_check.check(ctx, [("a", a), ("b", b)], jobs=2)
    assert finished == ["b", "a"]
    assert [(row.name, row.status, row.figure) for row in rows] == [
        ("a", gpu_check.PASS, "a"),
        ("b", gpu_check.PASS, "b"),
    ]


def test_an_unknown_row_is_refused_in_one_line_naming_the_rows() -> None:
    result = run_script("--only", "dp,warp-drive", "--cpu-dry-run", timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"gpu_check: --only: unknown row(s) warp-drive; rows are: "
        f"{', '.join(gpu_check.row_names())} (see --help)"
    ]


def test_a_row_that_raises_fails_in_one_line_and_the_next_row_still_runs(tmp_path: Path) -> None:
    def broken(ctx: gpu_check.Context) -> gpu_check.Verdict:
        raise ValueError("shape mismatch\nsecond line of the message")

    def working(ctx: gpu_check.Context) -> gpu_check.Verdict:
        return gpu_check.Verdict(gpu_check.PASS, "fine")

    ctx = gpu_check.Context(True, False, 0, 0.0, tmp_path, time.monotonic() + 60)
    rows = gpu_check.check(ctx, [("broken", broken), ("working", working)])
    assert [(row.name, row.status, row.figure) for row in rows] == [
        ("broken", gpu_check.FAIL, "ValueError: second line of the message"),
        ("working", gpu_check.PASS, "fine"),
    ]
    assert gpu_check.exit_status(rows) == 1 and gpu_check.exit_status(rows[1:]) == 0


@pytest.mark.slow
def test_a_run_past_its_time_limit_fails_and_its_whole_process_tree_is_killed(tmp_path: Path) -> None:
    # Like torchrun's workers, the grandchild has a session of its own, out of reach of a process-group kill.
    pid_file = tmp_path / "grandchild.pid"
    child = (
        f"import subprocess; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); p.wait()"
    )
    ctx = gpu_check.Context(True, False, 0, 0.0, tmp_path, time.monotonic() + 60)
    rows = gpu_check.check(ctx, [("slow", lambda ctx: ctx.run([sys.executable, "-c", child], timeout=3))])
    assert rows[0].status == gpu_check.FAIL and rows[0].figure.startswith("timed out after 3s"), rows[0]
    assert rows[0].seconds < 12, rows[0]
    grandchild = Path(f"/proc/{pid_file.read_text()}/stat")
    deadline = time.monotonic() + 10  # SIGKILL is immediate; reaping by the new parent may take a moment
    while grandchild.exists() and grandchild.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the grandchild survived the time limit"
        time.sleep(0.05)


def fake_wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel providing module `name`, whose import prints nothing."""
    path = folder / f"{name}-99.0-py3-none-any.whl"
    info = f"{name}-99.0.dist-info"
    files = {
        f"{name}/__init__.py": "FAKE = True\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 99.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{info}/RECORD", "".join(f"{member},,\n" for member in [*files, f"{info}/RECORD"]))
    return path


@pytest.mark.slow
def test_missing_requirements_come_from_carried_wheels_but_never_torch(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    (checkout / "benchmarks" / "gpu_check.sh").write_text(SCRIPT.read_text())
    (checkout / ".whl").mkdir()
    for name in ("tqdm", "torch"):
        fake_wheel(checkout / ".whl", name)
    subprocess.run(
        [sys.executable, "-m", "venv", str(tmp_path / "bare")], check=True, timeout=120
    )  # no packages
    env = {**os.environ, "PYTHON": str(tmp_path / "bare" / "bin" / "python"), "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(checkout / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    installed, missing = result.stderr.strip().splitlines()[-2:]
    assert "missing torch torchvision tensorboard tqdm numpy; installing 1 wheel(s) from .whl/" in installed
    # tqdm now imports from the installed wheel; torch stays missing: only this machine's own build may be used.
    assert missing.startswith("gpu_check.sh: missing Python modules: torch torchvision tensorboard numpy;")
    assert [
        site.name
        for site in (next(tmp_path.glob("gpu_check_site.*"))).iterdir()
        if not site.name.endswith(".dist-info")
    ] == ["tqdm"]


@needs_shellcheck
def test_gpu_check_sh_passes_shellcheck() -> None:
    shellcheck = shellcheck_path()
    assert shellcheck is not None  # needs_shellcheck
    result = subprocess.run(
        [shellcheck, "--severity=style", str(SCRIPT)], text=True, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stdout
