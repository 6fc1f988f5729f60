"""--dataset hf (data/hf.py): local JSONL and Parquet files through Hugging Face datasets, map-style and
streaming; streamed over 1, 2 and 3 real gloo ranks x 0, 1 and 2 DataLoader workers, every sample is trained on
exactly once per epoch (the ranks that run out join the others' steps), and no run hangs."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import (
    SHARDS,
    IdModel,
    assert_ok,
    config_for,
    fork_loader_workers,
    read_ids,
    run_cli,
    run_ranks,
    write_id_files,
)
from multigpu.errors import UsageError

datasets = pytest.importorskip(
    "datasets", reason="the [hf] extra is not installed: bash scripts/ensure_env.sh hf"
)
EPOCH = sum(SHARDS)
CASES = [
    ("jsonl", 0),
    ("jsonl", 1),
    ("jsonl", 2),
    ("parquet", 1),
]  # (format, workers): parquet once, to save CI time


def _train(rank: int, world: int, tmp: Path) -> dict[str, dict]:
    """On each rank: for each of CASES, one epoch of a streaming run; the ids it trained on."""
    from data.hf import hf_datasets
    from train_multi_gpu import MultiGPUTrainer

    if world > 1:  # a rank of run_ranks; one rank runs in pytest's process
        fork_loader_workers()
    results = {}
    for kind, workers in CASES:
        run = tmp / f"{kind}-{workers}"
        config = config_for(
            run,
            world,
            dataset="hf",
            data_files=str(tmp / kind / f"*.{kind}"),
            streaming=True,
            mode="flatten",
            num_workers=workers,
            epochs=1,
            batch_size=16,
            log_every=1000,
        )
        train, _, shape, classes = hf_datasets(config, keep=("id",))
        torch.manual_seed(0)
        out = io.StringIO()
        with (
            contextlib.redirect_stdout(out),
            MultiGPUTrainer(IdModel(run / f"ids{rank}"), train, None, config) as trainer,
        ):
            summary = trainer.fit()
        results[f"{kind}-{workers}"] = {
            "ids": read_ids([run / f"ids{rank}"]),
            "out": out.getvalue(),
            "steps": summary["global_step"],
            "shape": shape,
            "classes": classes,
        }
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_files_give_every_sample_once_over_ranks_and_workers(tmp_path, world):
    for kind in ("jsonl", "parquet"):
        write_id_files(tmp_path / kind, kind)
    ranks = run_ranks(_train, world, tmp_path, tmp_path) if world > 1 else [_train(0, 1, tmp_path)]
    for case in ranks[0]:
        results = [rank[case] for rank in ranks]
        assert (
            results[0]["shape"] == (16,) and results[0]["classes"] == 10
        )  # a plain int column: --num-classes
        trained = [i for result in results for i in result["ids"]]
        assert len(trained) == len(set(trained)), f"{case}: a sample was trained on twice"
        assert len({result["steps"] for result in results}) == 1, (
            f"{case}: the ranks ended at different steps"
        )
        # Under ddp the ranks that run out join the others' steps: every id trained, none left over.
        assert sorted(trained) == list(range(EPOCH)), case
        assert "samples left unused" not in results[0]["out"], case


@pytest.mark.slow
def test_map_style_files_train_and_a_streamed_run_learns_under_torchrun(tmp_path):
    from conftest import run_cli_forked

    folder = write_id_files(tmp_path / "jsonl", "jsonl")
    args = [
        "--dataset",
        "hf",
        "--data-files",
        str(folder / "part-[01].jsonl"),
        "--val-files",
        str(folder / "part-2.jsonl"),
        "--mode",
        "flatten",
        "--model",
        "mlp",
        "--num-classes",
        "4",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--lr",
        "0.01",
        "--no-progress",
    ]
    for extra, nproc in (([], None), (["--streaming", "--num-workers", "2"], 2)):
        argv = [*args, *extra, "--save-dir", str(tmp_path / f"run{nproc}")]
        result = run_cli(argv, nproc=nproc) if nproc else run_cli_forked(argv)  # forked: no Python start
        assert_ok(result)
        assert "data hf: 201 train / 37 val samples" in result.stdout
        accuracy = float(re.search(r"done: best val acc ([\d.]+)", result.stdout).group(1))
        assert accuracy > 0.9, result.stdout  # 4 well separated classes


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--mode", "flatten", "--input-column", "nope"],
            "--input-column nope: the files' columns are id, x, label, name",
        ),
        (["--mode", "flatten", "--label-column", "x"], "--label-column x holds list values"),
        (
            ["--mode", "flatten", "--input-column", "name"],
            "--input-column name holds text; the built-in models read",
        ),
        (
            [],
            "--input-column x holds 16 numbers per sample; --mode image reads them as --image-shape 1,28,28 (784)",
        ),
    ],
)
def test_bad_columns_are_one_line_naming_what_to_change(tmp_path, flags, message):
    from data.hf import hf_datasets
    from multigpu.config import parse_config

    rows = [{"id": i, "x": [float(i)] * 16, "label": i % 2, "name": "a"} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match=re.escape(message)):
        hf_datasets(parse_config(["--dataset", "hf", "--data-files", str(tmp_path / "*.jsonl"), *flags]))


def test_without_the_library_it_says_what_to_install():
    from data.hf import import_datasets

    with pytest.raises(
        UsageError,
        match=re.escape(
            "--dataset hf needs the Hugging Face datasets library, which is "
            "not installed: pip install -e '.[hf]'"
        ),
    ):
        import_datasets("datasets_that_is_not_installed")


# ---------------------------------------------------------------- bad rows and odd sets of files
def _break_json(folder: Path) -> str:
    rows = (folder / "part-1.jsonl").read_text().splitlines()
    rows[6] = rows[6][:30]  # row 7 cut off mid-list
    (folder / "part-1.jsonl").write_text("\n".join(rows) + "\n")
    return f"{folder / 'part-1.jsonl'} row 7 is not valid JSON (Expecting ',' delimiter at column 31)"


def _wrong_length(folder: Path) -> str:
    rows = (folder / "part-1.jsonl").read_text().splitlines()
    rows[8] = json.dumps({"id": 20, "x": [1.0, 2.0], "label": 0})
    (folder / "part-1.jsonl").write_text("\n".join(rows) + "\n")
    return f"{folder / 'part-1.jsonl'} row 9: its column x holds 2 numbers, and a sample needs 16"


def _empty(folder: Path) -> str:
    for path in folder.glob("*.jsonl"):
        path.write_text("\n" if path.name == "part-0.jsonl" else "")
    return f"{', '.join(str(path) for path in sorted(folder.glob('*.jsonl')))} hold no rows; give files with data"


@pytest.mark.parametrize(
    "damage, workers",
    [(_break_json, 1), (_wrong_length, 0), (_empty, 0)],
    ids=["broken JSON mid-shard, in a loader worker", "a row of the wrong length", "only empty shards"],
)
def test_bad_rows_are_one_line_naming_file_and_row_and_the_checkpoints_are_kept(
    tmp_path, capsys, damage, workers
):
    """A streamed run trains an epoch and saves; then a file is damaged and --resume auto trains on: the row met
    mid-epoch (in a DataLoader worker, whose error arrives wrapped) is one line naming the file and the row,
    exit 2, and the checkpoints are untouched."""
    import main_multi_gpu
    from conftest import assert_one_line, assert_untouched, contents

    folder = write_id_files(tmp_path / "files", "jsonl", (12, 11, 7))
    save_dir = tmp_path / "ckpt"
    run = [
        "--dataset",
        "hf",
        "--data-files",
        str(folder / "*.jsonl"),
        "--streaming",
        "--mode",
        "flatten",
        "--model",
        "mlp",
        "--num-classes",
        "4",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--no-progress",
        "--num-workers",
        str(workers),
        "--save-dir",
        str(save_dir),
    ]
    assert main_multi_gpu.main(run) == 0
    where = damage(folder)
    before = contents(save_dir)
    capsys.readouterr()
    code = main_multi_gpu.main([*run, "--resume", "auto", "--epochs", "2"])
    assert_one_line(code, capsys.readouterr().err, f"error: --data-files: {where}")
    assert_untouched(save_dir, before)


def test_streamed_files_of_unequal_length_are_split_by_example_where_ranks_cannot_join(tmp_path, monkeypatch):
    """--dataset hf --streaming, files of 53, 71, 9 and 40 rows at 2 ranks x 2 loader workers, as each rank's
    trainer reads them (the ranks one after the other, RANK and WORLD_SIZE as torchrun sets them): under fsdp,
    where the ranks that run out cannot join, every rank keeps one row in two of its workers' files, 87 and 86
    rows; under ddp each takes whole files, 62 and 111, and the ranks join at the uneven end. Every row once."""
    from data.hf import hf_datasets
    from multigpu.config import TrainConfig
    from multigpu.data import build_loader
    from multigpu.data.streaming import TrainStream
    from multigpu.parallel.distributed import Runtime

    folder = write_id_files(tmp_path / "files", "jsonl", (53, 71, 9, 40))
    config = TrainConfig(dataset="hf", data_files=str(folder / "*.jsonl"), streaming=True, mode="flatten")
    train, _, _, _ = hf_datasets(config, keep=("id",))
    for mode, cannot_join, shares in (("fsdp", "fsdp", [87, 86]), ("ddp", None, [62, 111])):
        ids = []
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "2")
            runtime = Runtime(mode, torch.device("cpu"), rank, rank, 2)
            stream = TrainStream(train, runtime, 16, 1, 0, 2, 0, None, build_loader, cannot_join=cannot_join)
            ids.append([i for _, _, batch in stream.loader for i in batch["id"].tolist()])
        assert [len(rank_ids) for rank_ids in ids] == shares, mode
        assert sorted(ids[0] + ids[1]) == list(range(173)), mode


def test_validation_files_are_read_in_their_own_format(tmp_path):
    """--data-files Parquet with --val-files JSON Lines, streamed: each flag's files in their own format."""
    from data.hf import hf_datasets
    from multigpu.config import TrainConfig

    train_files = write_id_files(tmp_path / "p", "parquet", (12, 11))
    val_files = write_id_files(tmp_path / "j", "jsonl", (7,))
    config = TrainConfig(
        dataset="hf",
        data_files=str(train_files / "*.parquet"),
        val_files=str(val_files / "*.jsonl"),
        streaming=True,
        mode="flatten",
    )
    train, val, shape, _ = hf_datasets(config, keep=("id",))
    assert (len(train), len(val), shape) == (23, 7, (16,))
    assert [sample["id"] for sample in val] == list(range(7))


