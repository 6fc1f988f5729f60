"""Streaming training data (data/streaming.py): every sample once over ranks x workers, uneven ends that
never hang, and resume at the exact sample, at another layout too. Real DataLoader workers and real gloo ranks."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import io
import itertools
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import (
    PYTHON,
    REPO,
    SHARDS,
    CrashAt,
    IdModel,
    IdStream,
    SplitIds,
    cli_env,
    config_for,
    fork_loader_workers,
    free_port,
    read_ids,
    run_ranks,
    write_id_files,
)
from multigpu.data.streaming import StreamShard, TaggedCollate

EPOCH = sum(SHARDS)


def shard_ids(
    rank: int, world: int, workers: int, skip=None, batches=None
) -> tuple[list[int], dict[int, int]]:
    """The ids one rank's loader gives (all, or its first `batches` batches), and the samples per slot."""
    shard = StreamShard(IdStream(), rank, world)
    shard.skip = skip
    loader = DataLoader(shard, batch_size=5, num_workers=workers, collate_fn=TaggedCollate(None))
    ids: list[int] = []
    counts: dict[int, int] = {}
    for slot, samples, batch in itertools.islice(loader, batches):
        ids += batch["id"].tolist()
        counts[slot] = counts.get(slot, 0) + samples
    return ids, counts


@pytest.mark.parametrize("world, workers", [(1, 0), (1, 2), (2, 1), (3, 2)])
def test_the_trainers_split_gives_every_sample_once_over_ranks_and_workers(world, workers):
    ids = [i for rank in range(world) for i in shard_ids(rank, world, workers)[0]]
    assert sorted(ids) == list(range(EPOCH))


def test_a_resume_at_another_layout_continues_every_slot_exactly():
    """2 ranks x 2 workers read 3 batches each, then 3 ranks x 1 worker, then 1 rank x 2 workers resume the
    pass: together they read every id once."""
    layers, seen = [], []
    for world, workers, batches in [(2, 2, 3), (3, 1, 4), (1, 2, None)]:
        counts = [0] * (world * max(1, workers))
        for rank in range(world):
            ids, mine = shard_ids(
                rank, world, workers, skip=[dict(layer) for layer in layers] or None, batches=batches
            )
            seen += ids
            for slot, n in mine.items():
                counts[slot] = n
        layers.append({"slots": len(counts), "counts": counts})
    assert sorted(seen) == list(range(EPOCH))


# ---------------------------------------------------------------- what a stream splits by itself
MATRIX_SHARDS = (12, 11, 7)  # 30 ids; as files, the 3 shards of a Hugging Face stream
MATRIX_IDS = list(range(sum(MATRIX_SHARDS)))
KINDS = (
    "naive",
    "splits workers",
    "splits ranks",
    "splits both",
    "rank in __init__",
    "hf",
    "hf split by node",
)


