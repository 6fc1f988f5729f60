"""Killed, preempted and restarted 2-process DDP runs (real torchrun, gloo, CPU) continue to the same weights.

Every scenario is compared with one uninterrupted run of the same command (the
module-scoped `reference`). Processes die through the test-only fault injector
(MULTIGPU_FAULT_INJECT), so each one dies at an exact step, or in an exact
phase of a save, without sleeps or timing guesses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    REPO,
    RUN_TIMEOUT,
    TINY,
    assert_ok,
    blobs,
    cli_command,
    cli_env,
    config_for,
    free_port,
    preloaded_context,
    run_cli,
    run_cli_ranks,
    run_ranks,
    tiny_model,
)
from multigpu.checkpoints import checkpoint
from multigpu.config import TrainConfig
from multigpu.data import build_datasets
from multigpu.models import build_model
from multigpu.resilience.faults import FAULT_ENV
from multigpu.resilience.preemption import StopRequest
from train_multi_gpu import MultiGPUTrainer

# 8 steps per epoch with 2 processes; step checkpoints at 5, 10, 15, 20 (2 kept); last.pt at 8, 16, 24.
ARGS = [
    *TINY,
    "--model",
    "mlp",
    "--mode",
    "flatten",
    "--epochs",
    "3",
    "--log-every",
    "1",
    "--save-every-steps",
    "5",
    "--keep-last",
    "2",
]
FINAL_STEP = 24


def run(
    save_dir: Path, *extra: str, fault: str = "", nproc: int | None = 2, torchrun_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """One CLI run into `save_dir`, with rank:step[:save] of the fault injector when given."""
    return run_cli(
        [*ARGS, "--save-dir", str(save_dir), *extra],
        nproc=nproc,
        torchrun_args=torchrun_args,
        env={FAULT_ENV: fault} if fault else None,
    )


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + (result.stderr or "")


def assert_failed(result: subprocess.CompletedProcess) -> None:
    assert result.returncode != 0, output(result)


def resumed_from(output: str) -> str:
    """The 'resumed from PATH: epoch E, step S, N samples into the epoch' part of the run's output."""
    lines = [line for line in output.splitlines() if line.startswith("resumed from ")]
    assert len(lines) == 1, output
    return lines[0].split("resumed from ", 1)[1]


def files(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def assert_same_training_state(path: Path, reference: Path) -> float:
    """Model, optimizer and scheduler of two checkpoints are bitwise equal; returns the max weight difference."""
    ours, theirs = checkpoint.load(str(path)), checkpoint.load(str(reference))
    assert (ours["global_step"], ours["epoch"]) == (theirs["global_step"], theirs["epoch"]) == (FINAL_STEP, 3)
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    for index, state in theirs["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(ours["optimizer"]["state"][index][key], tensor), (index, key)
    assert ours["scheduler"] == theirs["scheduler"]
    return max((ours["model"][n] - t).abs().max().item() for n, t in theirs["model"].items())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """last.pt of the uninterrupted run that every interrupted one must reproduce."""
    save_dir = tmp_path_factory.mktemp("reference")
    assert_ok(run(save_dir))
    assert files(save_dir) == [
        "best.pt",
        "last.pt",
        "step-000000015.pt",
        "step-000000020.pt",
    ]  # --keep-last 2
    return save_dir


@pytest.mark.slow
def test_reference_checkpoint_is_complete_and_loads_weights_only(reference):
    state = checkpoint.load(str(reference / "last.pt"))  # weights_only=True, the only way the project loads
    assert not any(
        key.startswith(("module.", "_orig_mod.")) for key in state["model"]
    )  # unwrapped (PITFALLS 8)
    assert (state["world_size"], len(state["rng"]), state["sampler_seed"], state["train_size"]) == (
        2,
        2,
        0,
        512,
    )
    assert set(state["rng"][0]) == {"torch", "cuda", "python", "numpy"}
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])  # per rank: seed + rank
    assert state["config"]["model"] == "mlp" and state["torch_version"] == str(torch.__version__)
    assert state["monitor"] == "val_acc" and state["best_value"] > 0.5 and state["scaler"] == {}
    assert (state["optimizer_class"], state["scheduler_class"], state["format_version"]) == (
        "AdamW",
        "LambdaLR",
        2,
    )