@pytest.mark.slow
def test_fewer_samples_than_ranks_is_refused_in_one_line(tmp_path):
    """One file of one row, streamed at 2 ranks: rank 1 gets no sample, and would only ever join rank 0's steps;
    the run says so in one line (rank 0's), exit 2, on both ranks, and writes no checkpoint."""
    import main_multi_gpu
    from conftest import run_forked_workers

    write_id_files(tmp_path / "files", "jsonl", (1,))
    results = run_forked_workers(
        main_multi_gpu.main,
        [
            "--dataset",
            "hf",
            "--data-files",
            str(tmp_path / "files" / "*.jsonl"),
            "--streaming",
            "--mode",
            "flatten",
            "--model",
            "mlp",
            "--num-classes",
            "4",
            "--batch-size",
            "4",
            "--no-progress",
            "--dist-timeout",
            "60",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ],
        2,
        tmp_path,
    )
    assert [result.returncode for result in results] == [2, 2], [result.stderr[-2000:] for result in results]
    assert results[0].stderr.splitlines() == [
        "error: the training stream is too small for 2 ranks: a whole pass gave rank 0: 1, rank 1: 0 sample(s), and "
        "every rank needs at least one batch; use fewer ranks, or more data"
    ]
    assert results[1].stderr == ""
    assert not list((tmp_path / "ckpt").glob("*.pt"))


