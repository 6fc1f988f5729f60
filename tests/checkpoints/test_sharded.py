"""Sharded checkpoints (multigpu/checkpoints/sharded.py, --checkpoint-format sharded): every rank writes its shards
into a folder renamed into place when complete; it resumes at another number of processes, from and into one-file
checkpoints, after a kill in an async save; export and prediction read it; a folder that would run code, is
damaged or belongs to another model is refused in one line by each of them."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import main_multi_gpu
import predict_multi_gpu
from conftest import (
    DIST_TIMEOUT,
    TINY,
    TINY_GPT,
    StepRecorder,
    assert_ok,
    blobs,
    config_for,
    contents,
    global_steps,
    run_cli,
    run_cli_ranks,
    run_ranks,
    tiny_model,
    tiny_text,
)
from multigpu.checkpoints import checkpoint, export, run_folders, sharded
from multigpu.checkpoints.stateful import ModelState
from multigpu.config import parse_config
from multigpu.errors import UsageError
from multigpu.resilience.faults import FAULT_ENV
from train_multi_gpu import MultiGPUTrainer

EFFECTIVE_BATCH = 24  # 1, 2 and 3 processes each take an equal share of every step's samples


def _train(rank: int, world_size: int, save_dir: Path, resume: str | None, checkpoint_format: str) -> dict:
    """2 epochs of 96 samples, EFFECTIVE_BATCH per step (4 steps an epoch), a step checkpoint every 4 steps."""
    recorder = StepRecorder()
    config = config_for(
        save_dir,
        world_size,
        batch_size=EFFECTIVE_BATCH // world_size,
        epochs=2,
        warmup_epochs=0.5,
        save_every_steps=4,
        keep_last=5,
        checkpoint_format=checkpoint_format,
        resume=resume,
    )
    with MultiGPUTrainer(
        tiny_model(), blobs(96, 0), None, config, loss_fn=recorder, callbacks=[recorder]
    ) as trainer:
        recorder.trainer = trainer
        trainer.fit()
        final = ModelState(trainer.model).state_dict()
    return {"steps": recorder.steps, "started": recorder.started, "final": final}


@pytest.mark.slow
def test_a_folder_saved_at_2_processes_resumes_at_1_and_at_3_as_if_uninterrupted(tmp_path):
    reference = run_ranks(_train, 2, tmp_path, tmp_path / "reference", None, "sharded")
    saved = tmp_path / "reference" / "ckpt" / "step-000000004"
    whole = sharded.load_whole(str(saved))
    assert sorted(p.name for p in saved.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        checkpoint.STATE_FILE,
    ]  # both ranks wrote shards
    expected = global_steps(reference)[4:]  # steps 5 to 8
    for world_size in (1, 3):
        resumed = run_ranks(
            _train, world_size, tmp_path, tmp_path / f"at-{world_size}", str(saved), "sharded"
        )
        started = resumed[0]["started"]
        assert started["step"] == 4
        for name, tensor in whole["model"].items():  # the full state, bit for bit
            assert torch.equal(started["model"][name], tensor), (world_size, name)
        for name, slots in whole["optimizer"]["state"].items():
            for slot, tensor in slots.items():
                assert torch.equal(started["optimizer"][name][slot], tensor), (world_size, name, slot)
        steps = global_steps(resumed)
        assert len(steps) == 4 and [lr for _, lr in steps] == pytest.approx(
            [lr for _, lr in expected], rel=1e-9
        )
        assert [loss for loss, _ in steps] == pytest.approx([loss for loss, _ in expected], abs=1e-5)
        for name, tensor in reference[0]["final"].items():
            torch.testing.assert_close(resumed[0]["final"][name], tensor, atol=1e-5, rtol=0)


def _in_process(save_dir: Path, epochs: int, checkpoint_format: str) -> MultiGPUTrainer:
    # A constant LR: a schedule's length would change with the epochs asked for.
    config = config_for(
        save_dir,
        1,
        epochs=epochs,
        checkpoint_format=checkpoint_format,
        resume="auto",
        save_dir=str(save_dir),
        lr_schedule="constant",
    )
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(32, 1), config)
    trainer.fit()
    trainer.close()
    return trainer


def test_a_file_resumes_into_a_folder_and_back_bit_exactly(tmp_path, capsys):
    _in_process(tmp_path / "whole", 3, "file")
    for epochs, checkpoint_format in ((1, "file"), (2, "sharded"), (3, "file")):
        _in_process(tmp_path / "chain", epochs, checkpoint_format)
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'chain' / 'last.pt'}: epoch 2" in out
    assert f"resumed from {tmp_path / 'chain' / 'last'}: epoch 3" in out  # the folder, newer than last.pt
    ours, theirs = (checkpoint.load(str(tmp_path / run / "last.pt")) for run in ("chain", "whole"))
    assert (ours["scheduler"], ours["global_step"]) == (theirs["scheduler"], theirs["global_step"])
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    for index, slots in theirs["optimizer"]["state"].items():
        for slot, tensor in slots.items():
            assert torch.equal(ours["optimizer"]["state"][index][slot], tensor), (index, slot)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """The save-dir of one CLI epoch (an MLP on synthetic data) with sharded checkpoints."""
    save_dir = tmp_path_factory.mktemp("sharded") / "run"
    assert (
        main_multi_gpu.main(
            [
                *TINY,
                "--epochs",
                "1",
                "--mode",
                "flatten",
                "--checkpoint-format",
                "sharded",
                "--save-dir",
                str(save_dir),
            ]
        )
        == 0
    )
    return save_dir


def test_a_half_written_folder_is_skipped_by_resume_auto_and_refused_when_named(
    sharded_run, tmp_path, capsys
):
    save_dir = tmp_path / "run"
    shutil.copytree(sharded_run, save_dir)
    shutil.copytree(save_dir / "last", save_dir / "step-000000099")
    (save_dir / "step-000000099" / ".metadata").unlink()  # its shards written, never completed
    shutil.copytree(save_dir / "last", save_dir / "last.tmp")  # a save killed before its rename
    capsys.readouterr()
    named = main_multi_gpu.main(
        [
            *TINY,
            "--epochs",
            "2",
            "--mode",
            "flatten",
            "--checkpoint-format",
            "sharded",
            "--save-dir",
            str(save_dir),
            "--resume",
            str(save_dir / "step-000000099"),
        ]
    )
    first = capsys.readouterr()
    assert "removed 1 unfinished save(s) of a killed run: last.tmp" in first.out  # at the start of any resume
    err = first.err
    assert (
        named == 2
        and err.count("\n") == 1
        and err
        == (
            f"error: checkpoint {save_dir / 'step-000000099'} refused: an incomplete sharded checkpoint (no .metadata: "
            f"its save did not finish)\n"
        )
    )
    assert (
        main_multi_gpu.main(
            [
                *TINY,
                "--epochs",
                "2",
                "--mode",
                "flatten",
                "--checkpoint-format",
                "sharded",
                "--save-dir",
                str(save_dir),
                "--resume",
                "auto",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"checkpoint {save_dir / 'step-000000099'} refused: an incomplete sharded checkpoint" in out
    assert f"resumed from {save_dir / 'last'}: epoch 2" in out
    assert checkpoint.load(str(save_dir / "last"))["epoch"] == 2 and not (save_dir / "last.tmp").exists()


def test_export_gives_a_weights_only_file_that_predicts_as_the_folder_does(sharded_run, tmp_path, capsys):
    out = tmp_path / "weights.pt"
    assert export.main([str(sharded_run / "best"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    whole = sharded.load_whole(str(sharded_run / "best"))
    assert state["model"].keys() == whole["model"].keys() and state["epoch"] == 1
    for source, output in (
        (sharded_run / "best", tmp_path / "from-folder.pt"),
        (out, tmp_path / "from-file.pt"),
    ):
        assert predict_multi_gpu.main(["--checkpoint", str(source), "--output", str(output)]) == 0
    torch.testing.assert_close(
        torch.load(tmp_path / "from-folder.pt", weights_only=True),
        torch.load(tmp_path / "from-file.pt", weights_only=True),
        atol=0,
        rtol=0,
    )
    assert export.main([str(sharded_run), str(tmp_path / "x.pt")]) == 2
    assert capsys.readouterr().err.endswith(
        "is not a sharded checkpoint folder (last/, best/, step-N/ of a run "
        "with --checkpoint-format sharded): name one\n"
    )


@pytest.mark.slow
def test_an_async_save_killed_mid_write_leaves_the_previous_checkpoint_to_resume(tmp_path):
    save_dir = tmp_path / "run"
    args = [
        *TINY,
        "--epochs",
        "1",
        "--checkpoint-format",
        "sharded",
        "--async-checkpoint",
        "--save-every-steps",
        "2",
        "--save-dir",
        str(save_dir),
    ]
    killed = run_cli(args, nproc=2, env={FAULT_ENV: "0:4:save"})  # rank 0 dies writing step 4's shards
    assert killed.returncode != 0
    assert (
        f"checkpoint {save_dir / 'step-000000002'}/ being written in the background: training blocked"
        in killed.stdout
    )
    assert (save_dir / "step-000000004.tmp").is_dir() and not (save_dir / "step-000000004").exists()
    resumed = run_cli([*args, "--resume", "auto"])
    assert_ok(resumed)
    assert "removed 1 unfinished save(s) of a killed run: step-000000004.tmp" in resumed.stdout
    assert f"resumed from {save_dir / 'step-000000002'}: epoch 1, step 2" in resumed.stdout
    assert checkpoint.load(str(save_dir / "last"))["epoch"] == 1


def test_resume_auto_without_a_save_dir_finds_a_run_of_sharded_folders(sharded_run, tmp_path):
    shutil.copytree(sharded_run, tmp_path / "run-1")
    args = [*TINY, "--epochs", "2", "--mode", "flatten", "--checkpoint-format", "sharded"]
    assert run_folders.run_to_continue(str(tmp_path), parse_config(args))[0] == str(tmp_path / "run-1")
    with pytest.raises(UsageError, match="differs in mode: flatten -> image"):
        run_folders.run_to_continue(
            str(tmp_path), parse_config([*args[:-4], "--checkpoint-format", "sharded"])
        )


def test_what_dcp_writes_of_every_dtype_and_plain_value_reads_back_through_the_checks(tmp_path):
    """The restricted unpickler admits DCP's metadata as torch writes it: a guard against a list too short."""
    import torch.distributed.checkpoint as dcp

    tensors = {
        str(dtype): torch.arange(6).reshape(2, 3).to(dtype)
        for dtype in (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.float8_e4m3fn,
            torch.complex64,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint8,
            torch.bool,
        )
    }
    values = {"lr": 0.1, "betas": (0.9, 0.99), "params": ["net.0.weight"], "foreach": None, "amsgrad": False}
    dcp.save({"model": tensors, "optimizer": values}, checkpoint_id=str(tmp_path), no_dist=True)
    torch.save(
        {
            "format_version": checkpoint.FORMAT_VERSION,
            "scheduler": {},
            "scaler": {},
            "epoch": 0,
            "global_step": 0,
            "config": {},
        },
        tmp_path / checkpoint.STATE_FILE,
    )
    whole = sharded.load_whole(str(tmp_path))
    assert whole["optimizer"] == values and whole["model"].keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert whole["model"][name].dtype == tensor.dtype and torch.equal(
            whole["model"][name].view(torch.uint8), tensor.view(torch.uint8)
        ), name


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """The save-dir of one epoch of --model gpt trained by 2 ranks under --multi-gpu fsdp (sharded folders last/,
    best/, step-000000004/ and step-000000008/, each with __0_0.distcp and __1_0.distcp), and its command but
    --save-dir."""
    root = tmp_path_factory.mktemp("fsdp")
    args = [
        *TINY_GPT,
        "--data-file",
        str(tiny_text(root / "tiny.txt")),
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--no-progress",
        "--dist-timeout",
        str(DIST_TIMEOUT),
        "--multi-gpu",
        "fsdp",
        "--save-every-steps",
        "4",
    ]
    assert_ok(run_cli([*args, "--save-dir", str(root / "run")], nproc=2))
    return root / "run", args


