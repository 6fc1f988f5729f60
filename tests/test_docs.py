"""Every shell command in README.md, QUICK_REFERENCE.md and the guide (MULTI_GPU_GUIDE.md and its pages under
docs/), run: documentation that cannot rot.

- README.md then QUICK_REFERENCE.md run as a new user reads them: every block
  of both, in order, in one fresh clone, so that a command that collides with
  an earlier one (a save-dir, a sweep dir, an output file) fails here; then,
  as a reader who comes back, the commands that write a named output
  (`--output`, `--save-dir`, `--sweep-dir`) once more, which must work again.
  A command an earlier block already ran as written runs once (QUICK_REFERENCE
  repeats README's launcher and modes: the same run again, into a new run-N
  folder, proves nothing the first did not); a repeat within a block, a page's
  own "again", runs.
  Each guide block runs in a fresh clone of its own.
- `bash` blocks run as written, on the CPU, with less data and one epoch through
  MULTIGPU_TEST_ARGS (test-only flags the trainer reads before the command
  line's own, which win). Standard input is a person pressing Enter at every
  question: the launcher's defaults (end of input would stop it, as Ctrl-D does).
- Every command exits 0, and every training command of README.md and
  QUICK_REFERENCE.md reports a validation accuracy above chance (a command that
  trains to chance is a documentation bug even when it exits 0); a guide command
  that reports one is held to the same.
- `sh` blocks need GPUs or a cluster: each command in them must be a launcher
  call, run with `--dry-run` on 8 fake GPUs (tests/fake_bin/nvidia-smi).
- A block after `<!-- illustrative: why -->` is not run; there are at most a handful.
- `tensorboard` is started, asked for its page, and stopped.
- Blocks inside `<!-- pending ... -->` comments name scripts still being built;
  once such a script exists the test says to take the block out of its comment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import GUIDE_PAGES, REPO
from multigpu.config import TrainConfig, field_kind, flag
from multigpu.tuning import autotune

DOCS = ("README.md", "QUICK_REFERENCE.md", *(str(page.relative_to(REPO)) for page in GUIDE_PAGES))
READER = ("README.md", "QUICK_REFERENCE.md")  # read in this order by a new user, in one clone
MAX_ILLUSTRATIVE = 7  # a handful: the test suite, multi-GPU examples, benchmarks of minutes (the search's: 7)
# 2048 samples: the least with which the documented commands learn in one epoch (1024 left some near chance).
SHRINK = "--epochs 1 --train-size 2048 --val-size 64 --batch-size 16 --no-progress --log-every 16 --dist-timeout 60"
# The built-in data sets have 10 classes: chance is 0.1, and on 64 validation samples it reads below 0.2.
ABOVE_CHANCE = 0.3
TRAINS = re.compile(r"\b(main_multi_gpu|sweep_multi_gpu)\.py\b|\blaunch_multi_gpu\.sh\b")
# A command that writes where its flags say (not a new run-N folder of its own): a reader runs it twice.
NAMED_OUTPUT = re.compile(r"--(output|save-dir|sweep-dir)\b")
# A port named in a command fails wherever anything else holds it: documented commands leave it to the launcher.
FIXED_PORT = re.compile(r"--(master[-_]port|rdzv[-_]endpoint)[ =]\S*\d")
COMMAND_TIMEOUT = 240
ENTER_AT_EVERY_QUESTION = "\n" * 32  # more than the launcher asks
FAKE_BIN = REPO / "tests" / "fake_bin"


@dataclass
class Block:
    """A fenced code block: where it is, its language, its commands, and why it is not run (if so)."""

    where: str
    lang: str
    commands: list[str]
    illustrative: str | None = None
    pending: bool = False

    @property
    def doc(self) -> str:
        return self.where.split(":")[0]


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
                found.append(
                    Block(f"{doc}:{i + 1}", fence.group(1), commands_of(lines[i + 1 : end]), mark, pending)
                )
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


def fresh_clone(checkout: Path = REPO) -> Path:
    """The checkout's files as a fresh clone has them (those git tracks, as the working tree has them; a new file
    counts once `git add`ed), copied into a temporary folder, so that commands write there and never into the
    checkout. Untracked files stay behind: what a documented command left in the checkout (QUICK_REFERENCE's
    predictions.csv) made a later page's command, which writes the same file, fail.

    Its .venv is the environment running the tests, stamped as built from this
    requirements.txt and pyproject.toml, as scripts/ensure_env.sh leaves it: the README's set-up
    command then finds it ready, as it does after the first time.
    """
    folder = Path(tempfile.mkdtemp(prefix="docs-"))
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached"], cwd=checkout, capture_output=True, text=True, check=True
    ).stdout
    for name in filter(None, listed.split("\0")):
        if (checkout / name).exists():  # not a file deleted in the working tree
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(checkout / name, folder / name, follow_symlinks=False)
    venv = folder / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if not entry.name.startswith("."):
            (venv / entry.name).symlink_to(entry)
    # The stamp scripts/ensure_env.sh writes: the hash of requirements.txt and pyproject.toml together.
    built_from = (checkout / "requirements.txt").read_bytes() + (checkout / "pyproject.toml").read_bytes()
    (venv / ".requirements.sha256").write_text(hashlib.sha256(built_from).hexdigest() + "\n")
    return folder


def environment(block: Block) -> dict[str, str]:
    # One thread per process: two sequences run side by side on a 2-core machine, and torch's threads of a
    # one-process command would only spin against them (the launcher sets the same for its processes). Torch's
    # default thread count is left to the tests that run in pytest's own process.
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MULTIGPU_TEST_ARGS": SHRINK,
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "LAUNCH_DEFAULT_PORT": str(free_port()),
        "LAUNCH_INPUT_TIMEOUT": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    if block.lang == "sh":
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(PATH=f"{FAKE_BIN}{os.pathsep}{env['PATH']}", FAKE_GPU_COUNT="8")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def as_dry_run(command: str) -> str | None:
    """A launcher command with --dry-run added (before any `--`), or None for anything else."""
    if not re.search(r"\blaunch_multi_gpu\.sh\b", command):
        return None
    return re.sub(r"(launch_multi_gpu\.sh)(\s|$)", r"\1 --dry-run\2", command, count=1)


def serve_tensorboard(command: str, folder: Path, env: dict[str, str]) -> str | None:
    """Start tensorboard as written (on a free port unless one is given), fetch its page, stop it."""
    words = shlex.split(command.split("#")[0])
    if "--port" not in words:
        words += ["--port", str(free_port())]
    server = subprocess.Popen(
        words, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        url, seen = None, ""
        while url is None and time.monotonic() < deadline and server.poll() is None:
            assert server.stdout is not None  # a pipe
            line = server.stdout.readline()
            seen += line
            found = re.search(r"(http://\S+?:\d+/)", line)
            url = found.group(1) if found else None
        if url is None:
            return f"tensorboard did not start:\n{seen[-2000:]}"
        with urllib.request.urlopen(url.replace("localhost", "127.0.0.1"), timeout=30) as page:
            return (
                None
                if page.status == 200 and b"TensorBoard" in page.read()
                else f"{url}: no TensorBoard page"
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def accuracies(output: str) -> list[float]:
    """Every final validation accuracy a command reported: its runs' `done:` lines, and a sweep's (a search's)
    results."""
    found = [float(value) for value in re.findall(r"^done: best val acc ([\d.]+)", output, re.M)]
    for sweep_dir in re.findall(r"^(?:sweep|search) done: .* summary (\S+)/summary\.md", output, re.M):
        for results in Path(sweep_dir).glob("results*.jsonl"):
            found += [json.loads(line)["metrics"]["val_acc"] for line in results.read_text().splitlines()]
    return found


def learning_failure(block: Block, command: str, output: str) -> str | None:
    """Why a training command's output shows it did not learn; None when it did, or is no training command."""
    if not TRAINS.search(command) or re.search(r"--(dry-run|help|slurm)\b", command):
        return None
    found = accuracies(output)
    if not found:
        return None if block.doc not in READER else f"`{command}` reported no validation accuracy"
    if min(found) < ABOVE_CHANCE:
        return f"`{command}` trained to chance: val acc {min(found):.4f} < {ABOVE_CHANCE} (10 classes)"
    return None


def first_runs(blocks: list[Block]) -> list[Block]:
    """The blocks without the commands an earlier block has (run as written by then, in the same clone); a
    command repeated within its own block stays."""
    ran: set[tuple[str, str]] = set()
    kept = []
    for block in blocks:
        kept.append(
            dataclasses.replace(block, commands=[c for c in block.commands if (block.lang, c) not in ran])
        )
        ran.update((block.lang, command) for command in block.commands)
    return kept


def run_blocks(blocks: list[Block], again: bool = False) -> list[str]:
    """Run the blocks' commands in order in one fresh clone, as a reader would (each command once:
    `first_runs`); the failures, described. `again`: then run every command that writes a named output a second
    time, in order, as a reader who comes back to the document does (the others write new folders of their own
    each time)."""
    blocks = first_runs(blocks)
    folder, failures = fresh_clone(), []
    cloned = files_in(folder)
    started = time.monotonic()
    for block in blocks:
        env = environment(block)
        for command in block.commands:
            problem = run_command(block, command, folder, env)
            if problem:
                failures.append(f"{block.where}: {problem}")
                break  # later commands of a block may build on this one
        if failures:
            break  # and later blocks on earlier ones
    for block in blocks if again and not failures else []:
        for command in filter(NAMED_OUTPUT.search, block.commands):
            problem = run_command(block, command, folder, environment(block))
            if problem:
                failures.append(f"{block.where}: run a second time: {problem}")
                break
    stray = unignored(files_in(folder) - cloned)
    if stray and not failures:
        failures.append(
            f"{blocks[0].where}..: the commands left {', '.join(stray[:6])} in the checkout, where `git status` "
            f"lists them: write them under checkpoints/ or runs/ (ignored)"
        )
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    print(
        f"{blocks[0].where}..: {sum(len(block.commands) for block in blocks)} command(s) in "
        f"{time.monotonic() - started:.1f}s"
    )  # with -s
    return failures


def files_in(folder: Path) -> set[str]:
    """The files under `folder` (its .venv aside), relative to it."""
    return {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if not path.is_dir() and path.relative_to(folder).parts[0] != ".venv"
    }


def unignored(names: set[str]) -> list[str]:
    """Those of `names` (paths in the checkout) that the checkout's .gitignore does not ignore: `git status` would
    list them as new files of the user's."""
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin", "-z"],
        cwd=REPO,
        input="\0".join(sorted(names)),
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    return sorted(names - set(ignored))


def run_command(block: Block, command: str, folder: Path, env: dict[str, str]) -> str | None:
    """Run one documented command in `folder`; what went wrong, or None."""
    runnable = command if block.lang == "bash" else as_dry_run(command)
    if runnable is None:
        return (
            f"`{command}` needs GPUs but is no launcher call to dry-run: make it run on the CPU (a bash "
            f"block) or mark the block <!-- illustrative: why -->"
        )
    if command.startswith("tensorboard "):
        problem = serve_tensorboard(runnable, folder, env)
        return f"`{command}`: {problem}" if problem else None
    started = time.monotonic()
    # A session of its own, killed whole on a timeout: a command's own children (a benchmark's workers) would
    # otherwise run on, orphaned, and slow every later test.
    process = subprocess.Popen(
        ["bash", "-c", runnable],
        cwd=folder,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(ENTER_AT_EVERY_QUESTION, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return f"`{runnable}` ran past {COMMAND_TIMEOUT}s"
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    print(f"{block.where}: {time.monotonic() - started:5.1f}s `{runnable}`")  # with -s: where the time goes
    if result.returncode != 0:
        return f"`{runnable}` exited {result.returncode}:\n{result.stdout[-1500:]}{result.stderr[-2500:]}"
    problem = learning_failure(block, runnable, result.stdout + result.stderr)
    if TRAINS.search(runnable):
        print(f"{block.where}: `{runnable}`: val acc {accuracies(result.stdout + result.stderr)}")  # with -s
    return f"{problem}:\n{result.stdout[-1500:]}{result.stderr[-1000:]}" if problem else None


def checkout_state() -> set[str]:
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line for line in status.splitlines() if "__pycache__" not in line and ".pytest_cache" not in line}


@pytest.mark.slow
def test_every_documented_command_runs(tmp_path: Path) -> None:
    runnable = [block for block in all_blocks() if not block.illustrative and not block.pending]
    reader = [block for doc in READER for block in runnable if block.doc == doc]  # all of them, repeats too
    read = {tuple(block.commands) for block in reader}
    guide = list(
        {
            tuple(block.commands): block
            for block in runnable
            if block.doc not in READER and tuple(block.commands) not in read
        }.values()
    )  # the rest, once
    guide.sort(key=lambda block: (block.lang == "bash", len(block.commands)), reverse=True)  # long ones first
    sequences = [reader] + [[block] for block in guide]  # the reader's sequence first: it is the longest
    before = checkout_state()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(run_blocks, sequences, [True] + [False] * len(guide))  # the reader comes back
        failures = [failure for result in results for failure in result]
    assert not failures, "\n\n".join(failures)
    assert (
        sum(len(block.commands) for block in reader + guide) >= 15
    )  # the parser found the documents' commands
    assert checkout_state() == before, "a documented command wrote into the checkout"


def test_a_command_an_earlier_block_ran_runs_once_and_a_repeat_within_a_block_runs_again() -> None:
    readme = Block("README.md:1", "bash", ["python train.py", "bash launch.sh"])
    reference = Block("QUICK_REFERENCE.md:1", "bash", ["python train.py", "sweep", "sweep"])
    dry_run = Block("QUICK_REFERENCE.md:9", "sh", ["bash launch.sh"])  # another command: run with --dry-run
    assert [block.commands for block in first_runs([readme, reference, dry_run])] == [
        ["python train.py", "bash launch.sh"],
        ["sweep", "sweep"],
        ["bash launch.sh"],
    ]


def test_documented_commands_name_no_fixed_rendezvous_port() -> None:
    """`--master-port 29500` in the multi-node example failed (`port 29500 is busy`) whenever anything held it:
    commands that run leave the port to the launcher (its default, a free one in these tests)."""
    fixed = [
        f"{block.where}: {command}"
        for block in all_blocks()
        if not block.illustrative
        for command in block.commands
        if FIXED_PORT.search(command)
    ]
    assert not fixed, fixed


def test_only_a_handful_of_blocks_are_illustrative_and_each_says_why() -> None:
    illustrative = [block for block in all_blocks() if block.illustrative]
    assert len(illustrative) <= MAX_ILLUSTRATIVE, [block.where for block in illustrative]
    assert all(block.illustrative != "illustrative" for block in illustrative), (
        "say why: <!-- illustrative: why -->"
    )


def test_pending_blocks_name_scripts_that_do_not_exist_yet() -> None:
    pending = [block for block in all_blocks() if block.pending]
    for block in pending:
        for script in re.findall(r"\b[\w/]+\.py\b", " ".join(block.commands)):
            assert not (REPO / script).exists(), (
                f"{block.where}: {script} exists now: take its block out of the <!-- pending --> comment"
            )


def test_commands_that_run_on_the_cpu_ask_for_no_bf16_or_fp16() -> None:
    """A `bash` block runs as written on a CPU, where bf16 is emulated unless the processor has bf16 units:
    QUICK_REFERENCE's `--amp bf16` command took 509 s at 54 samples/s against 220-760 in fp32. `--amp auto` picks
    fp32 there and bf16 on GPUs."""
    asking = [
        f"{block.where}: {command}"
        for block in all_blocks()
        if block.lang == "bash"
        for command in block.commands
        if re.search(r"--amp[ =](bf16|fp16)\b", command)
    ]
    assert not asking, asking


# A relative link of Markdown: [label](target#anchor), not a web address or an anchor of the same page.
RELATIVE_LINK = re.compile(r"\[([^\]]*)\]\((?!https?:|mailto:|#)([^)#\s]+)(#[^)\s]*)?\)")


def test_links_open_what_they_name_on_github_as_on_the_site() -> None:
    """GitHub resolves a link from the page's own folder: 14 links of docs/ written `../checkpoints.md` worked on
    the site only (scripts/mkdocs_hooks.py maps the checkout's links for the site), and README's links labelled
    MULTI_GPU_GUIDE.md opened other pages."""
    pages = [REPO / doc for doc in DOCS] + sorted((REPO / "docs" / "reference").glob("*.md"))
    broken, mislabelled = [], []
    for page in pages:
        for label, target, _ in RELATIVE_LINK.findall(page.read_text()):
            opened = (page.parent / target).resolve()
            where = f"{page.relative_to(REPO)}: [{label}]({target})"
            if not opened.exists():
                broken.append(where)
            elif re.fullmatch(r"[\w./-]+\.md", label) and Path(label).name != opened.name:
                mislabelled.append(where)
    assert not broken, broken
    assert not mislabelled, mislabelled


def test_a_fresh_clone_holds_the_tracked_files_only(tmp_path: Path) -> None:
    """Not an output a documented command left in the checkout (predictions.csv): a later page's command that
    writes it again without --overwrite failed on the copy."""
    checkout = tmp_path / "checkout"
    (checkout / "docs").mkdir(parents=True)
    for name in ("requirements.txt", "pyproject.toml", "docs/page.md", "predictions.csv"):
        (checkout / name).write_text(name)
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(
        ["git", "add", "requirements.txt", "pyproject.toml", "docs/page.md"], cwd=checkout, check=True
    )
    clone = fresh_clone(checkout)
    try:
        assert sorted(
            path.relative_to(clone).as_posix()
            for path in clone.rglob("*")
            if path.is_file() and ".venv" not in path.parts
        ) == ["docs/page.md", "pyproject.toml", "requirements.txt"]
    finally:
        shutil.rmtree(clone)


def test_the_files_documented_commands_leave_are_checked_against_gitignore(tmp_path: Path) -> None:
    """README's `--save-dir trained` and `--output top3.csv` left both in the checkout, listed by `git status` as
    the user's new files: what a run of the documented commands leaves outside checkpoints/ and runs/ fails it."""
    for name in (
        "README.md",
        "checkpoints/run-1/last.pt",
        "runs/demo/train.log",
        "trained/train.log",
        "top3.csv",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    assert unignored(files_in(tmp_path) - {"README.md"}) == ["top3.csv", "trained/train.log"]


def mkdocs_hooks() -> Any:
    """scripts/mkdocs_hooks.py, as mkdocs loads it (it needs mkdocs: `bash scripts/ensure_env.sh docs`)."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: bash scripts/ensure_env.sh docs")
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None  # a .py file that is there
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_reference_lists_every_trainconfig_field_with_its_flag_type_default_and_help() -> None:
    """The API reference's TrainConfig page listed no field, only properties such as `loggers`: mkdocstrings shows
    what has a docstring, and a field's help is its metadata. The page gets TrainConfig's own table."""
    page = mkdocs_hooks().with_fields((REPO / "docs" / "reference" / "config.md").read_text(), str(REPO))
    rows = {line.split("`", 2)[1]: line for line in page.splitlines() if line.startswith("| `--")}
    for field in dataclasses.fields(TrainConfig):
        row = rows.pop(f"--{flag(field.name)}")
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[0].endswith(f"(`{field.name}`)") and cells[2] == f"`{field.default!r}`", row
        assert cells[1].startswith(field_kind(field)), row
        assert cells[3].replace("\\|", "|").replace("&lt;", "<") == field.metadata["help"], row
    assert not rows, rows


def test_what_an_autotune_command_says_of_its_trials_holds_on_any_machine() -> None:
    """QUICK_REFERENCE said `the first 10 pick the faster memory format` where the run said `steps 1-20 measured`:
    how many settings --autotune tries depends on the machine (its threads), 5 steps each."""
    said = [
        (doc, line)
        for doc in DOCS
        for line in (REPO / doc).read_text().splitlines()
        if re.match(r"(python|torchrun|bash) .*--autotune.*  # ", line)
    ]  # a command, and what it says
    assert said, "no documented --autotune command"
    for where, line in said:
        comment = line.split("  # ", 1)[1]
        assert not re.search(r"\bfirst \d+\b", comment), (where, comment)
        assert f"{autotune.STEPS_EACH} per setting" in comment, (where, comment)


# How long something takes: "about 20 s", "took 40 s", "3 minutes 51 s" (not a setting's "default 300 s").
TIMING = re.compile(r"\b(about|took|takes) \d[\d,.]* ?(s|seconds|minutes?)\b|\b\d+ minutes? \d+ s\b")


def test_the_timings_a_reader_is_promised_say_they_were_measured_on_a_quiet_machine() -> None:
    """README's sweep, "about 20 s on 2 CPU cores", took 182 s on a machine other jobs kept busy."""
    unsaid = [
        f"{doc}: {paragraph.strip()[:120]}"
        for doc in READER + ("MULTI_GPU_GUIDE.md",)
        for paragraph in re.split(r"\n\s*\n", (REPO / doc).read_text())
        if TIMING.search(paragraph) and "quiet" not in paragraph
    ]
    assert not unsaid, unsaid


def test_a_training_command_that_ends_at_chance_fails_the_docs(tmp_path: Path) -> None:
    readme, guide = Block("README.md:1", "bash", []), Block("MULTI_GPU_GUIDE.md:1", "bash", [])
    at_chance = "step 16: loss 2.3026\ndone: best val acc 0.1000, 1 epochs, wall time 3.1s, 660 samples/s\n"
    assert "trained to chance" in (learning_failure(readme, "python main_multi_gpu.py", at_chance) or "")
    assert learning_failure(readme, "python main_multi_gpu.py", at_chance.replace("0.1000", "0.9531")) is None
    assert "no validation accuracy" in (
        learning_failure(readme, "bash launch_multi_gpu.sh --yes", "done\n") or ""
    )
    assert (
        learning_failure(guide, "python main_multi_gpu.py --model mlp", "done: best val loss 0.01\n") is None
    )
    assert learning_failure(readme, "bash launch_multi_gpu.sh --dry-run", "") is None
    (tmp_path / "results.jsonl").write_text(
        "\n".join(json.dumps({"metrics": {"val_acc": acc}}) for acc in (0.9, 0.12))
    )
    sweep_output = f"sweep done: 2 of 2 experiments ok; summary {tmp_path}/summary.md (and summary.csv)\n"
    assert accuracies(sweep_output) == [0.9, 0.12]
    assert "0.1200" in (
        learning_failure(readme, "python sweep_multi_gpu.py --num-seeds 2", sweep_output) or ""
    )


def test_the_guides_site_builds_with_no_broken_link_page_or_anchor(tmp_path: Path) -> None:
    """mkdocs.yml's site of the guide's pages and the API reference, built with --strict: a link to a page or an
    anchor that is not there, a page missing from the navigation, or a docstring the reference cannot read fails."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed: bash scripts/ensure_env.sh docs")
    built = subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "index.html").is_file() and (
        tmp_path / "site" / "reference" / "trainer"
    ).is_dir()
    reference = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert all(f"--{flag(field.name)}</code>" in reference for field in dataclasses.fields(TrainConfig))