def start_cli(save_dir: Path, *extra: str) -> subprocess.Popen:
    """A 2-process run whose output the test reads line by line as it is printed."""
    return subprocess.Popen(
        cli_command([*ARGS, "--save-dir", str(save_dir), *extra], nproc=2),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank: a child of the launcher with that variable set."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # not a process, or it just ended
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def sigterm_rank_at(save_dir: Path, rank: int, line_start: str, *extra: str) -> subprocess.CompletedProcess:
    """Run, send SIGTERM to one rank's process when rank 0 prints a line starting with `line_start`,
    and return the whole output once the run ends."""
    with start_cli(save_dir, *extra) as process:
        watchdog = threading.Timer(RUN_TIMEOUT, process.kill)  # a hang fails the test instead of stalling CI
        watchdog.start()
        lines = []
        assert process.stdout is not None  # a pipe
        for line in process.stdout:
            lines.append(line)
            if line.startswith(line_start):
                os.kill(worker_pid(process.pid, rank), signal.SIGTERM)
        watchdog.cancel()
        return subprocess.CompletedProcess(process.args, process.wait(), "".join(lines), "")


@pytest.mark.slow
def test_killed_and_preempted_runs_resume_to_identical_weights(reference, tmp_path):
    """One job interrupted four times, each leg continuing the last with --resume auto."""
    save_dir = tmp_path / "run"

    # Leg 1: rank 1 dies after step 7, mid-epoch; its peer names it instead of waiting for the timeout, and
    # keeps step 7 from its own replica (the periodic checkpoint was step 5).
    result = run(save_dir, fault="1:7")
    assert_failed(result)
    out = output(result)
    assert "rank 0: lost contact with rank 1, which died or hung" in out
    assert "rank 0: checkpoint of the last completed step (7) written from rank 0's replica" in out
    assert files(save_dir) == ["step-000000005.pt", "step-000000007.pt"]

    # Leg 2: continues mid-epoch from step 7, passes the epoch end and dies right after it, at step 9.
    result = run(save_dir, "--resume", "auto", fault="1:9")
    assert_failed(result)
    out = output(result)
    assert (
        resumed_from(out) == f"{save_dir / 'step-000000007.pt'}: epoch 1, step 7, 448 samples into the epoch"
    )

    # Leg 3: continues from step 9, which rank 0 kept past the epoch boundary; rank 0 is SIGKILLed inside the
    # save of step 10, with the new file complete but not yet renamed: the previous checkpoints stay as they were.
    result = run(save_dir, "--resume", "auto", fault="0:10:save")
    assert_failed(result)
    out = output(result)
    assert (
        resumed_from(out) == f"{save_dir / 'step-000000009.pt'}: epoch 2, step 9, 64 samples into the epoch"
    )
    assert "rank 1: lost contact with rank 0" in out
    assert [name for name in files(save_dir) if name.endswith(".tmp")] != []
    assert "step-000000010.pt" not in files(save_dir)

    # Leg 4: continues from step 9 again (the half-done save is cleaned up); SIGTERM to rank 1 only:
    # both ranks stop at the next step, rank 0 saves, exit 0.
    result = sigterm_rank_at(save_dir, 1, "step 10:", "--resume", "auto")
    assert_ok(result)
    out = output(result)
    assert resumed_from(out).startswith(f"{save_dir / 'step-000000009.pt'}: epoch 2, step 9,")
    assert "removed 1 unfinished save(s) of a killed run: step-000000010.pt." in out
    stop_line = next(line for line in out.splitlines() if line.startswith("stopped by"))
    assert stop_line.endswith("Continue with the same command plus --resume auto")
    stopped = checkpoint.load(str(save_dir / "last.pt"))
    assert 9 < stopped["global_step"] < FINAL_STEP and stopped["samples_in_epoch"] > 0, stop_line

    # Leg 5: continues mid-epoch from the SIGTERM checkpoint to the end.
    result = run(save_dir, "--resume", "auto")
    assert_ok(result)
    out = output(result)
    assert resumed_from(out).startswith(
        f"{save_dir / 'last.pt'}: epoch {stopped['epoch'] + 1}, step {stopped['global_step']},"
    )
    assert assert_same_training_state(save_dir / "last.pt", reference / "last.pt") == 0.0


@pytest.mark.slow
def test_elastic_restart_resumes_by_itself_to_identical_weights(reference, tmp_path):
    save_dir = tmp_path / "run"
    result = run(save_dir, fault="1:7", torchrun_args=("--max-restarts", "1"))
    assert_ok(result)
    out = output(result)
    assert (
        resumed_from(out) == f"{save_dir / 'step-000000007.pt'}: epoch 1, step 7, 448 samples into the epoch"
    )
    assert assert_same_training_state(save_dir / "last.pt", reference / "last.pt") == 0.0


def test_two_process_checkpoint_resumes_in_one_process_and_trains_on(reference, tmp_path):
    save_dir = tmp_path / "run"
    result = run(save_dir, "--resume", str(reference / "step-000000020.pt"), nproc=None)
    assert_ok(result)
    out = output(result)
    assert resumed_from(out).endswith("epoch 3, step 20, 256 samples into the epoch")
    assert "resuming 2 ranks' checkpoint with 1: " in out and "not bit-identical" in out
    final = checkpoint.load(str(save_dir / "last.pt"))
    assert (final["epoch"], final["global_step"], final["world_size"]) == (3, 20 + 256 // 32, 1)
    assert final["metrics"]["val_acc"] > 0.5


def resume_in_process(reference: Path, tmp_path: Path, **changes) -> MultiGPUTrainer:
    """A one-process trainer built as the CLI builds it, resuming the reference's last.pt with `changes`."""
    values = {
        **checkpoint.load(str(reference / "last.pt"))["config"],
        "save_dir": str(tmp_path),
        "resume": str(reference / "last.pt"),
        **changes,
    }
    config = TrainConfig(**values)
    data = build_datasets(config)
    trainer = MultiGPUTrainer(
        build_model("mlp", data.input_shape, data.num_classes), data.train, data.val, config
    )
    trainer.resume()
    return trainer


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"model": "cnn"}, "--model cnn contradicts checkpoint"),
        ({"train_size": 256}, "a training set of 256 contradicts checkpoint"),
        ({"optimizer": "sgd"}, "optimizer SGD contradicts checkpoint"),
    ],
)
def test_resume_refuses_another_model_or_data_set_in_one_line(reference, tmp_path, change, refusal):
    with pytest.raises(checkpoint.CheckpointError) as refused:
        resume_in_process(reference, tmp_path, **change)
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_resume_allows_and_logs_changed_epochs_lr_and_log_dir(reference, tmp_path, capsys):
    trainer = resume_in_process(reference, tmp_path, epochs=4, lr=0.002, log_dir=str(tmp_path / "tb"))
    assert trainer.progress.global_step == FINAL_STEP
    changed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming with"))
    assert "epochs: 3 -> 4" in changed and "lr: 0.001 -> 0.002" in changed and "log_dir: None ->" in changed


