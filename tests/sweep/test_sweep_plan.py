"""The experiment list: grid values checked by TrainConfig, names and save dirs, shards, the fingerprint."""

from __future__ import annotations

import pytest

from conftest import run_sweep
from multigpu.config import parse_config
from multigpu.errors import UsageError
from multigpu.sweep.options import parse
from multigpu.sweep.plan import build_plan, fingerprint_difference


def plan_of(sweep_argv, train_argv=(), sweep_dir="/tmp/sweep"):
    options, _ = parse(["--sweep-dir", sweep_dir, *sweep_argv], environ={})
    return build_plan(options, list(train_argv))


def test_grid_points_times_seeds_in_a_fixed_order():
    plan = plan_of(["--num-seeds", "2", "--grid", "lr=1e-3,0.003", "batch-size=16,32"], ["--epochs", "2"])
    names = [e.name for e in plan.experiments]
    assert names[:3] == [
        "lr=0.001,batch_size=16/seed-0",
        "lr=0.001,batch_size=16/seed-1",
        "lr=0.001,batch_size=32/seed-0",
    ]
    assert len(names) == 8 == len(set(names))
    assert [point for point, _ in plan.points][-1] == "lr=0.003,batch_size=32"
    last = plan.experiments[-1]
    config = parse_config(list(last.argv))  # exactly the flags main_multi_gpu.py gets
    assert (config.lr, config.batch_size, config.seed, config.epochs) == (0.003, 32, 1, 2)
    assert (config.save_dir, config.resume, config.progress) == (
        "/tmp/sweep/lr=0.003,batch_size=32/seed-1",
        "auto",
        False,
    )


def test_without_a_grid_each_seed_is_a_directory():
    plan = plan_of(["--seeds", "5,9"], sweep_dir="/tmp/s")
    assert [e.save_dir for e in plan.experiments] == ["/tmp/s/seed-5", "/tmp/s/seed-9"]


def test_bools_and_values_with_commas():
    plan = plan_of(["--grid", "download=true,false", "image_shape=1,8,8;3,8,8"])
    assert [values for _, values in plan.points][1] == {"download": True, "image_shape": "3,8,8"}
    assert [point for point, _ in plan.points][0] == "download=True,image_shape=1,8,8"


BAD_GRIDS = {
    "unknown key": (["--grid", "lrr=0.1"], "lrr is not a training setting (did you mean lr?)"),
    "value TrainConfig refuses": (
        ["--grid", "batch_size=8,0"],
        "--grid batch_size=8,0: --batch-size must be at least 1",
    ),
    "not a number": (["--grid", "lr=fast"], "argument --lr: invalid float value"),
    "not a choice": (["--grid", "amp=fp8"], "--amp"),
    "same value twice": (["--grid", "lr=1e-3,0.001"], "the value 0.001 is given twice"),
    "key twice": (["--grid", "lr=0.1", "lr=0.2"], "--grid names lr twice"),
    "per-run key": (["--grid", "seed=1,2"], "--seed is set for each run by --num-seeds/--seeds"),
    "no values": (["--grid", "lr="], "empty value"),
    "image shape split by commas": (["--grid", "image_shape=1,8,8"], "separate them with ';'"),
}


@pytest.mark.parametrize("case", BAD_GRIDS)
def test_bad_grids_are_refused_before_anything_runs(case):
    argv, expected = BAD_GRIDS[case]
    with pytest.raises(UsageError) as error:
        plan_of(argv)
    assert expected in str(error.value)


@pytest.mark.parametrize("flag", ["--seed", "--save-dir", "--resume", "--log-dir"])
def test_training_flags_the_sweep_sets_itself_are_refused(flag):
    with pytest.raises(UsageError, match=f"{flag} is set for each run"):
        plan_of([], [flag, "1"])


def test_bad_input_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    result = run_sweep(
        ["--sweep-dir", str(tmp_path / "sweep"), "--grid", "batch_size=0", "--", "--epochs", "1"]
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: --grid batch_size=0: --batch-size must be at least 1, got 0"]
    assert not (tmp_path / "sweep").exists()


def test_shards_split_the_list_without_overlap():
    plan = plan_of(["--num-seeds", "5", "--grid", "lr=0.1,0.2"])
    shards = [plan.shard(index, 3) for index in range(3)]
    names = [e.name for shard in shards for e in shard]
    assert sorted(names) == sorted(e.name for e in plan.experiments) and len(names) == 10
    assert [len(shard) for shard in shards] == [4, 3, 3]
    assert {e.point for e in shards[0]} == {"lr=0.1", "lr=0.2"}


def test_fingerprint_names_the_first_difference():
    base = plan_of(["--grid", "lr=0.1,0.2"], ["--epochs", "2"]).fingerprint
    assert (
        fingerprint_difference(
            base, plan_of(["--num-seeds", "9", "--grid", "lr=0.1,0.2"], ["--epochs", "2"]).fingerprint
        )
        is None
    )  # more seeds: same sweep
    changed = plan_of(["--grid", "lr=0.1,0.2"], ["--epochs", "3"]).fingerprint
    assert fingerprint_difference(base, changed) == "--epochs 2 (the sweep's) vs 3 (this command's)"
    regridded = plan_of(["--grid", "lr=0.1"], ["--epochs", "2"]).fingerprint
    assert (
        fingerprint_difference(base, regridded)
        == "--grid lr=0.1,0.2 (the sweep's) vs lr=0.1 (this command's)"
    )
    wider = plan_of(["--grid", "lr=0.1,0.2", "--gpus-per-run", "2"], ["--epochs", "2"]).fingerprint
    assert fingerprint_difference(base, wider) == "--gpus-per-run 1 (the sweep's) vs 2 (this command's)"


def test_without_sweep_dir_each_setting_gets_its_own_numbered_folder_and_a_rerun_finds_its_own(
    tmp_path, monkeypatch
):
    from multigpu.sweep import records

    monkeypatch.chdir(tmp_path)

    def claimed(sweep_argv, train_argv):
        options, _ = parse(sweep_argv, environ={})
        plan = build_plan(options, train_argv)
        records.check_fingerprint(
            plan.sweep_dir, plan.fingerprint
        )  # what the sweep does before its first run
        return plan.sweep_dir

    first = claimed(["--num-seeds", "2", "--grid", "lr=1e-3,3e-3"], ["--epochs", "1"])
    assert first == str(tmp_path / "checkpoints" / "sweep-1")
    other = claimed(["--num-seeds", "3", "--grid", "lr=1e-3,3e-3"], ["--epochs", "2"])  # other settings
    assert other == str(tmp_path / "checkpoints" / "sweep-2")
    # More seeds of the same settings continue the first sweep (its finished runs are skipped).
    assert claimed(["--num-seeds", "3", "--grid", "lr=1e-3,3e-3"], ["--epochs", "1"]) == first
    assert claimed(["--grid", "lr=1e-3,3e-3"], ["--epochs", "2"]) == other
    # An explicit --sweep-dir keeps its rule: other settings there are refused.
    with pytest.raises(UsageError, match="holds a sweep with other settings"):
        claimed(["--sweep-dir", first, "--grid", "lr=1e-3,3e-3"], ["--epochs", "3"])
