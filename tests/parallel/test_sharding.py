"""--multi-gpu fsdp (multigpu/parallel/sharding.py): which blocks are sharded, and that sharded training is the
same training.

Equivalence (issue 22): fsdp at 2 processes = ddp at 2 processes = one process at twice the batch, within 1e-5
of every parameter after 5 AdamW steps (fp32), with and without gradient accumulation and clipping. All 2-rank
runs share one spawn of real gloo processes (module fixture); the same spawn checks that clipping's total norm
over sharded gradients is the full one, that evaluation and prediction are exact when the ranks have different
numbers of batches, that the EMA of sharded weights is the EMA of one process, and that a checkpoint saved by
fsdp at 2 processes resumes at 1 to the same weights as an uninterrupted run.

Hybrid sharding (issue 41): one spawn of 4 gloo processes (module fixture) places the parameters on the 2x2 mesh,
checks hybrid 2x2 = fsdp 1x4 = ddp at 4 = one process at 4 times the batch, counts every optimizer step's
collectives on each process group, moves checkpoints between 2x2 and 1x4, 4x1, ddp, one device and (by the 2-rank
spawn, before and after) 1x2, and checks a SIGTERM's checkpoint and bf16 on the mesh.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import main_multi_gpu
from conftest import (
    REPO,
    StepRecorder,
    blobs,
    config_for,
    full_weights,
    global_steps,
    needs_compiler,
    run_ranks,
    tiny_model,
)
from multigpu.checkpoints import sharded
from multigpu.config import parse_config
from multigpu.errors import UsageError
from multigpu.parallel import sharding
from train_multi_gpu import MultiGPUTrainer

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_common import CollectiveTally, mesh_labels  # noqa: E402  (after the path set-up)

TOLERANCE = 1e-5
WORLD = 2
SIZE, VAL_SIZE = (
    80,
    21,
)  # 80 samples at 16 per step: 5 steps; 21 = eval batches of 8, 8, 5: rank 1 has one fewer
# Per-rank settings at 2 ranks; one process gets batch_size x 2.
RUNS: dict[str, dict[str, Any]] = {
    "plain": dict(batch_size=8),
    "accum": dict(batch_size=4, grad_accum_steps=2),
    "clip": dict(batch_size=8, clip_grad_norm=0.05),
    "accum+clip+ema": dict(batch_size=4, grad_accum_steps=2, clip_grad_norm=0.05, ema_decay=0.5),
}


class CollectivesPerStep:
    """A callback: this rank's collectives in each optimizer step, by process group, counted from the start of
    fit (bench_common.CollectiveTally, the mesh's groups named by their dimensions)."""

    def __init__(self) -> None:
        self.tally: CollectiveTally | None = None
        self.steps: list[dict] = []

    def on_fit_start(self, trainer: MultiGPUTrainer) -> None:
        first = next(trainer.model.parameters())
        assert isinstance(first, DTensor)  # sharded
        self.tally = CollectiveTally(mesh_labels(first.device_mesh)).__enter__()

    def on_step_end(self, trainer: MultiGPUTrainer) -> None:
        assert self.tally is not None  # counting since on_fit_start
        self.steps.append(self.tally.reset())


def train(
    tmp_path: Path,
    world_size: int,
    mode: str,
    epochs: int = 1,
    val_size: int = VAL_SIZE,
    predict_batch: int = 8,
    count: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Train tiny_model for 5 AdamW steps an epoch; the full weights (rank 0), EMA weights, evaluation and
    predictions, the summary, each parameter's placements and mesh, and with `count` each step's collectives."""
    config = config_for(
        tmp_path, world_size, multi_gpu=mode, optimizer="adamw", lr=3e-3, epochs=epochs, **overrides
    )
    counter = CollectivesPerStep() if count else None
    model, dtypes = tiny_model(), set()
    model[0].register_forward_hook(lambda module, args, output: dtypes.add(output.dtype))
    with MultiGPUTrainer(
        model, blobs(SIZE, 0), blobs(val_size, 1), config, callbacks=[counter] if counter else []
    ) as trainer:
        dtypes.clear()  # the construction's forwards (FLOP count, name checks) are not training's
        try:
            summary = trainer.fit()
        finally:
            if counter is not None and counter.tally is not None:
                counter.tally.__exit__()
        ema = trainer.eval_model.state_dict() if trainer.eval_model is not None else None
        meshes = {
            (
                str(p.placements),
                p.device_mesh.mesh_dim_names,
                tuple(p.device_mesh.shape),
                tuple(p.device_mesh.get_coordinate()),  # type: ignore[arg-type]  # None off the mesh only
            )
            for p in trainer.model.parameters()
            if isinstance(p, DTensor)  # those with placements
        }
        return {
            "weights": full_weights(trainer),
            "ema": ema,
            "steps": summary["global_step"],
            "summary": summary,
            "eval": trainer.evaluate(),
            "predict": trainer.predict(batch_size=predict_batch),
            "meshes": meshes,
            "position": trainer.runtime.mesh_position,
            "collectives": counter.steps if counter else None,
            "dtypes": dtypes,
        }


def _clipped_norm(world_size: int) -> tuple[float, float]:
    """clip_grad_norm_'s total norm over a sharded model's gradients, and over the same unsharded model's."""
    plain, sharded = tiny_model(), tiny_model()
    sharding.shard(sharded, torch.device("cpu"), world_size)
    inputs, targets = blobs(16, 2).tensors
    nn.functional.cross_entropy(plain(inputs), targets).backward()
    rank = torch.distributed.get_rank()
    # Each rank's half of the batch, each loss weighted by its half: the reduced gradient is the whole batch's.
    half = slice(rank * 8, rank * 8 + 8)
    nn.functional.cross_entropy(sharded(inputs[half]), targets[half]).backward()
    full = nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    total = nn.utils.clip_grad_norm_(sharded.parameters(), 1e-3)
    return float(total.full_tensor() if hasattr(total, "full_tensor") else total), float(full)


def _rank(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, settings in RUNS.items():
        for mode in ("fsdp", "ddp"):
            results[f"{mode}/{name}"] = train(
                tmp_path / f"rank{rank}" / mode / name, world_size, mode, **settings
            )
    # Saved by fsdp at 2 ranks after epoch 1 (the parent resumes it at 1 process for epoch 2; a constant LR, as
    # a schedule's length depends on --epochs).
    train(tmp_path / "resume", world_size, "fsdp", lr_schedule="constant", ema_decay=0.5, **RUNS["plain"])
    results["norms"] = _clipped_norm(world_size)
    results["1x2"] = resumable(rank, world_size, tmp_path / "1x2", "1x2")  # resumed at 2x2 by four_ranks
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp_path = tmp_path_factory.mktemp("fsdp")
    rank0, _ = run_ranks(_rank, WORLD, tmp_path, tmp_path)
    return rank0, tmp_path


def one_process(tmp_path: Path, mode: str = "none", world: int = WORLD, **settings: Any) -> dict[str, Any]:
    """The same run in one process with the whole batch of the `world` ranks."""
    settings = dict(settings, batch_size=settings["batch_size"] * world)
    return train(tmp_path, 1, mode, **settings)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_fsdp_equals_ddp_and_one_process_with_the_whole_batch(two_ranks, tmp_path, name):
    results, _ = two_ranks
    fsdp, ddp, single = results[f"fsdp/{name}"], results[f"ddp/{name}"], one_process(tmp_path, **RUNS[name])
    assert fsdp["steps"] == ddp["steps"] == single["steps"] == 5
    assert max_difference(single["weights"], tiny_model().state_dict()) > 1e-3  # training moved the weights
    for other in (fsdp, ddp):
        assert max_difference(other["weights"], single["weights"]) <= TOLERANCE
        # Evaluation and prediction over 3 batches at 2 ranks: rank 1 runs a stand-in forward in round 2.
        assert other["eval"]["count"] == VAL_SIZE
        assert abs(other["eval"]["loss"] - single["eval"]["loss"]) <= TOLERANCE
        assert (other["predict"] - single["predict"]).abs().max().item() <= TOLERANCE
    if single["ema"] is not None:
        assert max_difference(fsdp["ema"], single["ema"]) <= TOLERANCE
        assert max_difference(fsdp["ema"], fsdp["weights"]) > 1e-4  # the average, not the weights


def test_clipping_sharded_gradients_returns_the_full_norm(two_ranks):
    sharded, full = two_ranks[0]["norms"]
    assert sharded == pytest.approx(full, rel=1e-5)


@pytest.mark.parametrize(
    "saved_by, resumed_by", [("fsdp x 2", "fsdp"), ("fsdp x 2", "none"), ("none", "fsdp")]
)
def test_a_checkpoint_resumes_across_fsdp_and_one_device_like_an_uninterrupted_run(
    two_ranks, tmp_path, saved_by, resumed_by
):
    """Epoch 1 saved by fsdp at 2 processes (or one device), epoch 2 resumed in one process by fsdp (or one
    device): the same weights and EMA as 2 epochs uninterrupted. The full state is gathered into one file,
    so the model, optimizer and EMA state move between any world sizes and modes."""
    settings = dict(batch_size=16, lr_schedule="constant", ema_decay=0.5)
    if saved_by == "none":
        train(tmp_path / "run", 1, "none", **settings)
    else:
        shutil.copytree(two_ranks[1] / "resume", tmp_path / "run")
    resumed = train(tmp_path / "run", 1, resumed_by, epochs=2, resume="auto", **settings)
    uninterrupted = train(tmp_path / "whole", 1, "none", epochs=2, **settings)
    assert resumed["steps"] == uninterrupted["steps"] == 10
    assert max_difference(resumed["weights"], uninterrupted["weights"]) <= TOLERANCE
    assert max_difference(resumed["ema"], uninterrupted["ema"]) <= TOLERANCE


# ---------------------------------------------------------------- which blocks, in one process
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)  # 16 parameters: below the share that makes a block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def test_blocks_are_the_outermost_large_children_of_containers_or_the_named_classes():
    stack = Stack()
    assert sharding.find_blocks(stack) == list(stack.blocks)  # not the Linear layers inside each block's mlp
    assert sharding.find_blocks(stack, "Linear") == [stack.embed] + [
        b.mlp[i] for b in stack.blocks for i in (0, 2)
    ]
    sequential = tiny_model()
    assert sharding.find_blocks(sequential) == [sequential[0], sequential[2]]  # the ReLU has no parameters
    with pytest.raises(
        UsageError,
        match=r"--fsdp-blocks Block,Nope: the model has no module of class Nope; "
        r"name classes it has, e\.g\. Block",
    ):
        sharding.find_blocks(stack, "Block,Nope")


def test_fsdp_flags_and_their_no_form():
    assert parse_config(["--multi-gpu", "fsdp"]).fsdp_reshard_after_forward is True
    config = parse_config(
        ["--multi-gpu", "fsdp", "--no-fsdp-reshard-after-forward", "--fsdp-blocks", "Block"]
    )
    assert (config.fsdp_reshard_after_forward, config.fsdp_blocks) == (False, "Block")


def test_fsdp_in_one_process_trains_one_shard_and_says_so(tmp_path, capsys):
    args = [
        "--multi-gpu",
        "fsdp",
        "--train-size",
        "64",
        "--val-size",
        "16",
        "--batch-size",
        "16",
        "--epochs",
        "1",
        "--no-progress",
        "--save-dir",
        str(tmp_path / "run"),
        "--no-fsdp-reshard-after-forward",
    ]
    assert main_multi_gpu.main(args) == 0
    out = capsys.readouterr().out
    assert "mode fsdp: one process, one shard" in out
    assert "(parameters kept gathered from forward to backward)" in out
    assert not torch.distributed.is_initialized()  # the one-process group is gone with the run
    assert (tmp_path / "run" / "last" / ".metadata").is_file()  # fsdp writes sharded folders (one shard here)
    state = sharded.load_whole(str(tmp_path / "run" / "last"))
    assert all(
        type(tensor) is torch.Tensor for tensor in state["model"].values()
    )  # whole tensors, not DTensors
    assert (
        main_multi_gpu.main(args + ["--checkpoint-format", "file", "--save-dir", str(tmp_path / "file")]) == 0
    )
    state = torch.load(tmp_path / "file" / "last.pt", weights_only=True)  # or one file, gathered whole
    assert all(type(tensor) is torch.Tensor for tensor in state["model"].values())


# ---------------------------------------------------------------- hybrid sharding (HSDP): a 2-D mesh, 4 processes
FOUR = 4
VAL_FOUR = (
    13  # evaluation batches of 3: rank 0 has 4 samples (2 batches), the others 3 (1): stand-in forwards
)
MESHES: dict[str, dict[str, Any]] = {
    "hsdp 2x2": dict(mode="fsdp", dp_replicate=2),
    "fsdp 1x4": dict(mode="fsdp", dp_replicate=1),
    "ddp 4": dict(mode="ddp"),
}
RUNS_AT_FOUR: dict[str, dict[str, Any]] = {
    "plain": dict(batch_size=4),
    "accum+clip+ema": dict(batch_size=2, grad_accum_steps=2, clip_grad_norm=0.05, ema_decay=0.5),
    "accum sharded": dict(batch_size=2, grad_accum_steps=2, fsdp_accumulate="sharded"),  # hsdp only
}
# Shapes a checkpoint moves between: (replicate, shard) under fsdp, ddp, one device.
SHAPES: dict[str, dict[str, Any]] = {
    "2x2": dict(multi_gpu="fsdp", dp_replicate=2, dp_shard=2),
    "1x4": dict(multi_gpu="fsdp", dp_replicate=1),
    "4x1": dict(multi_gpu="fsdp", dp_replicate=4, dp_shard=-1),
    "1x2": dict(multi_gpu="fsdp", dp_shard=2),
    "ddp": dict(multi_gpu="ddp"),
    "one": dict(multi_gpu="none"),
}
STEPS_EVERY = 16  # samples per optimizer step at any world size: 8 steps of the 128 samples


class SigtermAt:
    """A callback: SIGTERM to this process after optimizer step `step` on rank `rank`, as a preemption sends it."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, trainer: MultiGPUTrainer) -> None:
        if trainer.progress.global_step == self.step and trainer.runtime.rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def resumable(
    rank: int,
    world_size: int,
    save_dir: Path,
    shape: str,
    resume: str | None = None,
    checkpoint_format: str = "sharded",
    callbacks: tuple = (),
) -> dict[str, Any]:
    """8 AdamW steps (2 of warm-up, then cosine) at `shape`, a step checkpoint every 2 (in `save_dir`, every rank
    the same): each step's (loss, lr) this rank trained, the final weights and fit's summary."""
    recorder = StepRecorder(record_start=False)
    config = config_for(
        save_dir,
        world_size,
        **SHAPES[shape],
        batch_size=STEPS_EVERY // world_size,
        epochs=1,
        warmup_epochs=0.25,
        save_every_steps=2,
        keep_last=5,
        checkpoint_format=checkpoint_format,
        resume=resume,
        log_every=100,
    )
    with MultiGPUTrainer(
        tiny_model(), blobs(128, 0), None, config, loss_fn=recorder, callbacks=[recorder, *callbacks]
    ) as trainer:
        recorder.trainer = trainer
        summary = trainer.fit()
        return {"steps": recorder.steps, "final": full_weights(trainer), "summary": summary}


def step_checkpoint(run: Path, step: int, suffix: str = "") -> str:
    return str(run / "ckpt" / f"step-{step:09d}{suffix}")


def _four(rank: int, world_size: int, tmp_path: Path, from_one: str, from_1x2: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, settings in RUNS_AT_FOUR.items():
        for mesh, flags in MESHES.items():
            if name == "accum sharded" and mesh != "hsdp 2x2":
                continue
            results[f"{mesh}/{name}"] = train(
                tmp_path / f"rank{rank}" / mesh / name,
                world_size,
                **flags,
                val_size=VAL_FOUR,
                eval_batch_size=3,
                predict_batch=3,
                count=mesh == "hsdp 2x2",
                **settings,
            )
    # Saved at 2x2 and resumed at the other shapes of 4 processes (ddp writes one-file .pt checkpoints), and from
    # their step 6 back at 2x2; from one device's .pt and from 1x2's folder at 2x2.
    results["2x2"] = resumable(rank, world_size, tmp_path / "2x2", "2x2")
    for shape in ("1x4", "4x1", "ddp"):
        file = shape == "ddp"
        results[f"2x2 -> {shape}"] = resumable(
            rank,
            world_size,
            tmp_path / shape,
            shape,
            step_checkpoint(tmp_path / "2x2", 4),
            "file" if file else "sharded",
        )
        results[f"{shape} -> 2x2"] = resumable(
            rank,
            world_size,
            tmp_path / f"{shape} back",
            "2x2",
            step_checkpoint(tmp_path / shape, 6, ".pt" if file else ""),
        )
    results["one .pt -> 2x2"] = resumable(rank, world_size, tmp_path / "one back", "2x2", from_one)
    results["1x2 -> 2x2"] = resumable(rank, world_size, tmp_path / "1x2 back", "2x2", from_1x2)
    # A SIGTERM on rank 3 after step 3: every rank stops at the next sync point (step 4) with a checkpoint, and
    # the same run with --resume auto continues.
    results["stopped"] = resumable(
        rank, world_size, tmp_path / "stopped", "2x2", callbacks=(SigtermAt(3, 3),)
    )
    results["stopped -> auto"] = resumable(rank, world_size, tmp_path / "stopped", "2x2", "auto")
    results["bf16"] = train(
        tmp_path / f"rank{rank}" / "bf16",
        world_size,
        **MESHES["hsdp 2x2"],
        amp="bf16",
        **RUNS_AT_FOUR["plain"],
    )
    return results


@pytest.fixture(scope="module")
def four_ranks(two_ranks, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """One spawn of 4 gloo processes for everything at 4: equivalence, placements, collective counts, and the
    checkpoints of 2x2 resumed at other shapes and back (one device's .pt made here first, 1x2's by two_ranks)."""
    tmp_path = tmp_path_factory.mktemp("hsdp")
    resumable(0, 1, tmp_path / "one", "one", checkpoint_format="file")
    ranks = run_ranks(
        _four,
        FOUR,
        tmp_path,
        tmp_path,
        step_checkpoint(tmp_path / "one", 4, ".pt"),
        step_checkpoint(two_ranks[1] / "1x2", 4),
    )
    return ranks, tmp_path


@pytest.mark.slow
def test_hsdp_places_parameters_replicated_over_replicas_and_sharded_within_each(four_ranks):
    ranks, _ = four_ranks
    for rank, results in enumerate(ranks):
        replica, shard = divmod(rank, 2)
        assert results["hsdp 2x2/plain"]["position"] == (replica, shard)
        assert results["hsdp 2x2/plain"]["meshes"] == {
            ("(Replicate(), Shard(dim=0))", ("dp_replicate", "dp_shard"), (2, 2), (replica, shard))
        }
        assert results["fsdp 1x4/plain"]["meshes"] == {
            ("(Shard(dim=0),)", ("dp",), (4,), (rank,))
        }  # as before
        assert (
            len(results["hsdp 2x2/plain"]["summary"]["peak_memory_per_rank_gb"]) == FOUR
        )  # telemetry: each rank


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS_AT_FOUR)
def test_hsdp_equals_fsdp_ddp_and_one_process_with_the_whole_batch(four_ranks, tmp_path, name):
    results = four_ranks[0][0]
    single = one_process(
        tmp_path,
        world=FOUR,
        val_size=VAL_FOUR,
        eval_batch_size=3 * FOUR,
        predict_batch=3 * FOUR,
        **{key: value for key, value in RUNS_AT_FOUR[name].items() if key != "fsdp_accumulate"},
    )
    assert max_difference(single["weights"], tiny_model().state_dict()) > 1e-3  # training moved the weights
    for mesh in MESHES:
        other = results.get(f"{mesh}/{name}")
        if other is None:
            continue
        assert other["steps"] == single["steps"] == 5
        assert max_difference(other["weights"], single["weights"]) <= TOLERANCE, mesh
        assert other["eval"]["count"] == VAL_FOUR
        assert abs(other["eval"]["loss"] - single["eval"]["loss"]) <= TOLERANCE, mesh
        assert (other["predict"] - single["predict"]).abs().max().item() <= TOLERANCE, mesh
        if single["ema"] is not None:
            assert max_difference(other["ema"], single["ema"]) <= TOLERANCE, mesh


def per_group(step: dict) -> dict[str, dict[str, tuple[int, int]]]:
    """A step's tally as {group: {operation: (calls, bytes)}}."""
    groups: dict[str, dict[str, tuple[int, int]]] = {}
    for (group, operation), (calls, moved, _) in step.items():
        groups.setdefault(group, {})[operation] = (calls, moved)
    return groups


@pytest.mark.slow
def test_accumulation_talks_across_replicas_once_per_optimizer_step(four_ranks):
    """Per optimizer step on every rank, at 2x2 with two FSDP units (tiny_model's two Linear layers): the replica
    group carries one all-reduce of each unit's gradient shard, with or without --grad-accum-steps 2; the inner
    micro-step reduce-scatters within the shard group only with --fsdp-accumulate sharded."""
    for results in four_ranks[0]:
        plain, whole, sharded = (
            results[f"hsdp 2x2/{name}"]["collectives"]
            for name in ("plain", "accum+clip+ema", "accum sharded")
        )
        assert len(plain) == len(whole) == len(sharded) == 5
        replica = per_group(plain[0])["dp_replicate"]
        assert replica == {"all_reduce": (2, replica["all_reduce"][1])}
        for steps, reduce_scatters, gathers in ((plain, 2, 4), (whole, 2, 8), (sharded, 4, 8)):
            for step in steps:
                groups = per_group(step)
                assert set(groups) <= {"dp_replicate", "dp_shard", "world"}  # world: the logging sync points
                assert groups["dp_replicate"] == replica  # the same calls and bytes whatever the accumulation
                assert groups["dp_shard"]["reduce_scatter_single"][0] == reduce_scatters
            # Forward and backward gather each unit once per micro-step (the first step also gathers at start).
            assert [per_group(step)["dp_shard"]["all_gather_single"][0] for step in steps[1:]] == [
                gathers
            ] * 4
        assert (
            per_group(whole[1])["dp_shard"]["all_reduce"][0] == 1
        )  # clipping's norm: within the shard group


@pytest.mark.slow
def test_on_the_mesh_a_sigterm_saves_and_resume_auto_continues_and_bf16_computes_through_fsdps_policy(
    four_ranks,
):
    ranks = four_ranks[0]
    assert [rank["stopped"]["summary"]["global_step"] for rank in ranks] == [4] * FOUR
    assert all(rank["stopped"]["summary"]["stopped"] for rank in ranks)
    assert_continues([rank["stopped -> auto"] for rank in ranks], [rank["2x2"] for rank in ranks], 4)
    assert all(
        rank["bf16"]["dtypes"] == {torch.bfloat16} for rank in ranks
    )  # bf16 compute (FSDP's policy) ...
    bf16, fp32 = ranks[0]["bf16"]["weights"], ranks[0]["hsdp 2x2/plain"]["weights"]  # whole on rank 0
    assert {tensor.dtype for tensor in bf16.values()} == {torch.float32}  # ... on fp32 master weights
    assert max_difference(bf16, fp32) < 0.5 * max_difference(
        fp32, tiny_model().state_dict()
    )  # fp32's learning


RESUMED = {
    "2x2 -> 1x4": 4,
    "2x2 -> 4x1": 4,
    "2x2 -> ddp": 4,
    "1x4 -> 2x2": 6,
    "4x1 -> 2x2": 6,
    "ddp -> 2x2": 6,
    "one .pt -> 2x2": 4,
    "1x2 -> 2x2": 4,
}


def assert_continues(resumed: list[dict[str, Any]], reference: list[dict[str, Any]], after: int) -> None:
    """The resumed run's steps are the uninterrupted run's from step `after` + 1 on: the same LR, the same loss
    (the next step's loss proves the model and the data position, the later ones the optimizer state), and
    the same final weights."""
    expected, steps = global_steps(reference)[after:], global_steps(resumed)
    assert len(steps) == 8 - after
    assert [lr for _, lr in steps] == pytest.approx([lr for _, lr in expected], rel=1e-9)
    assert [loss for loss, _ in steps] == pytest.approx([loss for loss, _ in expected], abs=1e-5)
    assert max_difference(resumed[0]["final"], reference[0]["final"]) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("moved", RESUMED)
def test_a_checkpoint_moves_between_mesh_shapes_ddp_and_one_device(four_ranks, moved):
    ranks = four_ranks[0]
    assert_continues([rank[moved] for rank in ranks], [rank["2x2"] for rank in ranks], RESUMED[moved])


@pytest.mark.slow
def test_a_2x2_checkpoint_resumes_at_1x2_and_in_one_process(four_ranks, tmp_path):
    ranks, saved = four_ranks
    reference = [rank["2x2"] for rank in ranks]
    step_4 = step_checkpoint(saved / "2x2", 4)
    assert_continues(run_ranks(resumable, 2, tmp_path, tmp_path / "1x2", "1x2", step_4), reference, 4)
    assert_continues([resumable(0, 1, tmp_path / "one", "one", step_4)], reference, 4)


def _compiled_on_a_mesh(rank: int, world_size: int, tmp_path: Path) -> dict[bool, dict[str, Any]]:
    runs = {}
    for compiled in (False, True):
        config = config_for(
            tmp_path / str(compiled),
            world_size,
            multi_gpu="fsdp",
            dp_replicate=2,
            optimizer="adamw",
            lr=3e-3,
            epochs=1,
            lr_schedule="constant",
            compile=compiled,
            **RUNS["accum+clip+ema"],
        )
        with MultiGPUTrainer(tiny_model(), blobs(SIZE, 0), blobs(VAL_SIZE, 1), config) as trainer:
            trainer.fit()
            runs[compiled] = {
                "weights": full_weights(trainer),
                "eval": trainer.evaluate(),
                "compiled": getattr(trainer.model, "_compiled_call_impl", None) is not None,
                "mesh": trainer.runtime.mesh_position,
            }
    return runs


@pytest.mark.slow
@needs_compiler
def test_compile_on_a_hybrid_mesh_trains_as_the_uncompiled_mesh(tmp_path):
    """--compile on a 2 x 1 mesh (2 gloo processes, the 2-D mesh's code path): the module compiled in place before
    sharding, 5 AdamW steps with accumulation, clipping and an EMA land within 1e-5 of the uncompiled mesh's."""
    ranks = run_ranks(_compiled_on_a_mesh, 2, tmp_path, tmp_path)
    for rank in ranks:
        assert rank[True]["compiled"] and not rank[False]["compiled"]
    assert max_difference(ranks[0][True]["weights"], ranks[0][False]["weights"]) <= TOLERANCE
    assert ranks[0][True]["eval"]["loss"] == pytest.approx(ranks[0][False]["eval"]["loss"], abs=TOLERANCE)