@pytest.mark.slow
def test_hung_rank_outside_torchrun_ends_its_peer_after_dist_timeout_naming_it(tmp_path):
    """Two ranks started by hand (no torchrun to clean up): rank 1 freezes, rank 0 must not wait forever."""
    env = cli_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"})
    # --hang-timeout 0: without the watchdog (tests/resilience/test_watchdog.py), the collective's timeout is what
    # tells.
    command = cli_command([*ARGS, "--save-dir", str(tmp_path), "--dist-timeout", "3", "--hang-timeout", "0"])
    ranks = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            text=True,
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    watchdog = threading.Timer(RUN_TIMEOUT, lambda: [rank.kill() for rank in ranks])
    watchdog.start()
    try:
        lines = []
        for line in ranks[0].stdout:
            lines.append(line)
            if line.startswith("step 3:"):
                ranks[1].send_signal(signal.SIGSTOP)  # alive but silent: only the timeout can tell
        assert ranks[0].wait() == 1, "".join(lines)
    finally:
        watchdog.cancel()
        ranks[1].kill()
        ranks[1].wait()
    assert "rank 0: lost contact with rank 1, which died or hung (Timed out waiting 3000ms" in "".join(lines)


def dropout_model() -> torch.nn.Module:
    """Dropout makes the weights depend on the restored RNG state, not only on the data order."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )


def test_resume_from_every_step_checkpoint_is_exact_with_accumulation_and_dropout(tmp_path):
    # 100 samples in windows of 2 x 8: six full optimizer steps and a short seventh per epoch.
    config = config_for(tmp_path, 1, grad_accum_steps=2, save_every_steps=3, keep_last=10, epochs=2)
    uninterrupted = MultiGPUTrainer(dropout_model(), blobs(100, 0), None, config)
    uninterrupted.fit()
    steps = sorted(p.name for p in Path(config.save_dir).glob("step-*.pt"))
    assert steps == [f"step-{s:09d}.pt" for s in (3, 6, 9, 12)]  # 6 and 12: one step before an epoch end
    for name in steps:
        resumed = MultiGPUTrainer(
            dropout_model(),
            blobs(100, 0),
            None,
            dataclasses.replace(
                config, save_dir=str(tmp_path / name), resume=str(Path(config.save_dir) / name)
            ),
        )
        resumed.fit()
        for key, tensor in uninterrupted.model.state_dict().items():
            assert torch.equal(resumed.model.state_dict()[key], tensor), (name, key)


def test_a_sigterm_delivered_twice_at_once_is_one_stop_request(capfd):
    # SLURM signals every process of a job step and torchrun forwards the signal too: each worker gets two.
    child = os.fork()
    if child == 0:
        stop = StopRequest(repeat_window=0.5)
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        if not stop.requested:
            os._exit(3)
        time.sleep(0.6)  # past the window: now a SIGTERM is a second request
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(4)  # not reached
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGTERM
    assert capfd.readouterr().err == "second SIGTERM: exiting now without a checkpoint\n"


def test_a_second_signal_exits_at_once_without_a_checkpoint(capfd):
    child = os.fork()
    if child == 0:  # a process in training: the first Ctrl-C only asks for a stop at the next step
        stop = StopRequest()
        stop.install()
        os.kill(os.getpid(), signal.SIGINT)
        if not stop.requested:
            os._exit(3)  # the first signal should have set the flag and nothing else
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(4)  # not reached: the second one exits
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGINT
    assert capfd.readouterr().err == "second SIGINT: exiting now without a checkpoint\n"


def test_only_the_processs_own_sigterm_and_sigint_count_as_stop_requests(capfd):
    """Every signal with a Python handler reaches the watcher's pipe (a loader's SIGCHLD when its workers end,
    which ended a run as a 'second SIGCHLD'), and a forked loader worker, which the terminal's Ctrl-C reaches
    too, inherits the pipe."""
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # as torch's DataLoader does
        stop = StopRequest()
        stop.install()
        worker = os.fork()
        if worker == 0:
            os.kill(os.getpid(), signal.SIGINT)  # the loader worker's own Ctrl-C
            os._exit(0)
        os.waitpid(worker, 0)  # and its SIGCHLD, with one more of those
        os.kill(os.getpid(), signal.SIGCHLD)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(0 if stop.signal_name == "SIGINT" else 3)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert capfd.readouterr().err == ""


def test_each_fit_watches_for_signals_with_a_thread_that_ends_with_it():
    """A trainer's second fit() installs the StopRequest again, before the first watcher may have seen its pipe
    end: each watcher keeps to its own pipe, and ends."""
    child = os.fork()
    if child == 0:
        stop = StopRequest()
        for _ in range(3):  # one fit after another
            stop.install()
            stop.uninstall()
        watchers = [thread for thread in threading.enumerate() if thread.name == "multigpu-stop-request"]
        for watcher in watchers:
            watcher.join(5)
        os._exit(0 if watchers and not any(watcher.is_alive() for watcher in watchers) else 3)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class OneLongCall(torch.nn.Module):
    """tiny_model whose forward, once `slow` is set, spends its step in one call of C++ code, where Python runs no
    signal handler: a wait (30 s) for a store key nobody sets, a large convolution's seconds without the CPU.
    `ready` is set as it starts."""

    def __init__(self, ready: Any) -> None:
        super().__init__()
        self.inner, self.ready, self.slow = tiny_model(), ready, False

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.slow:
            self.ready.set()
            with contextlib.suppress(RuntimeError):
                torch.distributed.HashStore().wait(["never set"], timedelta(seconds=30))
        return self.inner(inputs)


class SlowAfterStep1:
    def on_step_end(self, trainer: Any) -> None:
        trainer.model.slow = True


def _a_run_of_long_steps(tmp_path: Path, ready: Any) -> None:
    """Step 1 saved (--save-every-steps 1), step 2 in its long call when the signals come; the output in
    tmp_path/output."""
    output = os.open(tmp_path / "output", os.O_WRONLY | os.O_CREAT)
    os.dup2(output, 1)
    os.dup2(output, 2)
    config = config_for(tmp_path, 1, save_every_steps=1, epochs=1)
    trainer = MultiGPUTrainer(OneLongCall(ready), blobs(64, 0), None, config, callbacks=[SlowAfterStep1()])
    trainer.stop.repeat_window = 0.0  # the second SIGTERM comes at once, not seconds later
    trainer.fit()
    os._exit(4)  # not reached: the second SIGTERM exits


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be delivered to process `pid` (Linux /proc: two signals of one kind that are
    both pending at once are one)."""
    fields = dict(
        line.split(":\t") for line in Path(f"/proc/{pid}/status").read_text().splitlines() if "\t" in line
    )
    return any(int(fields[mask], 16) >> (signum - 1) & 1 for mask in ("SigPnd", "ShdPnd"))


