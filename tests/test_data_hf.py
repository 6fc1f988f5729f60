"""--dataset hf (data/hf.py): local JSONL and Parquet files through Hugging Face datasets, map-style and
streaming; streamed over 1, 2 and 3 real gloo ranks x 0, 1 and 2 DataLoader workers, every sample is trained on
exactly once per epoch or reported unused at the ranks' uneven end, and no run hangs."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import SHARDS, IdModel, IdStream, assert_ok, config_for, read_ids, run_cli, run_ranks
from multigpu.errors import UsageError

datasets = pytest.importorskip("datasets", reason="the [hf] extra is not installed: bash scripts/ensure_env.sh hf")
EPOCH = sum(SHARDS)
CASES = [("jsonl", 0), ("jsonl", 1), ("jsonl", 2), ("parquet", 1)]  # (format, workers): parquet once, to save CI time


def write_files(folder: Path, kind: str) -> Path:
    """IdStream's samples (ids 0..237 in shards of 100, 101 and 37) as JSONL or Parquet files, one per shard."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, start = [], 0
    for index, size in enumerate(SHARDS):
        rows = [{"id": i, "x": IdStream.features(i)["x"].tolist(), "label": int(IdStream.features(i)["y"])}
                for i in range(start, start + size)]
        start += size
        if kind == "jsonl":
            (folder / f"part-{index}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            datasets.Dataset.from_list(rows).to_parquet(str(folder / f"part-{index}.parquet"))
    return folder


def _train(rank: int, world: int, tmp: Path) -> dict[str, dict]:
    """On each rank: for each of CASES, one epoch of a streaming run; the ids it trained on."""
    from data.hf import hf_datasets
    from train_multi_gpu import MultiGPUTrainer

    results = {}
    for kind, workers in CASES:
        run = tmp / f"{kind}-{workers}"
        config = config_for(run, world, dataset="hf", data_files=str(tmp / kind / f"*.{kind}"), streaming=True,
                            mode="flatten", num_workers=workers, epochs=1, batch_size=16, log_every=1000)
        train, _, shape, classes = hf_datasets(config, keep=("id",))
        torch.manual_seed(0)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), MultiGPUTrainer(IdModel(run / f"ids{rank}"), train, None,
                                                              config) as trainer:
            summary = trainer.fit()
        results[f"{kind}-{workers}"] = {"ids": read_ids([run / f"ids{rank}"]), "out": out.getvalue(),
                                        "steps": summary["global_step"], "shape": shape, "classes": classes}
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_files_give_every_sample_once_over_ranks_and_workers(tmp_path, world):
    for kind in ("jsonl", "parquet"):
        write_files(tmp_path / kind, kind)
    ranks = run_ranks(_train, world, tmp_path, tmp_path) if world > 1 else [_train(0, 1, tmp_path)]
    for case in ranks[0]:
        results = [rank[case] for rank in ranks]
        assert results[0]["shape"] == (16,) and results[0]["classes"] == 10  # a plain int column: --num-classes
        trained = [i for result in results for i in result["ids"]]
        assert len(trained) == len(set(trained)), f"{case}: a sample was trained on twice"
        assert len({result["steps"] for result in results}) == 1, f"{case}: the ranks ended at different steps"
        said = re.search(r"samples left unused: (.*)", results[0]["out"])
        unused = [int(n) for n in re.findall(r"rank \d+: (\d+)", said.group(1))] if said else []
        assert len(trained) + sum(unused) == EPOCH, case  # trained once, or reported left over: nothing lost
        if world == 1:
            assert sorted(trained) == list(range(EPOCH)) and not unused


def test_map_style_files_train_and_a_streamed_run_learns_under_torchrun(tmp_path):
    folder = write_files(tmp_path / "jsonl", "jsonl")
    args = ["--dataset", "hf", "--data-files", str(folder / "part-[01].jsonl"), "--val-files",
            str(folder / "part-2.jsonl"), "--mode", "flatten", "--model", "mlp", "--num-classes", "4",
            "--batch-size", "16", "--epochs", "2", "--lr", "0.01", "--no-progress"]
    for extra, nproc in (([], None), (["--streaming", "--num-workers", "2"], 2)):
        result = run_cli([*args, *extra, "--save-dir", str(tmp_path / f"run{nproc}")], nproc=nproc)
        assert_ok(result)
        assert "data hf: 201 train / 37 val samples" in result.stdout
        accuracy = float(re.search(r"done: best val acc ([\d.]+)", result.stdout).group(1))
        assert accuracy > 0.9, result.stdout  # 4 well separated classes


@pytest.mark.parametrize("flags, message", [
    (["--mode", "flatten", "--input-column", "nope"], "--input-column nope: the files' columns are id, x, label, name"),
    (["--mode", "flatten", "--label-column", "x"], "--label-column x holds list values"),
    (["--mode", "flatten", "--input-column", "name"], "--input-column name holds text; the built-in models read"),
    ([], "--input-column x holds 16 numbers per sample; --mode image reads them as --image-shape 1,28,28 (784)"),
])
def test_bad_columns_are_one_line_naming_what_to_change(tmp_path, flags, message):
    from data.hf import hf_datasets
    from multigpu.config import parse_config

    rows = [{"id": i, "x": [float(i)] * 16, "label": i % 2, "name": "a"} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match=re.escape(message)):
        hf_datasets(parse_config(["--dataset", "hf", "--data-files", str(tmp_path / "*.jsonl"), *flags]))


def test_without_the_library_it_says_what_to_install():
    from data.hf import import_datasets

    with pytest.raises(UsageError, match=re.escape("--dataset hf needs the Hugging Face datasets library, which is "
                                                   "not installed: pip install -e '.[hf]'")):
        import_datasets("datasets_that_is_not_installed")
