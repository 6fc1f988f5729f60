"""Streaming training data (multigpu/streaming.py): every sample once over ranks x workers, uneven ends that
never hang, and resume at the exact sample, at another layout too. Real DataLoader workers and real gloo ranks."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import (DIST_TIMEOUT, PYTHON, REPO, SHARDS, CrashAt, IdModel, IdStream, cli_env, config_for,
                      free_port, read_ids, run_ranks)
from multigpu.streaming import StreamShard, TaggedCollate

EPOCH = sum(SHARDS)


def shard_ids(rank: int, world: int, workers: int, skip=None, batches=None) -> tuple[list[int], dict[int, int]]:
    """The ids one rank's loader gives (all, or its first `batches` batches), and the samples per slot."""
    shard = StreamShard(IdStream(), rank, world)
    shard.skip = skip
    loader = DataLoader(shard, batch_size=5, num_workers=workers, collate_fn=TaggedCollate(None))
    ids, counts = [], {}
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
            ids, mine = shard_ids(rank, world, workers, skip=[dict(layer) for layer in layers] or None,
                                  batches=batches)
            seen += ids
            for slot, n in mine.items():
                counts[slot] = n
        layers.append({"slots": len(counts), "counts": counts})
    assert sorted(seen) == list(range(EPOCH))


def train_stream(rank: int, world: int, tmp: Path, workers: int, dataset: IdStream, **overrides) -> dict:
    """One rank of a run on `dataset`; its ids and the lines it reported."""
    import contextlib
    import io

    from train_multi_gpu import MultiGPUTrainer

    config = config_for(tmp, world, num_workers=workers, epochs=1, log_every=1000, batch_size=16, **overrides)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), MultiGPUTrainer(IdModel(tmp / f"ids{rank}"), dataset, IdStream(),
                                                          config) as trainer:
        summary = trainer.fit()
    return {"summary": summary, "out": out.getvalue(), "ids": read_ids([tmp / f"ids{rank}"])}


# (ranks, workers, the stream shards itself by whole shards, samples each rank leaves unused at the uneven end)
CASES = [(2, 2, True, [36, 0]), (3, 0, True, [52, 53, 0]), (1, 1, False, None)]


