"""The sweep's flags: both spellings, telling them from training flags, SLURM's array task as the shard."""

from __future__ import annotations

import pytest

from multigpu.errors import UsageError
from multigpu.sweep.options import parse, requested, split_separated, to_argv
from multigpu.sweep.plan import build_plan


def test_sweep_flags_are_told_from_training_flags():
    assert requested(["--num_seeds", "4", "--epochs", "2"]) and requested(["--max-gpus=2"])
    assert requested(["--lr", "0.1", "--grid", "lr=1,2"])
    assert not requested(["--seed", "3", "--num-workers", "2", "--save-dir", "x"])  # training flags only


def test_the_design_notes_form_mixes_both_kinds():
    options, rest = parse(
        [
            "--num_seeds",
            "3",
            "--epochs",
            "2",
            "--max_gpus",
            "2",
            "--checkpoint_interval",
            "1800",
            "--lr",
            "0.1",
        ],
        mixed=True,
        environ={},
    )
    assert (options.seeds, options.max_gpus, options.checkpoint_interval) == ([0, 1, 2], 2, 1800.0)
    assert rest == ["--epochs", "2", "--lr", "0.1"]


def test_training_flags_before_the_separator_are_refused():
    with pytest.raises(
        UsageError, match=r"unrecognized sweep flags: --epochs 2 \(training flags go after --"
    ):
        parse(["--num-seeds", "2", "--epochs", "2"], environ={})
    assert split_separated(["--seeds", "1,2", "--", "--epochs", "2"]) == (
        ["--seeds", "1,2"],
        ["--epochs", "2"],
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-seeds", "2", "--no-progress", "--", "--epochs", "1"],
        ["--num-seeds", "2", "--", "--epochs", "1", "--no-progress"],
        ["--progress=false", "--num-seeds", "2"],
    ],
    ids=["before --", "after --", "no --"],
)
def test_no_progress_turns_the_sweeps_bar_off_on_either_side_of_the_separator(argv, tmp_path):
    """docs/sweeps.md presents --no-progress with the sweep's bar, and before `--` it was refused as a training
    flag; the sweep's bar follows the training flag (the runs show none of their own)."""
    sweep_argv, train_argv = split_separated(
        [*argv, "--sweep-dir", str(tmp_path)] if "--" not in argv else ["--sweep-dir", str(tmp_path), *argv]
    )
    options, rest = parse(sweep_argv, environ={})
    assert build_plan(options, rest + train_argv).base.progress is False


def test_the_shard_comes_from_the_slurm_array_task():
    assert parse([], environ={})[0].shard == (0, 1)
    slurm = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert parse([], environ=slurm)[0].shard == (3, 4)
    assert parse([], environ={**slurm, "SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "6"})[0].shard == (
        1,
        4,
    )
    assert parse(["--shard", "0/2"], environ=slurm)[0].shard == (0, 2)  # the flag wins


BAD = {
    "shard out of range": (["--shard", "2/2"], "--shard must be I/N with 0 <= I < N"),
    "array id without count": ([], "SLURM_ARRAY_TASK_COUNT is not"),
    "both seed flags": (["--num-seeds", "2", "--seeds", "1"], "not both"),
    "repeated seed": (["--seeds", "1,1"], "--seeds must be distinct"),
    "no workers": (["--workers", "0"], "--workers must be at least 1"),
    "submit alone": (["--submit"], "add --slurm"),
    "slurm and shard": (["--slurm", "--shard", "0/2"], "give one of them"),
    # a newline in what lands in the job script's comment and #SBATCH lines would start a shell line there
    "newline in the sweep dir": (
        ["--slurm", "--sweep-dir", "s\ntouch X"],
        "holds a newline or another control",
    ),
    "newline in an sbatch arg": (
        ["--slurm", "--sbatch-arg=--comment=a\ntouch X"],
        "holds a newline or another",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_sweep_flags_say_what_is_wrong(case):
    argv, expected = BAD[case]
    with pytest.raises(UsageError, match=expected.replace("(", r"\(")):
        parse(argv, environ={"SLURM_ARRAY_TASK_ID": "1"} if case == "array id without count" else {})


def test_to_argv_reproduces_the_options():
    options, _ = parse(
        [
            "--seeds",
            "3,7",
            "--grid",
            "lr=1,2",
            "amp=off,bf16",
            "--retries",
            "2",
            "--workers",
            "3",
            "--gpus-per-run",
            "2",
            "--checkpoint-interval",
            "30",
            "--retry-failed",
            "--max-gpus",
            "4",
        ],
        environ={},
    )
    again, rest = parse(to_argv(options, for_task=False), environ={})
    assert again == options and rest == []
    assert "--max-gpus" not in to_argv(options, for_task=True)  # an array task uses the GPUs SLURM gave it


def test_a_sweep_dir_that_is_a_file_is_one_line_and_exit_2_and_the_file_is_left_alone(
    tmp_path, capsys, monkeypatch
):
    from multigpu.sweep.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    for sweep_dir, expected in [
        ("notes.txt", "--sweep-dir notes.txt is a file, not a folder"),
        ("notes.txt/sweep", f"--sweep-dir notes.txt/sweep: {tmp_path / 'notes.txt'} is a file"),
    ]:
        assert main(["--sweep-dir", sweep_dir, "--", "--epochs", "1"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), lines
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"] and (
        tmp_path / "notes.txt"
    ).read_text() == "mine"
