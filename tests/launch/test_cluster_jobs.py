"""One rule set for every engine (multigpu/launch/cluster_jobs.py): a run here, a SLURM job, a Kubernetes TrainJob
and a run on Ray are planned from the same flags by the same checks, and show the same effective batch and LR,
the trainer's own. Asked in this process (the rule set imports no torch: milliseconds a call)."""

from __future__ import annotations

import shlex

import pytest

from multigpu.errors import UsageError
from multigpu.launch import launch_rules
from multigpu.lr_scaling import scaled_lr

ENGINES = ("slurm", "k8s", "ray")


def plan_of(step: str, *args: str) -> dict[str, list[str]]:
    """The rule set's records for STEP, by key (a key may repeat: the plan's lines)."""
    _, settings = launch_rules.parse([step, "--found-gpus", "0,1,2,3", *args])
    records: dict[str, list[str]] = {}
    for key, value in launch_rules.STEPS[step](settings):
        records.setdefault(key, []).append(value)
    return records


def test_every_engine_shows_the_effective_batch_and_lr_of_a_run_here() -> None:
    flags = ["--gpus", "4", "--epochs", "2", "--batch-size", "16", "--lr", "0.01", "--lr-scaling", "sqrt"]
    flags += ["--save-dir", "/shared/run1"]
    lr = scaled_lr(0.01, "sqrt", 64, 32)
    expected = [
        "  epochs 2; effective batch 64 = 16 per GPU x 4 GPUs x 1 accumulation step",
        f"  lr {lr!r} = 0.01 x sqrt(64/32)",
    ]
    for step in ("plan", *ENGINES):
        lines = plan_of(step, *flags)["plan"]
        assert [line for line in lines if line.startswith(("  epochs", "  lr"))] == expected, (step, lines)


@pytest.mark.parametrize("step", ENGINES)
def test_every_engine_refuses_what_the_trainer_refuses_in_its_words(step: str) -> None:
    with pytest.raises(UsageError, match="--epochs must be at least 1, got 0"):
        plan_of(step, "--gpus", "0", "--epochs", "0")
    with pytest.raises(UsageError, match=r"--gpu-ids is \w+'s to decide"):
        plan_of(step, "--gpu-ids", "0,1")
    with pytest.raises(UsageError, match="runs --multi-gpu ddp or fsdp"):
        plan_of(step, "--gpus", "0", "--multi-gpu", "dp")


@pytest.mark.parametrize(
    "step, trainer_args, refused",
    [
        ("slurm", ["--resume", "auto"], True),
        ("k8s", ["--overwrite"], True),
        (
            "ray",
            ["--resume", "auto"],
            False,
        ),  # Ray's restarts are the trainer's: the user's flags stay the user's
    ],
)
def test_jobs_that_resume_by_themselves_refuse_resume_flags_and_ray_takes_them(
    step: str, trainer_args: list[str], refused: bool
) -> None:
    args = ["--gpus", "0", "--save-dir", "/shared/run1", "--", *trainer_args]
    if refused:
        with pytest.raises(UsageError, match=f"{trainer_args[0]} after -- with --{step}"):
            plan_of(step, *args)
    else:
        assert plan_of(step, *args)["command"][0].endswith(" ".join(trainer_args))


@pytest.mark.parametrize("step", ["k8s", "ray"])
def test_fault_tolerance_is_refused_by_the_engines_that_restart_workers_themselves(
    step: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each step of the rule set, as the launcher asks it, flag or not: the replica groups run here or under SLURM.
    for args in ([step], ["check", f"--{step}", "1"]):
        assert launch_rules.main([*args, "--fault-tolerance", "1", "--save-dir", "/shared/run1"]) == 2
        answer = capsys.readouterr().out
        assert (
            answer.startswith(
                f"error=--fault-tolerance runs its replica groups here or with --slurm, not with --{step}"
            )
            and answer.count("\0") == 1
        ), answer


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2"], "--nnodes: Ray places the workers on its nodes"),
        (["--max-restarts", "1"], "restarts: --ray-max-failures"),
        (["--ray-max-failures", "-1"], "--ray-max-failures must be at least 0, got -1"),
        (["--ray-address", "head"], "--ray-address head: expected HOST:PORT of the Ray head"),
    ],
)
def test_bad_ray_launcher_flags_are_one_line(args: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message) as refused:
        plan_of("ray", "--gpus", "0", *args)
    assert "\n" not in str(refused.value)


def test_the_ray_command_quotes_a_save_dir_as_the_command_of_a_run_here() -> None:
    awkward = "run 'one' \"two\" $(id)"
    for step, devices in (("plan", ["--gpus", "2"]), ("ray", ["--gpus", "0", "--nproc", "2"])):
        command = shlex.split(plan_of(step, *devices, "--save-dir", awkward)["command"][0])
        assert command[command.index("--save-dir") + 1] == awkward, step


def test_the_ray_command_names_its_workers_and_the_training_flags() -> None:
    records = plan_of(
        "ray", "--gpus", "0", "--nproc", "3", "--ray-address", "10.0.0.1:6379", "--save-dir", "r1"
    )
    assert records["command"][0].split("main_multi_gpu.py ", 1)[1] == (
        "--ray-workers 3 --ray-address 10.0.0.1:6379 --ray-gpus-per-worker 0 --multi-gpu ddp --epochs 3 "
        "--batch-size 64 --lr 0.001 --lr-scaling none --save-dir r1"
    )
    assert (
        records["plan"][0]
        == "Plan: Ray, 3 workers (1 CPU each, gloo), DDP, on the Ray cluster at 10.0.0.1:6379"
    )