def matrix_stream(kind: str, folder: Path) -> torch.utils.data.IterableDataset:
    """A stream of MATRIX_IDS of `kind`: SplitIds (the trainer has to find out what it splits), or a Hugging
    Face stream of the files in `folder`, raw or split by split_dataset_by_node as its documentation shows."""
    if not kind.startswith("hf"):
        return SplitIds(
            len(MATRIX_IDS),
            workers=kind in ("splits workers", "splits both"),
            ranks={"splits ranks": "env", "splits both": "dist", "rank in __init__": "init"}.get(kind),
        )
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset(
        "json", data_files=sorted(map(str, folder.glob("*.jsonl"))), split="train", streaming=True
    )
    if kind == "hf split by node":
        stream = split_dataset_by_node(
            stream, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
    return stream


def read_every_kind(rank: int, world: int, folder: Path) -> dict:
    """On each rank: for each kind x 0, 1 and 2 loader workers, the ids the trainer's own loader gives this rank
    in its first two passes; then the lines the first pass of streams that misstate their split makes the trainer
    say."""
    from multigpu.data import build_loader
    from multigpu.data.streaming import TrainStream
    from multigpu.parallel.distributed import Runtime

    fork_loader_workers()  # 50 loaders: each importing torch and datasets afresh otherwise
    runtime = Runtime("ddp" if world > 1 else "none", torch.device("cpu"), rank, rank, world)
    ids = {}
    for kind in KINDS:
        dataset = matrix_stream(kind, folder)
        if kind.startswith("hf"):
            dataset = dataset.select_columns(["id"])  # type: ignore[attr-defined]  # an HF stream: the ids checked
        for workers in (0, 1, 2):
            stream = TrainStream(dataset, runtime, 4, 1, 0, workers, 0, None, build_loader)
            for pass_number in (0, 1):
                stream.shard.pass_number = pass_number
                ids[kind, workers, pass_number] = [
                    i for _, _, batch in stream.loader for i in batch["id"].tolist()
                ]
    undetected = {
        "shards_itself but reads all": (SplitIds(len(MATRIX_IDS)), 2),
        "no __len__, shards_itself but reads all": (SplitIds(len(MATRIX_IDS), length=False), 2),
    }
    # Set on these two only: a class attribute False would be an answer too (absent is none).
    undetected["shards_itself but reads all"][0].shards_itself = True  # type: ignore[attr-defined]  # see above
    undetected["no __len__, shards_itself but reads all"][0].shards_itself = True  # type: ignore[attr-defined]  # see above
    said = {}
    for name, (dataset, workers) in undetected.items():
        lines: list[str] = []
        stream = TrainStream(dataset, runtime, 4, 1, 0, workers, 0, None, build_loader)
        for _ in stream.windows(lines.append):
            pass
        said[name] = lines
    return {"ids": ids, "said": said}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_kind_of_stream_gives_every_id_once_per_pass_over_ranks_and_workers(tmp_path, world):
    """A naive stream, one that splits over workers (PyTorch's documented pattern), one that splits over ranks
    (RANK and WORLD_SIZE), one that splits over both (torch.distributed's rank), one that reads its rank in
    __init__ (which no probe of __iter__ sees: found by what the ranks read), and a Hugging Face stream raw and
    after split_dataset_by_node, each with 0, 1 and 2 loader workers, in one process group per world size: the
    trainer's loaders give every id exactly once in each of two passes."""
    pytest.importorskip("datasets", reason="the [hf] extra is not installed: pip install '.[hf]'")
    folder = write_id_files(tmp_path / "files", "jsonl", MATRIX_SHARDS)
    ranks = run_ranks(read_every_kind, world, tmp_path, folder)
    for case in ranks[0]["ids"]:
        assert sorted(i for rank in ranks for i in rank["ids"][case]) == MATRIX_IDS, case
    said = ranks[0]["said"]
    if world == 1:  # 2 workers that both read everything: twice the length, or the same first batch
        assert said["shards_itself but reads all"] == [
            "warning: the first pass of the training stream gave 60 samples over 1 rank(s) x 2 worker(s), and its "
            "__len__ is 30: each sample read about 2 times, by several (rank, worker)s; the trainer took it as a "
            "stream that splits over ranks and workers by itself (its shards_itself attribute). Read the rank and "
            'worker in __iter__, or set shards_itself (docs/data.md, "Your own data")'
        ]
        assert said["no __len__, shards_itself but reads all"] == [
            "warning: in the first pass of the training stream rank 0 worker 0 and rank 0 worker 1 read the same "
            "first batch: samples are read more than once; the trainer took it as a stream that splits over ranks "
            "and workers by itself (its shards_itself attribute). Read the rank and worker in __iter__, or set "
            'shards_itself (docs/data.md, "Your own data")'
        ]


@pytest.mark.parametrize("kind", ["splits workers", "hf"])
def test_a_stream_that_splits_over_workers_itself_trains_on_every_sample_once_per_epoch(tmp_path, kind):
    """The issue's cases through fit: PyTorch's documented pattern (a range per get_worker_info() worker) and a
    Hugging Face stream passed through the Python API (no __len__: a constant LR), 2 loader workers, 2 epochs:
    each id trained once per epoch (before, half of them were never trained)."""
    from train_multi_gpu import MultiGPUTrainer

    if kind == "hf":
        pytest.importorskip("datasets", reason="the [hf] extra is not installed: pip install '.[hf]'")
    dataset = matrix_stream(kind, write_id_files(tmp_path / "files", "jsonl", MATRIX_SHARDS))
    if kind == "hf":
        dataset = dataset.with_format("torch")
    for epochs in (1, 2):
        config = config_for(
            tmp_path / "ckpt",
            1,
            num_workers=2,
            epochs=epochs,
            lr_schedule="constant",
            batch_size=4,
            resume="auto",
            log_every=1000,
        )
        with MultiGPUTrainer(IdModel(tmp_path / f"ids{epochs}"), dataset, None, config) as trainer:
            trainer.fit()
        assert sorted(read_ids([tmp_path / f"ids{epochs}"])) == MATRIX_IDS, f"epoch {epochs}"


def train_stream(rank: int, world: int, tmp: Path, workers: int, dataset: IdStream, **overrides) -> dict:
    """One rank of a run on `dataset`; its ids and the lines it reported."""
    import contextlib
    import io

    from train_multi_gpu import MultiGPUTrainer

    if world > 1:  # a rank of run_ranks; one rank runs in pytest's process
        fork_loader_workers()

    config = config_for(tmp, world, num_workers=workers, epochs=1, log_every=1000, batch_size=16, **overrides)
    out = io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        MultiGPUTrainer(IdModel(tmp / f"ids{rank}"), dataset, IdStream(), config) as trainer,
    ):
        summary = trainer.fit()
    return {"summary": summary, "out": out.getvalue(), "ids": read_ids([tmp / f"ids{rank}"])}


