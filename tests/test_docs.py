"""Every shell command in README.md, QUICK_REFERENCE.md and MULTI_GPU_GUIDE.md, run: documentation that cannot rot.

- `bash` blocks run as written, each block in a fresh temporary folder that
  links to the checkout's files (nothing is written into the checkout), on the
  CPU, with smaller data and fewer epochs through MULTIGPU_TEST_ARGS (test-only
  flags the trainer reads before the command line's own, which win). Standard
  input is a person pressing Enter at every question: the launcher's defaults
  (end of input would stop it, as Ctrl-D does).
- `sh` blocks need GPUs or a cluster: each command in them must be a launcher
  call, run with `--dry-run` on 8 fake GPUs (tests/fake_bin/nvidia-smi).
- A block after `<!-- illustrative: why -->` is not run; there are at most a handful.
- `tensorboard` is started, asked for its page, and stopped.
- Blocks inside `<!-- pending ... -->` comments name scripts still being built;
  once such a script exists the test says to take the block out of its comment.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from conftest import REPO

DOCS = ("README.md", "QUICK_REFERENCE.md", "MULTI_GPU_GUIDE.md")
MAX_ILLUSTRATIVE = 6  # a handful: the test suite, multi-GPU examples, benchmarks of minutes
SHRINK = "--epochs 1 --train-size 256 --val-size 32 --batch-size 16 --no-progress --log-every 4 --dist-timeout 60"
COMMAND_TIMEOUT = 240
ENTER_AT_EVERY_QUESTION = "\n" * 32  # more than the launcher asks
FAKE_BIN = REPO / "tests" / "fake_bin"
OUTPUTS = ("checkpoints", "runs", "datasets", ".pytest_cache")  # never linked: commands write their own


@dataclass
class Block:
    """A fenced code block: where it is, its language, its commands, and why it is not run (if so)."""

    where: str
    lang: str
    commands: list[str]
    illustrative: Optional[str] = None
    pending: bool = False


def commands_of(lines: list[str]) -> list[str]:
    """Shell commands: continued lines joined; comment lines, and comments after two spaces, dropped."""
    text = "\n".join(lines).replace("\\\n", " ")
    commands = [re.sub(r"\s{2,}#.*$", "", line).strip() for line in text.splitlines()]
    return [command for command in commands if command and not command.startswith("#")]


def blocks_of(doc: str) -> list[Block]:
    lines = (REPO / doc).read_text().splitlines()
    found, mark, pending, i = [], None, False, 0
    while i < len(lines):
        line = lines[i]
        marker = re.fullmatch(r"\s*<!--\s*illustrative:?\s*(.*?)\s*-->\s*", line)
        if marker:
            mark = marker.group(1) or "illustrative"
        elif line.lstrip().startswith("<!--") and "-->" not in line:
            pending = line.lstrip().startswith("<!-- pending")
            if not pending:
                while "-->" not in lines[i]:  # an ordinary comment: skip it
                    i += 1
        elif pending and "-->" in line:
            pending = False
        fence = re.fullmatch(r"```(\w*)\s*", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) in ("bash", "sh"):
                found.append(Block(f"{doc}:{i + 1}", fence.group(1), commands_of(lines[i + 1:end]), mark, pending))
            mark, i = None, end
        elif line.strip() and not marker:
            mark = None
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in blocks_of(doc)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workspace() -> Path:
    """A fresh folder linking to the checkout's files, so commands run as from the checkout but write here.

    Its .venv is the environment running the tests, stamped as built from this
    requirements.txt and pyproject.toml, as scripts/ensure_env.sh leaves it: the README's set-up
    command then finds it ready, as it does after the first time.
    """
    folder = Path(tempfile.mkdtemp(prefix="docs-"))
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in sorted({path.split("/")[0] for path in tracked.split()}):
        if (REPO / name).exists() and name not in OUTPUTS:
            (folder / name).symlink_to(REPO / name)
    venv = folder / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if not entry.name.startswith("."):
            (venv / entry.name).symlink_to(entry)
    # The stamp scripts/ensure_env.sh writes: the hash of requirements.txt and pyproject.toml together.
    built_from = (REPO / "requirements.txt").read_bytes() + (REPO / "pyproject.toml").read_bytes()
    (venv / ".requirements.sha256").write_text(hashlib.sha256(built_from).hexdigest() + "\n")
    return folder


def environment(block: Block, port_base: int) -> dict[str, str]:
    env = {**os.environ, "PYTHON": sys.executable, "MULTIGPU_TEST_ARGS": SHRINK, "PYTHONDONTWRITEBYTECODE": "1",
           "LAUNCH_DEFAULT_PORT": str(port_base), "LAUNCH_INPUT_TIMEOUT": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if block.lang == "sh":
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(PATH=f"{FAKE_BIN}{os.pathsep}{env['PATH']}", FAKE_GPU_COUNT="8")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def as_dry_run(command: str) -> Optional[str]:
    """A launcher command with --dry-run added (before any `--`), or None for anything else."""
    if not re.search(r"\blaunch_multi_gpu\.sh\b", command):
        return None
    return re.sub(r"(launch_multi_gpu\.sh)(\s|$)", r"\1 --dry-run\2", command, count=1)


def serve_tensorboard(command: str, folder: Path, env: dict[str, str]) -> Optional[str]:
    """Start tensorboard as written (on a free port unless one is given), fetch its page, stop it."""
    words = shlex.split(command.split("#")[0])
    if "--port" not in words:
        words += ["--port", str(free_port())]
    server = subprocess.Popen(words, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        url, seen = None, ""
        while url is None and time.monotonic() < deadline and server.poll() is None:
            line = server.stdout.readline()
            seen += line
            found = re.search(r"(http://\S+?:\d+/)", line)
            url = found.group(1) if found else None
        if url is None:
            return f"tensorboard did not start:\n{seen[-2000:]}"
        with urllib.request.urlopen(url.replace("localhost", "127.0.0.1"), timeout=30) as page:
            return None if page.status == 200 and b"TensorBoard" in page.read() else f"{url}: no TensorBoard page"
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run_block(block: Block, port_base: int) -> list[str]:
    """Run a block's commands in order in one fresh folder; the failures, described."""
    folder, env, failures = workspace(), environment(block, port_base), []
    started = time.monotonic()
    for command in block.commands:
        runnable = command if block.lang == "bash" else as_dry_run(command)
        if runnable is None:
            failures.append(f"{block.where}: `{command}` needs GPUs but is no launcher call to dry-run: make it run "
                            f"on the CPU (a bash block) or mark the block <!-- illustrative: why -->")
            continue
        if command.startswith("tensorboard "):
            problem = serve_tensorboard(runnable, folder, env)
            if problem:
                failures.append(f"{block.where}: `{command}`: {problem}")
            continue
        try:
            result = subprocess.run(["bash", "-c", runnable], cwd=folder, env=env, input=ENTER_AT_EVERY_QUESTION,
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            failures.append(f"{block.where}: `{runnable}` ran past {COMMAND_TIMEOUT}s")
            break
        if result.returncode != 0:
            failures.append(f"{block.where}: `{runnable}` exited {result.returncode}:\n"
                            f"{result.stdout[-1500:]}{result.stderr[-2500:]}")
            break  # later commands of a block may build on this one
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    print(f"{block.where}: {len(block.commands)} command(s) in {time.monotonic() - started:.1f}s")  # with -s
    return failures


def checkout_state() -> set[str]:
    status = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return {line for line in status.splitlines() if "__pycache__" not in line and ".pytest_cache" not in line}


def test_every_documented_command_runs(tmp_path: Path) -> None:
    runnable = [block for block in all_blocks() if not block.illustrative and not block.pending]
    unique = list({tuple(block.commands): block for block in runnable}.values())  # the same block once
    unique.sort(key=lambda block: (block.lang == "bash", len(block.commands)), reverse=True)  # long ones first
    before = checkout_state()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(run_block, unique, [30000 + 200 * i for i in range(len(unique))])
        failures = [failure for result in results for failure in result]
    assert not failures, "\n\n".join(failures)
    assert sum(len(block.commands) for block in unique) >= 15  # the parser found the documents' commands
    assert checkout_state() == before, "a documented command wrote into the checkout"


def test_only_a_handful_of_blocks_are_illustrative_and_each_says_why() -> None:
    illustrative = [block for block in all_blocks() if block.illustrative]
    assert len(illustrative) <= MAX_ILLUSTRATIVE, [block.where for block in illustrative]
    assert all(block.illustrative != "illustrative" for block in illustrative), "say why: <!-- illustrative: why -->"


def test_pending_blocks_name_scripts_that_do_not_exist_yet() -> None:
    pending = [block for block in all_blocks() if block.pending]
    for block in pending:
        for script in re.findall(r"\b[\w/]+\.py\b", " ".join(block.commands)):
            assert not (REPO / script).exists(), (
                f"{block.where}: {script} exists now: take its block out of the <!-- pending --> comment")