def test_a_second_sigterm_ends_a_run_whose_step_is_one_long_call_at_once_keeping_the_last_checkpoint(
    tmp_path,
):
    """Two SIGTERMs did not stop a run whose steps took 25 s each: both came while the step was in C++ code,
    and Python made them one handler call there."""
    context = preloaded_context()
    ready = context.Event()
    run = context.Process(target=_a_run_of_long_steps, args=(tmp_path, ready))
    run.start()
    try:
        assert ready.wait(RUN_TIMEOUT)
        started = time.monotonic()
        os.kill(run.pid, signal.SIGTERM)
        while signal_pending(
            run.pid, signal.SIGTERM
        ):  # two at once would be one: the kernel keeps one of a kind
            time.sleep(0.001)
        os.kill(run.pid, signal.SIGTERM)
        run.join(RUN_TIMEOUT)
    finally:
        run.kill()
    assert run.exitcode == 128 + signal.SIGTERM
    assert time.monotonic() - started < 10  # not after the 30 s call
    assert (tmp_path / "output").read_text().endswith("second SIGTERM: exiting now without a checkpoint\n")
    saved = sorted(path.name for path in Path(tmp_path / "ckpt").iterdir() if path.suffix == ".pt")
    assert saved == ["step-000000001.pt"]
    assert checkpoint.load(str(tmp_path / "ckpt" / saved[0]))["global_step"] == 1