@pytest.mark.parametrize("world, workers, by_shard, unused", CASES)
def test_training_on_a_stream_sees_every_sample_once_and_ranks_end_together(tmp_path, world, workers, by_shard,
                                                                             unused):
    dataset = IdStream(shards_itself=by_shard)
    results = (run_ranks(train_stream, world, tmp_path, tmp_path, workers, dataset) if world > 1
               else [train_stream(0, 1, tmp_path, workers, dataset)])  # one rank: in this process
    trained = [i for result in results for i in result["ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained on twice"
    assert {result["summary"]["global_step"] for result in results} == {results[0]["summary"]["global_step"]}
    out = results[0]["out"]
    assert "val acc" in out and "(238 samples)" in out  # evaluation over the stream: every sample once
    if unused is None:
        assert sorted(trained) == list(range(EPOCH)) and "unused" not in out
    else:
        assert "samples left unused: " + ", ".join(f"rank {r}: {n}" for r, n in enumerate(unused)) in out
        assert len(trained) + sum(unused) == EPOCH


def test_a_stream_that_claims_to_shard_itself_but_reads_everything_gets_one_warning(tmp_path):
    results = run_ranks(train_stream, 2, tmp_path, tmp_path, 0, IdStream(shards_itself=True, mistaken=True))
    assert results[0]["out"].count("warning: every rank read the same first batch") == 1


STREAM_RUN = """
import os, sys, torch
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
from conftest import IdModel, IdStream, config_for
from train_multi_gpu import MultiGPUTrainer
out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
model = IdModel(out / f"ids{{rank}}-{{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}}")
config = config_for(out, 2, num_workers=2, epochs=1, save_every_steps={kill_step}, resume="auto", log_every=1000)
with MultiGPUTrainer(model, IdStream(), None, config) as trainer:
    trainer.fit()
    if rank == 0:
        torch.save(trainer.model.state_dict(), out / "final.pt")
"""


def run_stream_torchrun(out: Path, fault: str = "") -> subprocess.CompletedProcess:
    """STREAM_RUN under torchrun, 2 ranks x 2 workers, one restart allowed; `fault` for MULTIGPU_FAULT_INJECT."""
    out.mkdir()
    script = out / "run.py"
    script.write_text(STREAM_RUN.format(repo=str(REPO), tests=str(REPO / "tests"), kill_step=KILL_STEP))
    env = cli_env({"MULTIGPU_FAULT_INJECT": fault} if fault else None)
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
               "--master-port", str(free_port()), str(script), str(out)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


KILL_STEP = 5


def test_sigkill_mid_epoch_then_resume_continues_each_stream_exactly(tmp_path):
    """Rank 1 is SIGKILLed after step 5's checkpoint; torchrun restarts both ranks with --resume auto: the ids
    trained before the kill and after the restart are exactly one epoch, and the weights equal an uninterrupted
    run's."""
    killed = run_stream_torchrun(tmp_path / "killed", fault=f"1:{KILL_STEP}")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from" in killed.stdout + killed.stderr
    before = [i for rank in (0, 1) for line in (tmp_path / "killed" / f"ids{rank}-0").read_text().splitlines()
              [:KILL_STEP] for i in map(int, line.split())]  # steps after the checkpoint were never saved
    after = read_ids([tmp_path / "killed" / f"ids{rank}-1" for rank in (0, 1)])
    assert sorted(before + after) == list(range(EPOCH))
    whole = run_stream_torchrun(tmp_path / "whole")
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
    with MultiGPUTrainer(IdModel(tmp / f"{phase}{rank}"), IdMap(), None, config, callbacks=callbacks) as trainer:
        trainer.fit()
    return read_ids([tmp / f"{phase}{rank}"])


def test_map_style_resume_from_2_to_3_ranks_mid_epoch_continues_the_epochs_order(tmp_path):
    before = [i for ids in run_ranks(train_map, 2, tmp_path, tmp_path, "before", 2) for i in ids]
    after = [i for ids in run_ranks(train_map, 3, tmp_path, tmp_path, "after", 0) for i in ids]
    assert 0 < len(before) < EPOCH // 2  # stopped mid-epoch, at a sync point after step 2
    assert sorted(before + after) == list(range(EPOCH))  # 238 - 64 = 174 splits evenly over 3: nothing trimmed


class EndlessIds(IdStream):
    """A stream without __len__."""

    __len__ = None  # type: ignore[assignment]


def test_a_stream_without_a_length_needs_steps_per_epoch_and_then_trains_that_many(tmp_path):
    from multigpu.errors import UsageError
    from train_multi_gpu import MultiGPUTrainer

    with pytest.raises(UsageError, match="needs --steps-per-epoch N or --max-steps N"):
        MultiGPUTrainer(IdModel(), EndlessIds(), None, config_for(tmp_path / "a", 1))
    with MultiGPUTrainer(IdModel(), EndlessIds(), None, config_for(tmp_path / "b", 1, steps_per_epoch=7)) as trainer:
        assert trainer.fit()["global_step"] == 2 * 7  # the pass of 30 batches goes on across epochs


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
        config = config_for(tmp_path / name, 1, max_steps=13, lr_schedule="cosine", warmup_epochs=0.2,
                            save_every_steps=5, num_workers=1, **extra)
        return MultiGPUTrainer(IdModel(tmp_path / f"ids-{name}"), EndlessIds(), None, config, callbacks=list(callbacks))

    with run("whole") as whole:
        assert whole.fit()["global_step"] == 13
    with pytest.raises(RuntimeError, match="killed"), run("cut", [CrashAt(7)]) as cut:
        cut.fit()
    saved = (tmp_path / "ids-cut").read_text().splitlines()[:5]  # steps 6 and 7 died with the run
    (tmp_path / "ids-cut").write_text("\n".join(saved) + "\n")
    with run("cut", resume="auto") as resumed:
        assert resumed.fit()["global_step"] == 13
        assert read_ids([tmp_path / "ids-cut"]) == read_ids([tmp_path / "ids-whole"])  # the same 13 steps' samples
        for name, tensor in resumed.model.state_dict().items():
            assert torch.equal(tensor, whole.model.state_dict()[name]), name


def evaluate_stream(rank: int, world: int, tmp: Path, workers: int, by_shard: bool) -> dict[str, float]:
    """One rank's evaluation of IdStream (its ids go to eval<rank>), without training."""
    from train_multi_gpu import MultiGPUTrainer

    config = config_for(tmp, world, num_workers=workers, eval_batch_size=5)
    model = IdModel(eval_ids_file=tmp / f"eval{rank}")
    with MultiGPUTrainer(model, IdStream(), IdStream(shards_itself=by_shard), config) as trainer:
        return trainer.evaluate()


@pytest.mark.parametrize("world, workers, by_shard", [(1, 2, True), (2, 2, False)])
def test_evaluation_over_a_stream_counts_every_sample_once_over_ranks_and_workers(tmp_path, world, workers, by_shard):
    """The ids the model evaluated, over all ranks and loader workers, are each sample of the pass once, and
    every rank reports the same result over all of them (uneven shards: ranks end at different batches)."""
    results = (run_ranks(evaluate_stream, world, tmp_path, tmp_path, workers, by_shard) if world > 1
               else [evaluate_stream(0, 1, tmp_path, workers, by_shard)])
    assert sorted(read_ids([tmp_path / f"eval{rank}" for rank in range(world)])) == list(range(EPOCH))
    assert all(result == results[0] for result in results) and results[0]["count"] == EPOCH


def test_a_self_sharding_streams_position_is_refused_at_another_layout_in_one_line(tmp_path):
    from multigpu.errors import UsageError
    from train_multi_gpu import MultiGPUTrainer

    with MultiGPUTrainer(IdModel(), IdStream(shards_itself=True), None, config_for(tmp_path, 1)) as trainer:
        state = {"pass": 0, "steps_in_epoch": 3, "layers": [{"slots": 2, "counts": [24, 24]}], "world_size": 2,
                 "workers": 1, "shards_itself": True, "batches_taken": [3, 3]}
        with pytest.raises(UsageError, match=r"^the checkpoint holds the position of a stream that shards itself "
                                             r"over 2 rank"):
            trainer.stream.load_state_dict(state)
        with pytest.raises(UsageError, match=r"^the checkpoint holds no stream position"):
            trainer.stream.load_state_dict({})  # what a map-style run's checkpoint gives it