# (ranks, workers, the stream shards itself by whole shards, the first pass's longer line: each rank's samples,
# the steps the ranks that ran out joined, the pass's steps, the steps __len__ plans)
CASES = [
    (2, 2, True, ([137, 101], 3, 10, 8)),
    (3, 0, True, ([100, 101, 37], 4, 7, 5)),
    (1, 1, False, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("world, workers, by_shard, longer", CASES)
def test_training_on_a_stream_sees_every_sample_once_and_ranks_end_together(
    tmp_path, world, workers, by_shard, longer
):
    """Whole shards of 100, 101 and 37 per (rank, worker): under ddp the ranks that run out join the others'
    last steps, so every sample is trained once (before, 36 and 105 were left unused), all ranks end at the same
    step, and the longer first pass is said once."""
    dataset = IdStream(shards_itself=by_shard)
    results = (
        run_ranks(train_stream, world, tmp_path, tmp_path, workers, dataset)
        if world > 1
        else [train_stream(0, 1, tmp_path, workers, dataset)]
    )  # one rank: in this process
    trained = [i for result in results for i in result["ids"]]
    assert sorted(trained) == list(range(EPOCH))
    assert {result["summary"]["global_step"] for result in results} == {results[0]["summary"]["global_step"]}
    out = results[0]["out"]
    assert "val acc" in out and "(238 samples)" in out  # evaluation over the stream: every sample once
    assert "unused" not in out
    if longer is not None:
        shares, joined, steps, planned = longer
        assert (
            f"the training stream's first pass took {steps} steps, not the {planned} its __len__ plans: the ranks' "
            f"shares were {', '.join(f'rank {r}: {n}' for r, n in enumerate(shares))} samples, and the ranks that "
            f"ran out joined the others' last {joined} steps; the LR schedule and progress bar count {planned} "
            f"steps an epoch (--steps-per-epoch {steps} plans by the pass)" in out
        ), out


# ---------------------------------------------------------------- ranks known outside __iter__, unequal files
UNEQUAL_FILES = (53, 71, 9, 40)  # 4 JSONL files of 173 rows: whole files per rank leave a rank's tail over
UNEQUAL_IDS = list(range(sum(UNEQUAL_FILES)))


class EpochMark:
    """A callback that ends each epoch's ids in IdModel's file with a line "end"."""

    def __init__(self, ids_file: Path) -> None:
        self.ids_file = ids_file

    def on_epoch_end(self, trainer) -> None:
        with open(self.ids_file, "a") as out:
            out.write("end\n")


def unequal_stream(kind: str, folder: Path) -> torch.utils.data.IterableDataset:
    """Made on the rank: SplitIds that reads its rank in __init__ ("rank in __init__"), a Hugging Face stream of
    the UNEQUAL_FILES raw ("hf") or split_dataset_by_node ("hf split by node"), or IdStream's own split by whole
    shards of those lengths ("shards itself")."""
    if kind == "rank in __init__":
        return SplitIds(len(UNEQUAL_IDS), ranks="init")
    if kind == "shards itself":
        return IdStream(UNEQUAL_FILES, shards_itself=True)
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset(
        "json", data_files=sorted(map(str, folder.glob("*.jsonl"))), split="train", streaming=True
    )
    if kind == "hf split by node":
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return stream.with_format("torch")


def train_two_passes(rank: int, world: int, tmp: Path, cases: list[tuple[str, int, str]]) -> dict:
    """On each rank, for each (stream kind, loader workers, --multi-gpu): 2 epochs, each one pass; the ids this
    rank trained in each epoch and what the run said."""
    from train_multi_gpu import MultiGPUTrainer

    if world > 1:  # a rank of run_ranks; one rank runs in pytest's process
        fork_loader_workers()
    results = {}
    for kind, workers, mode in cases:
        run = tmp / f"{kind}-{workers}-{mode}".replace(" ", "_")
        ids_file = run / f"ids{rank}"
        config = config_for(
            run,
            world,
            multi_gpu=mode,
            num_workers=workers,
            epochs=2,
            batch_size=16,
            lr_schedule="constant",
            log_every=1000,
        )
        out = io.StringIO()
        dataset = unequal_stream(kind, tmp / "files")
        callbacks = [EpochMark(ids_file)]
        with (
            contextlib.redirect_stdout(out),
            MultiGPUTrainer(IdModel(ids_file), dataset, None, config, callbacks=callbacks) as trainer,
        ):
            trainer.fit()
        epochs = [[int(i) for i in part.split()] for part in ids_file.read_text().split("end\n")[:2]]
        results[kind, workers, mode] = {"epochs": epochs, "out": out.getvalue()}
    return results


def each_pass(ranks: list[dict], case: tuple[str, int, str]) -> list[list[int]]:
    """The ids trained in each of the two passes, over all ranks, sorted."""
    return [sorted(i for rank in ranks for i in rank[case]["epochs"][epoch]) for epoch in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_stream_that_knows_its_rank_outside_iter_and_unequal_files_train_every_sample_once_per_pass(
    tmp_path, world
):
    """Under ddp, at 1, 2 and 3 ranks x 0 and 2 loader workers, two epochs each: a stream that reads its rank in
    __init__ (which no probe of __iter__ sees) is found split by rank from what the ranks read, and not split
    again; 4 JSONL files of 53, 71, 9 and 40 rows through Hugging Face streaming (raw, and after
    split_dataset_by_node), whose whole files per rank are unequal, train every row: the ranks that run out join
    the others' steps. Every id is trained exactly once in each pass. (Before: 2 ranks trained 1/2 of the
    first stream, and left 43 rows of the files unused every pass.)"""
    hf = importlib.util.find_spec("datasets") is not None  # the [hf] extra: the files are read only with it
    write_id_files(tmp_path / "files", "jsonl", UNEQUAL_FILES)
    mode = "ddp" if world > 1 else "none"
    cases = [("rank in __init__", 0, mode), ("rank in __init__", 2, mode)]
    if hf and world > 1:  # at 1 rank every file is the rank's own
        cases += [("hf", 0, mode), ("hf split by node", 2, mode)]
    ranks = (
        run_ranks(train_two_passes, world, tmp_path, tmp_path, cases)
        if world > 1
        else [train_two_passes(0, 1, tmp_path, cases)]
    )
    for case in cases:
        assert each_pass(ranks, case) == [UNEQUAL_IDS, UNEQUAL_IDS], case
        assert "samples left unused" not in ranks[0][case]["out"], case
    if world > 1:
        said = ranks[0][("rank in __init__", 0, mode)]["out"]
        assert (
            "data: a stream, split over ranks by itself, workers by the trainer (the ranks read different first "
            "samples; its first sample read as worker 0 and 1 for the workers); uneven ends: ranks that run out "
            "join the others' steps, every sample trained once a pass" in said
        ), said


@pytest.mark.slow
def test_under_fsdp_unequal_files_are_split_by_example_and_what_cannot_be_trained_is_said(tmp_path):
    """fsdp, 2 ranks: a rank that ran out cannot take part in the others' sharded steps, so ranks cannot join.
    A Hugging Face stream of the unequal files is split over ranks by example instead of by whole files (raw, 2
    loader workers): every id once per pass. A stream that splits by whole files itself cannot be re-split:
    the rows it leaves on the longer rank are said in one line each pass, and every other id trained once."""
    pytest.importorskip("datasets", reason="the [hf] extra is not installed: pip install '.[hf]'")
    write_id_files(tmp_path / "files", "jsonl", UNEQUAL_FILES)
    cases = [("hf", 2, "fsdp"), ("shards itself", 0, "fsdp")]
    ranks = run_ranks(train_two_passes, 2, tmp_path, tmp_path, cases)
    hf = ranks[0][cases[0]]["out"]
    assert each_pass(ranks, cases[0]) == [UNEQUAL_IDS, UNEQUAL_IDS]
    assert "samples left unused" not in hf
    assert (
        "data: a stream, split over ranks by the trainer, workers by itself (a Hugging Face stream of 4 shard(s), "
        "split over ranks by example (ranks cannot join here: whole files per rank would leave the longer files' "
        "tails untrained)); uneven ends: the ranks end each pass together at the first that runs out, what the "
        "others hold counted as unused (fsdp: a rank without a batch cannot take part in the others' sharded "
        "forward and backward)" in hf
    ), hf
    # Shards 0 and 2 (62 rows, 4 batches of 16) on rank 0, 1 and 3 (111 rows, 7 batches) on rank 1.
    by_files = ranks[0][cases[1]]["out"]
    for number, trained in enumerate(each_pass(ranks, cases[1]), start=1):
        assert len(trained) == len(set(trained)) == 62 + 4 * 16
        assert (
            f"end of the stream's pass {number}: ranks ran out at different steps and ended it together; "
            f"samples left unused: rank 0: 0, rank 1: 47" in by_files
        ), by_files


def test_a_stream_that_claims_to_shard_itself_but_reads_everything_gets_one_warning(tmp_path):
    results = run_ranks(train_stream, 2, tmp_path, tmp_path, 0, IdStream(shards_itself=True, mistaken=True))
    assert results[0]["out"].count("warning: every rank read the same first batch") == 1


STREAM_RUN = """
import os, sys, torch
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
from conftest import SHARDS, IdModel, IdStream, SplitIds, config_for
from train_multi_gpu import MultiGPUTrainer
out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
model = IdModel(out / f"ids{{rank}}-{{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}}")
config = config_for(out, 2, num_workers=2, epochs=1, save_every_steps={kill_step}, resume="auto", log_every=1000)
with MultiGPUTrainer(model, {stream}, None, config) as trainer:
    trainer.fit()
    if rank == 0:
        torch.save(trainer.model.state_dict(), out / "final.pt")
"""


def run_stream_torchrun(out: Path, stream: str, fault: str = "") -> subprocess.CompletedProcess:
    """STREAM_RUN of `stream` (an expression) under torchrun, 2 ranks x 2 workers, one restart allowed; `fault`
    for MULTIGPU_FAULT_INJECT."""
    out.mkdir()
    script = out / "run.py"
    script.write_text(
        STREAM_RUN.format(repo=str(REPO), tests=str(REPO / "tests"), kill_step=KILL_STEP, stream=stream)
    )
    env = cli_env({"MULTIGPU_FAULT_INJECT": fault} if fault else None)
    command = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        "--master-port",
        str(free_port()),
        str(script),
        str(out),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


KILL_STEP = 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "stream",
    ["IdStream()", "SplitIds(sum(SHARDS), workers=True)"],
    ids=["split by the trainer", "splits over workers itself"],
)
def test_sigkill_mid_epoch_then_resume_continues_each_stream_exactly(tmp_path, stream):
    """Rank 1 is SIGKILLed right after step 5's checkpoint (its first), mid-epoch; torchrun restarts both ranks
    with --resume auto: the ids trained before the kill and after the restart are exactly one epoch, and the
    weights equal an uninterrupted run's. With 2 loader workers per rank: 5 batches in, the worker whose turn
    is next is worker 1, which a stream that splits over workers by get_worker_info() must be told it is."""
    killed = run_stream_torchrun(tmp_path / "killed", stream, fault=f"1:{KILL_STEP}")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from" in killed.stdout + killed.stderr
    before = [
        i
        for rank in (0, 1)
        for line in (tmp_path / "killed" / f"ids{rank}-0").read_text().splitlines()[:KILL_STEP]
        for i in map(int, line.split())
    ]  # steps after the checkpoint were never saved
    after = read_ids([tmp_path / "killed" / f"ids{rank}-1" for rank in (0, 1)])
    assert sorted(before + after) == list(range(EPOCH))
    whole = run_stream_torchrun(tmp_path / "whole", stream)
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed, uninterrupted = (torch.load(tmp_path / name / "final.pt") for name in ("killed", "whole"))
    assert max((resumed[key] - uninterrupted[key]).abs().max().item() for key in resumed) == 0


class IdMap(torch.utils.data.Dataset):
    """IdStream's samples by index: map-style data with ids."""

    def __len__(self) -> int:
        return EPOCH

    def __getitem__(self, i: int) -> dict:
        return {"id": i, **IdStream.features(i)}


class SigtermAt:
    """A callback that sends this rank SIGTERM after `step`, as a preemption would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.progress.global_step == self.step:
            os.kill(os.getpid(), __import__("signal").SIGTERM)


def train_map(rank: int, world: int, tmp: Path, phase: str, stop_step: int) -> list[int]:
    from train_multi_gpu import MultiGPUTrainer

    config = config_for(tmp, world, epochs=1, log_every=stop_step or 50, resume="auto", batch_size=16)
    callbacks = [SigtermAt(stop_step)] if stop_step else []
    with MultiGPUTrainer(
        IdModel(tmp / f"{phase}{rank}"), IdMap(), None, config, callbacks=callbacks
    ) as trainer:
        trainer.fit()
    return read_ids([tmp / f"{phase}{rank}"])


@pytest.mark.slow
def test_map_style_resume_from_2_to_3_ranks_mid_epoch_continues_the_epochs_order(tmp_path):
    before = [i for ids in run_ranks(train_map, 2, tmp_path, tmp_path, "before", 2) for i in ids]
    after = [i for ids in run_ranks(train_map, 3, tmp_path, tmp_path, "after", 0) for i in ids]
    assert 0 < len(before) < EPOCH // 2  # stopped mid-epoch, at a sync point after step 2
    assert sorted(before + after) == list(
        range(EPOCH)
    )  # 238 - 64 = 174 splits evenly over 3: nothing trimmed


class EndlessIds(IdStream):
    """A stream without __len__."""

    __len__ = None  # type: ignore[assignment]  # none at all, as a stream has


class Terminal(io.StringIO):
    """A console that says it is a terminal, so the progress bar draws into it."""

    def isatty(self) -> bool:
        return True


def test_a_stream_without_a_length_trains_by_passes_with_a_bar_of_steps_and_no_total(tmp_path):
    """No __len__, no --steps-per-epoch, a constant LR: each of the 2 epochs is one pass (30 steps of 8), every
    id trained once in each; the plan says so and the bar counts steps and their rate, with no total."""
    from train_multi_gpu import MultiGPUTrainer

    config = config_for(tmp_path, 1, lr_schedule="constant", progress=True, log_every=1000)
    console = Terminal()
    with (
        contextlib.redirect_stdout(console),
        MultiGPUTrainer(IdModel(tmp_path / "ids"), EndlessIds(), None, config) as trainer,
    ):
        summary = trainer.fit()
    assert (summary["epochs"], summary["global_step"]) == (2, 60)
    assert collections.Counter(read_ids([tmp_path / "ids"])) == {i: 2 for i in range(EPOCH)}
    printed = console.getvalue()
    assert (
        "schedule constant, warm-up 0 steps (first step lr 0.01, peak 0.01), an epoch is one pass of the stream "
        "(no __len__: steps unknown), 2 epochs; amp" in printed
    )
    assert re.search(r"epoch 2/2: 30step \[[0-9:]+, +[0-9.]+step/s", printed), printed  # no "30/N"


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        ({}, "--lr-schedule cosine needs the run's length in steps, and this training stream has no __len__"),
        (
            {"lr_schedule": "constant", "warmup_epochs": 0.5},
            "--warmup-epochs 0.5 counts steps in epochs, and this training stream has no __len__",
        ),
        ({"lr_schedule": "step"}, "--lr-schedule step needs the run's length in steps"),
        (
            {
                "scheduler": lambda optimizer, total_steps: torch.optim.lr_scheduler.OneCycleLR(
                    optimizer, 0.1, total_steps
                )
            },
            "your scheduler takes total_steps, and this training stream has no __len__",
        ),
    ],
)
def test_a_schedule_that_needs_the_length_of_a_stream_without_one_is_refused_naming_the_flags(
    tmp_path, overrides, refusal
):
    from multigpu.errors import UsageError
    from train_multi_gpu import MultiGPUTrainer

    scheduler = overrides.pop("scheduler", None)
    with pytest.raises(
        UsageError,
        match="^" + re.escape(refusal) + ".*: give --steps-per-epoch N or --max-steps N "
        r"\(steps_per_epoch=N, max_steps=N\)",
    ):
        MultiGPUTrainer(
            IdModel(), EndlessIds(), None, config_for(tmp_path, 1, **overrides), scheduler=scheduler
        )


@pytest.mark.parametrize(
    "flags, said",
    [
        ({"steps_per_epoch": 20, "epochs": 2}, "10 steps into an epoch of --steps-per-epoch 20"),
        ({"max_steps": 40, "epochs": 1}, "30 steps into an epoch of --max-steps 40"),
    ],
)
def test_a_pass_that_runs_out_before_the_epoch_is_followed_by_the_next_and_said_once(tmp_path, flags, said):
    """30 steps of data a pass: --steps-per-epoch 20 x 2 epochs, or --max-steps 40 alone, train all 40 steps,
    pass 2 following pass 1 from the stream's start, and the cosine schedule reaches its end; one line says so."""
    from train_multi_gpu import MultiGPUTrainer

    out = io.StringIO()
    config = config_for(tmp_path, 1, log_every=1000, **flags)
    with (
        contextlib.redirect_stdout(out),
        MultiGPUTrainer(IdModel(tmp_path / "ids"), EndlessIds(), None, config) as trainer,
    ):
        assert trainer.fit()["global_step"] == 40
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    assert sorted(read_ids([tmp_path / "ids"])) == sorted(
        [*range(EPOCH), *range(10 * 8)]
    )  # 29 x 8 + 6, 10 x 8
    assert out.getvalue().count("the training stream ran out") == 1
    assert (
        f"the training stream ran out after 30 steps (pass 1), {said}: the epoch goes on with pass 2, from the "
        f"stream's start (said once)" in out.getvalue()
    )


def test_max_steps_alone_bounds_an_endless_stream_and_its_schedule(tmp_path):
    from train_multi_gpu import MultiGPUTrainer

    config = config_for(tmp_path, 1, max_steps=9, epochs=3, lr_schedule="cosine")
    with MultiGPUTrainer(IdModel(), EndlessIds(), None, config) as trainer:
        assert trainer.steps_per_epoch == 9 and trainer.total_steps == 9  # one epoch of --max-steps steps
        summary = trainer.fit()
        assert summary["global_step"] == 9 and summary["epochs"] == 1
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)  # cosine ends at step 9


def test_a_resume_reaches_max_steps_on_an_endless_stream_with_the_uninterrupted_weights(tmp_path):
    """--max-steps 13 alone on an endless stream: a run that died at step 7 resumes from its step-5 checkpoint,
    trains exactly to 13 on the samples the uninterrupted run saw, and ends with its weights, bit for bit."""
    from train_multi_gpu import MultiGPUTrainer

    def run(name: str, callbacks=(), **extra) -> MultiGPUTrainer:
        torch.manual_seed(0)
        config = config_for(
            tmp_path / name,
            1,
            max_steps=13,
            lr_schedule="cosine",
            warmup_epochs=0.2,
            save_every_steps=5,
            num_workers=1,
            **extra,
        )
        return MultiGPUTrainer(
            IdModel(tmp_path / f"ids-{name}"), EndlessIds(), None, config, callbacks=list(callbacks)
        )

    with run("whole") as whole:
        assert whole.fit()["global_step"] == 13
    with pytest.raises(RuntimeError, match="killed"), run("cut", [CrashAt(7)]) as cut:
        cut.fit()
    saved = (tmp_path / "ids-cut").read_text().splitlines()[:5]  # steps 6 and 7 died with the run
    (tmp_path / "ids-cut").write_text("\n".join(saved) + "\n")
    with run("cut", resume="auto") as resumed:
        assert resumed.fit()["global_step"] == 13
        assert read_ids([tmp_path / "ids-cut"]) == read_ids(
            [tmp_path / "ids-whole"]
        )  # the same 13 steps' samples
        for name, tensor in resumed.model.state_dict().items():
            assert torch.equal(tensor, whole.model.state_dict()[name]), name


def evaluate_stream(rank: int, world: int, tmp: Path, workers: int, by_shard: bool) -> dict[str, float]:
    """One rank's evaluation of IdStream (its ids go to eval<rank>), without training."""
    from train_multi_gpu import MultiGPUTrainer

    if world > 1:  # a rank of run_ranks; one rank runs in pytest's process
        fork_loader_workers()

    config = config_for(tmp, world, num_workers=workers, eval_batch_size=5)
    model = IdModel(eval_ids_file=tmp / f"eval{rank}")
    with MultiGPUTrainer(model, IdStream(), IdStream(shards_itself=by_shard), config) as trainer:
        return trainer.evaluate()


@pytest.mark.slow
@pytest.mark.parametrize("world, workers, by_shard", [(1, 2, True), (2, 2, False)])
def test_evaluation_over_a_stream_counts_every_sample_once_over_ranks_and_workers(
    tmp_path, world, workers, by_shard
):
    """The ids the model evaluated, over all ranks and loader workers, are each sample of the pass once, and
    every rank reports the same result over all of them (uneven shards: ranks end at different batches)."""
    results = (
        run_ranks(evaluate_stream, world, tmp_path, tmp_path, workers, by_shard)
        if world > 1
        else [evaluate_stream(0, 1, tmp_path, workers, by_shard)]
    )
    assert sorted(read_ids([tmp_path / f"eval{rank}" for rank in range(world)])) == list(range(EPOCH))
    assert all(result == results[0] for result in results) and results[0]["count"] == EPOCH


def test_a_self_sharding_streams_position_is_refused_at_another_layout_in_one_line(tmp_path):
    from multigpu.errors import UsageError
    from train_multi_gpu import MultiGPUTrainer

    with MultiGPUTrainer(IdModel(), IdStream(shards_itself=True), None, config_for(tmp_path, 1)) as trainer:
        state = {
            "pass": 0,
            "steps_in_epoch": 3,
            "layers": [{"slots": 2, "counts": [24, 24]}],
            "world_size": 2,
            "workers": 1,
            "shards_itself": True,
            "batches_taken": [3, 3],
        }
        with pytest.raises(
            UsageError,
            match=r"^the checkpoint holds the position of a stream that shards itself "
            r"over 2 rank",
        ):
            trainer.stream.load_state_dict(state)
        with pytest.raises(UsageError, match=r"^the checkpoint holds no stream position"):
            trainer.stream.load_state_dict({})  # what a map-style run's checkpoint gives it


class EpochCalls(torch.utils.data.IterableDataset):
    """A stream of 8 ids that notes, in a file, the process that sets each epoch."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def set_epoch(self, epoch: int) -> None:
        with open(self.log, "a") as file:
            file.write(f"{os.getpid()} {epoch}\n")

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter({"id": i} for i in range(worker, 8, workers))


def test_each_pass_sets_the_streams_epoch_in_the_ranks_process_before_its_workers_start(tmp_path):
    """A Hugging Face stream keeps its epoch in a tensor shared with the loader workers, and its set_epoch adds
    the difference in place: two workers that both set it could leave it at 2 for pass 1, and the epoch orders
    the shards (one run in two of the stream matrix read another rank's shard). The epoch is set once per pass,
    by the rank, never by a worker."""
    from multigpu.data import build_loader
    from multigpu.data.streaming import TrainStream
    from multigpu.parallel.distributed import Runtime

    log = tmp_path / "epochs"
    runtime = Runtime("none", torch.device("cpu"), 0, 0, 1)
    stream = TrainStream(EpochCalls(log), runtime, 4, 1, 0, 2, 0, None, build_loader)
    for pass_number in (0, 1):
        stream.shard.pass_number = pass_number
        assert sorted(i for _, _, batch in stream.loader for i in batch["id"].tolist()) == list(range(8))
    calls = [line.split() for line in log.read_text().splitlines()]
    assert {pid for pid, _ in calls} == {str(os.getpid())} and [epoch for _, epoch in calls][-1] == "1"