def _copy(fsdp_run: tuple[Path, list[str]], tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the fsdp run's save-dir (files of its own, no hard links) and the command that resumes it."""
    save_dir = tmp_path / "run"
    shutil.copytree(fsdp_run[0], save_dir)
    return save_dir, [*fsdp_run[1], "--save-dir", str(save_dir), "--resume", "auto"]


class _RunsCode:
    """What a hostile pickle holds: loading it calls os.system, which creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_folder_that_would_run_code_is_refused_by_resume_predict_and_export_and_nothing_runs(
    fsdp_run, tmp_path, capsys
):
    save_dir, resume = _copy(fsdp_run, tmp_path)
    shutil.rmtree(save_dir / "step-000000004")
    # step-8: DCP's metadata as it is, but one value of the optimizer's (not a tensor: read back by unpickling)
    # in a shard file of its own that runs code; last/, newer: its .metadata runs code.
    values, step_8 = tmp_path / "values-ran", save_dir / "step-000000008"
    payload = io.BytesIO()
    torch.save(_RunsCode(values), payload)
    (step_8 / "__2_0.distcp").write_bytes(payload.getvalue())
    metadata = pickle.loads((step_8 / ".metadata").read_bytes())  # our own file
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata.storage_data[MetadataIndex("optimizer.param_groups.0.lr")] = _StorageInfo(
        "__2_0.distcp", 0, len(payload.getvalue())
    )
    (step_8 / ".metadata").write_bytes(pickle.dumps(metadata))
    ran = tmp_path / "metadata-ran"
    (save_dir / "last" / ".metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
    os.utime(step_8 / ".metadata", (1, 1))  # older than last/: the search meets last/ first
    before = contents(save_dir)
    runs_code = (
        f"error: checkpoint {save_dir / 'last'} refused: its .metadata names posix.system, which DCP's "
        f"metadata never holds and loading would call; nothing in it was run\n"
    )
    predicted = predict_multi_gpu.main(
        ["--checkpoint", str(save_dir / "last"), "--output", str(tmp_path / "p.pt")]
    )
    assert not ran.exists() and predicted == 2
    assert capsys.readouterr().err == runs_code
    assert export.main([str(save_dir / "last"), str(tmp_path / "e.pt")]) == 2
    assert capsys.readouterr().err == runs_code
    value_runs_code = (
        f"error: checkpoint {step_8} refused: its value optimizer.param_groups.0.lr (in a shard file): "
        f"it holds something other than tensors and plain data"
    )
    exported = export.main([str(step_8), str(tmp_path / "e.pt")])
    assert not values.exists() and exported == 2
    assert _one_error_line(capsys.readouterr().err).startswith(value_runs_code)
    ranks = run_cli_ranks(resume, 2)
    assert not ran.exists() and not values.exists()
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr for rank in ranks]
    assert f"{runs_code[len('error: ') : -1]}; trying an older one" in ranks[0].stdout
    assert _one_error_line(ranks[0].stderr).startswith(value_runs_code) and ranks[1].stderr == ""
    assert (
        contents(save_dir) == before and not (tmp_path / "p.pt").exists() and not (tmp_path / "e.pt").exists()
    )


@pytest.mark.slow
def test_a_damaged_folder_is_refused_in_one_line_naming_its_file_by_resume_predict_and_export(
    fsdp_run, tmp_path, capsys
):
    save_dir, resume = _copy(fsdp_run, tmp_path)
    last, step_8, step_4 = (save_dir / name for name in ("last", "step-000000008", "step-000000004"))
    (last / "__1_0.distcp").unlink()
    cut = step_8 / "__1_0.distcp"
    whole = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[: whole // 2])
    (step_4 / ".metadata").write_bytes(bytes(range(256)) * 4)
    before = contents(save_dir)
    reasons = {
        last: f"checkpoint {last} refused: its shard file __1_0.distcp is missing",
        step_8: f"checkpoint {step_8} refused: its shard file __1_0.distcp is cut short ({whole // 2} bytes of "
        f"the {whole} its .metadata names)",
        step_4: f"checkpoint {step_4} refused: its .metadata is not DCP's metadata, truncated or corrupt "
        f"(UnpicklingError: invalid load key, '\\x00'.)",
    }
    for folder, reason in reasons.items():
        assert predict_multi_gpu.main(["--checkpoint", str(folder), "--output", str(tmp_path / "p.pt")]) == 2
        assert capsys.readouterr().err == f"error: {reason}\n"
        assert export.main([str(folder), str(tmp_path / "e.pt")]) == 2
        assert capsys.readouterr().err == f"error: {reason}\n"
    ranks = run_cli_ranks(resume, 2)
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr for rank in ranks]
    err = _one_error_line(ranks[0].stderr)
    assert err.startswith(f"error: --resume auto found no usable checkpoint in {save_dir}: ")
    assert all(reason in err for reason in reasons.values()) and ranks[1].stderr == ""
    assert contents(save_dir) == before


def test_a_folder_of_another_model_width_is_refused_in_one_line_naming_the_parameter(fsdp_run, tmp_path):
    save_dir, resume = _copy(fsdp_run, tmp_path)
    before = contents(save_dir)
    narrower = [*resume[: resume.index("--n-embd") + 1], "16", *resume[resume.index("--n-embd") + 2 :]]
    ranks = run_cli_ranks(narrower, 2)
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr for rank in ranks]
    vocabulary = len(set((fsdp_run[0].parent / "tiny.txt").read_text()))
    assert _one_error_line(ranks[0].stderr).startswith(
        f"error: checkpoint {save_dir / 'last'} does not fit this model/optimizer: model.token_embedding.weight is "
        f"[{vocabulary}, 32] in it, [{vocabulary}, 16] here ("
    )
    assert ranks[1].stderr == "" and contents(save_dir) == before


def test_init_from_a_folder_that_would_run_code_is_refused_in_one_line_and_nothing_runs(
    fsdp_run, tmp_path, capsys
):
    """--init-from reads a sharded folder through the same restricted unpickler as a resume."""
    save_dir, _ = _copy(fsdp_run, tmp_path)
    ran = tmp_path / "metadata-ran"
    (save_dir / "last" / ".metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
    started = main_multi_gpu.main(
        [*fsdp_run[1], "--save-dir", str(tmp_path / "fresh"), "--init-from", str(save_dir / "last")]
    )
    assert not ran.exists() and started == 2
    assert _one_error_line(capsys.readouterr().err).endswith(
        "its .metadata names posix.system, which DCP's metadata never holds and loading would call; nothing in it "
        "was run\n"
    )