# ---------------------------------------------------------------- resume on another number of processes
def _lr_trace(
    rank: int,
    world_size: int,
    tmp_path: Path,
    stop_after: int | None,
    resume: bool,
    settings: dict | None = None,
) -> dict:
    """2 epochs of 160 samples, batch 8 per rank, warm-up then cosine (or other `settings`): (global-sample
    position, LR) of every optimizer step. `stop_after` steps it stops cleanly (the SIGTERM path, so last.pt is
    written)."""
    config = config_for(
        tmp_path,
        world_size,
        **{
            "optimizer": "sgd",
            "lr": 0.1,
            "warmup_epochs": 0.5,
            "epochs": 2,
            "log_every": 1,
            "resume": "auto" if resume else None,
            **(settings or {}),
        },
    )
    trainer = MultiGPUTrainer(tiny_model(), blobs(160, 0), None, config)
    trace: list[tuple[int, float]] = []

    def record(optimizer, args, kwargs) -> None:
        trace.append(
            (
                trainer.progress.epoch * 160 + trainer.progress.samples_in_epoch,
                optimizer.param_groups[0]["lr"],
            )
        )
        if len(trace) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # a rank of its own (run_ranks): only this rank stops

    trainer.optimizer.register_step_pre_hook(record)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit()
    plan = [line for line in printed.getvalue().splitlines() if " steps/epoch, " in line]
    return {
        "trace": trace,
        "final_lr": trainer.optimizer.param_groups[0]["lr"],
        "plan": plan,
        "global_step": trainer.progress.global_step,
        "printed": printed.getvalue(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_resume_on_another_world_size_continues_the_lr_schedule_at_the_same_sample(tmp_path, before, after):
    reference = run_ranks(_lr_trace, after, tmp_path / "reference", tmp_path / "reference", None, False)[0]
    stop_after = 48 // (8 * before)  # 48 samples in: a step boundary of both world sizes
    first = run_ranks(_lr_trace, before, tmp_path / "resumed", tmp_path / "resumed", stop_after, False)[0]
    resumed = run_ranks(_lr_trace, after, tmp_path / "resumed", tmp_path / "resumed", None, True)[0]
    assert first["global_step"] == stop_after
    positions = [position for position, _ in resumed["trace"]]
    assert positions[0] == 48 and positions[-1] == reference["trace"][-1][0]  # the rest of the samples, once
    expected = dict(reference["trace"])
    for position, lr in resumed["trace"]:
        assert lr == pytest.approx(expected[position], abs=1e-6), position
    assert abs(resumed["final_lr"]) < 1e-9 and abs(reference["final_lr"]) < 1e-9  # cosine ends at 0
    steps_left = len(reference["trace"]) - 48 // (8 * after)
    assert resumed["global_step"] == stop_after + steps_left
    assert f"{resumed['global_step']} steps ({steps_left} left)" in resumed["plan"][0]  # the plan is what ran


def test_a_resume_at_fewer_processes_with_max_steps_trains_every_step_asked_for_at_a_real_lr(tmp_path):
    """3 steps at 2 processes (48 samples, 6 steps of 1 process), resumed at 1 with --max-steps 6: 3 steps left,
    where the schedule, placed by samples seen, was already past a plan of 6 steps (LR 0 for each of them). The
    plan ends where the steps asked for do: the cosine from the 6th of 9 steps, to 0 after the last."""
    cosine = {"warmup_epochs": 0.0}
    first = run_ranks(_lr_trace, 2, tmp_path, tmp_path, 3, False, cosine)[0]
    resumed = run_ranks(_lr_trace, 1, tmp_path, tmp_path, None, True, {**cosine, "max_steps": 6})[0]
    assert first["global_step"] == 3 and resumed["global_step"] == 6
    assert [position for position, _ in resumed["trace"]] == [48, 56, 64]
    expected = [0.1 * 0.5 * (1 + math.cos(math.pi * step / 9)) for step in (6, 7, 8)]
    assert [lr for _, lr in resumed["trace"]] == pytest.approx(expected, abs=1e-9) and min(expected) > 0.002
    assert abs(resumed["final_lr"]) < 1e-9
    assert (
        "the LR schedule continues at the same point in samples and ends with the 3 steps --max-steps 6 "
        "leaves"
    ) in resumed["printed"]


# ---------------------------------------------------------------- the save from rank 0's replica
# A user's RMSprop and per-step ExponentialLR, given as functions; the model has dropout (random numbers each
# step) or BatchNorm (buffers each forward updates). 160 samples: 10 steps an epoch at 2 ranks x 8. With a
# forward to die in, rank 1 is SIGKILLed inside it (as by the OOM killer), after DDP's broadcast of the buffers.
REPLICA_RUN = """
import os, signal, sys, torch
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
from torch.utils._python_dispatch import _get_current_dispatch_mode
from conftest import blobs, config_for
from multigpu.launch.runner import main_guarded
from train_multi_gpu import MultiGPUTrainer

class DieInForward(torch.nn.Module):
    def __init__(self, step):
        super().__init__()
        self.step, self.forwards = step, 0
    def forward(self, x):
        if self.training and _get_current_dispatch_mode() is None:  # not the trainer's FLOP count
            self.forwards += 1
            if self.forwards == self.step and os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        return x

def train(argv):
    out, layer = Path(argv[0]), {{"dropout": torch.nn.Dropout(0.3), "batchnorm": torch.nn.BatchNorm1d(32)}}[argv[1]]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), layer, torch.nn.ReLU(), DieInForward(int(argv[2])),
                                torch.nn.Linear(32, 4))
    config = config_for(out, 2, epochs=2, save_every_steps=5, keep_last=5, log_every=1000, resume="auto")
    with MultiGPUTrainer(model, blobs(160, 0), None, config,
                         optimizer=lambda params: torch.optim.RMSprop(params, lr=0.01),
                         scheduler=lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(
                             optimizer, 0.99)) as trainer:
        trainer.fit()
sys.exit(main_guarded(train, sys.argv[1:]))
"""


def run_replica_case(
    out: Path, layer: str, fault: str = "", die_in_forward: int = 0
) -> list[subprocess.CompletedProcess]:
    """REPLICA_RUN as 2 ranks into out/ckpt (continuing what is there): rank:step of the fault injector, or the
    forward rank 1 dies in, if given."""
    out.mkdir(exist_ok=True)
    script = out / "run.py"
    script.write_text(REPLICA_RUN.format(repo=str(REPO), tests=str(REPO / "tests")))
    return run_cli_ranks(
        [str(out), layer, str(die_in_forward)], 2, env={FAULT_ENV: fault} if fault else None, script=script
    )


def kill_and_resume(out: Path, layer: str, said: str, resumed_at: str, **death: Any) -> dict[str, Any]:
    """Rank 1 dies as `death` says; rank 0 says `said` (after "rank 0: "); --resume auto resumes from `resumed_at`
    (a file of out/ckpt) and trains to the end: the final checkpoint."""
    killed = run_replica_case(out, layer, **death)
    assert [rank.returncode for rank in killed] == [1, -signal.SIGKILL], killed[0].stderr
    assert f"rank 0: {said}" in killed[0].stderr
    resumed = run_replica_case(out, layer)
    assert all(rank.returncode == 0 for rank in resumed), resumed[0].stderr
    assert resumed_from(resumed[0].stdout).startswith(f"{out / 'ckpt' / resumed_at}: ")
    return checkpoint.load(str(out / "ckpt" / "last.pt"))


def assert_same_weights(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["global_step"] == theirs["global_step"] == 20
    for name, tensor in theirs["model"].items():  # BatchNorm's running statistics included
        assert torch.equal(ours["model"][name], tensor), name


@pytest.mark.slow
def test_rank_0_writes_no_replica_save_after_random_numbers_were_drawn_and_the_resume_is_exact(tmp_path):
    """Rank 1 is SIGKILLed after step 13; rank 0 meets its loss in step 14's backward, its dropout masks drawn:
    the other rank's random state is unknown and its own is step 14's, so it writes nothing, and --resume auto
    from step 10 ends on the uninterrupted run's weights (before, its replica put 0.06 between them)."""
    assert all(rank.returncode == 0 for rank in run_replica_case(tmp_path / "whole", "dropout"))
    final = kill_and_resume(
        tmp_path / "cut",
        "dropout",
        "no checkpoint written: random numbers were drawn (dropout, "
        "random augmentation) since every rank's generators were last gathered, and rank 0 knows "
        f"only its own; the newest checkpoint is {tmp_path / 'cut' / 'ckpt' / 'last.pt'}",
        "last.pt",
        fault="1:13",
    )
    assert files(tmp_path / "cut" / "ckpt") == [
        "last.pt",
        "step-000000005.pt",
        "step-000000010.pt",
        "step-000000015.pt",
        "step-000000020.pt",
    ]
    assert_same_weights(final, checkpoint.load(str(tmp_path / "whole" / "ckpt" / "last.pt")))


@pytest.mark.slow
def test_rank_0_writes_a_replica_save_only_before_the_next_forward_updated_its_batchnorm_statistics(tmp_path):
    """Rank 1 dies after step 13: rank 0 meets it in DDP's broadcast of the buffers, at step 14's start, with
    step 13's statistics, and keeps step 13. Rank 1 dies inside step 14's forward: rank 0 meets it in backward,
    its statistics updated by step 14's batch, and writes nothing. Both resumes end on the uninterrupted run's
    weights and statistics."""
    assert all(rank.returncode == 0 for rank in run_replica_case(tmp_path / "whole", "batchnorm"))
    whole = checkpoint.load(str(tmp_path / "whole" / "ckpt" / "last.pt"))
    after_step = kill_and_resume(
        tmp_path / "after",
        "batchnorm",
        "checkpoint of the last completed step (13) written from rank 0's replica",
        "step-000000013.pt",
        fault="1:13",
    )
    assert_same_weights(after_step, whole)
    in_forward = kill_and_resume(
        tmp_path / "in",
        "batchnorm",
        "no checkpoint written: step 14's forward had already "
        "updated the model's buffers (BatchNorm statistics) on rank 0; the newest checkpoint "
        f"is {tmp_path / 'in' / 'ckpt' / 'last.pt'}",
        "last.pt",
        die_in_forward=14,
    )
    assert_same_weights(in_forward, whole)


@pytest.mark.slow
def test_a_replica_save_does_not_replace_the_checkpoint_of_its_own_step(tmp_path):
    """Killed right after step 15's checkpoint, which every rank's state went into: rank 0 keeps it as it is
    (before, its replica overwrote it, with its own random state for every rank, already moved by step 16)."""
    killed = run_replica_case(tmp_path, "dropout", fault="1:15")
    assert killed[0].returncode == 1, killed[0].stderr
    path = tmp_path / "ckpt" / "step-000000015.pt"
    assert f"rank 0: no checkpoint written: step 15 is saved already: {path}" in killed[0].stderr
    states = checkpoint.load(str(path))["rng"]
    assert not torch.equal(states[0]["torch"], states[1]["torch"])  # each rank's own