@pytest.mark.slow
def test_a_streamed_run_with_loader_workers_killed_mid_epoch_resumes_to_the_uninterrupted_weights(tmp_path):
    """--dataset hf --streaming, 2 ranks x 2 loader workers under torchrun: rank 1 SIGKILLed after step 5, torchrun
    restarts both with --resume auto from step 3's checkpoint (3 batches in: worker 1's turn next, on files worker
    0 does not read): the final weights equal the uninterrupted run's exactly."""
    folder = write_id_files(tmp_path / "files", "jsonl")
    args = [
        "--dataset",
        "hf",
        "--data-files",
        str(folder / "*.jsonl"),
        "--streaming",
        "--mode",
        "flatten",
        "--model",
        "mlp",
        "--num-classes",
        "4",
        "--batch-size",
        "16",
        "--epochs",
        "1",
        "--lr",
        "0.01",
        "--num-workers",
        "2",
        "--no-progress",
        "--save-every-steps",
        "3",
        "--resume",
        "auto",
        "--dist-timeout",
        "60",
    ]
    killed = run_cli(
        [*args, "--save-dir", str(tmp_path / "killed")],
        nproc=2,
        torchrun_args=["--max-restarts", "1"],
        env={"MULTIGPU_FAULT_INJECT": "1:5"},
    )
    assert_ok(killed)
    assert f"resumed from {tmp_path / 'killed' / 'step-000000003.pt'}" in killed.stdout
    assert_ok(run_cli([*args, "--save-dir", str(tmp_path / "whole")], nproc=2))
    resumed, whole = (
        torch.load(tmp_path / name / "last.pt", weights_only=True)["model"] for name in ("killed", "whole")
    )
    assert max((resumed[key] - whole[key]).abs().max().item() for key in whole) == 0


@pytest.mark.slow
def test_a_bad_row_that_one_rank_meets_is_that_ranks_one_line(tmp_path):
    """Two files at 2 ranks: split_dataset_by_node gives each rank one; rank 1's has broken JSON at row 7, met in
    its loader worker mid-epoch. Rank 1 says so in one line naming the file and row, exit 2; rank 0, left
    waiting for it in the step's collective, says it lost rank 1, exit 1."""
    import main_multi_gpu
    from conftest import run_forked_workers

    folder = write_id_files(tmp_path / "files", "jsonl", (12, 11))
    where = _break_json(folder)
    results = run_forked_workers(
        main_multi_gpu.main,
        [
            "--dataset",
            "hf",
            "--data-files",
            str(folder / "*.jsonl"),
            "--streaming",
            "--mode",
            "flatten",
            "--model",
            "mlp",
            "--num-classes",
            "4",
            "--batch-size",
            "4",
            "--no-progress",
            "--num-workers",
            "1",
            "--dist-timeout",
            "60",
            "--save-dir",
            str(tmp_path / "ckpt"),
        ],
        2,
        tmp_path,
    )
    assert results[1].returncode == 2 and results[1].stderr.splitlines() == [
        f"error: rank 1: --data-files: {where}; fix or remove it (--resume auto then continues from the last "
        f"checkpoint)"
    ], results[1].stderr
    assert results[0].returncode == 1 and "lost contact with rank 1" in results[0].stderr, results[0].stderr
