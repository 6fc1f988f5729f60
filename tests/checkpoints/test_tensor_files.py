"""--checkpoint-format safetensors (multigpu/checkpoints/tensor_files.py): a checkpoint without pickle, one
safetensors file with the trainer state as JSON in its header; killed after a step and inside a save (written, not
renamed), it resumes to the same weights bit for bit as an uninterrupted run, and predicts like a .pt; every type a
checkpoint holds survives the round trip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import predict_multi_gpu
from conftest import TINY, assert_ok, run_cli
from multigpu.checkpoints import checkpoint, run_settings, tensor_files
from multigpu.resilience.faults import FAULT_ENV

safetensors = pytest.importorskip("safetensors.torch", reason="the [hf] extra (safetensors) is not installed")

# 8 steps an epoch, 2 epochs; a step checkpoint every 5 steps.
ARGS = [
    *TINY,
    "--train-size",
    "256",
    "--val-size",
    "64",
    "--mode",
    "flatten",
    "--model",
    "mlp",
    "--image-shape",
    "1,8,8",
    "--epochs",
    "2",
    "--log-every",
    "1",
    "--save-every-steps",
    "5",
    "--keep-last",
    "2",
    "--checkpoint-format",
    "safetensors",
]


def run(save_dir: Path, *extra: str, fault: str = ""):
    return run_cli([*ARGS, "--save-dir", str(save_dir), *extra], env={FAULT_ENV: fault} if fault else None)


@pytest.mark.slow
def test_killed_after_a_step_and_inside_a_save_it_resumes_bit_identically_and_predicts(tmp_path):
    assert_ok(run(tmp_path / "reference"))
    save_dir = tmp_path / "run"
    assert run(save_dir, fault="0:7").returncode != 0  # SIGKILL after step 7: step 5 is the newest checkpoint
    assert sorted(p.name for p in save_dir.glob("*.safetensors")) == ["step-000000005.safetensors"]
    killed_in_save = run(save_dir, "--resume", "auto", fault="0:10:save")  # written, killed before the rename
    assert killed_in_save.returncode != 0, killed_in_save.stderr
    assert f"resumed from {save_dir / 'step-000000005.safetensors'}" in killed_in_save.stdout
    assert not (save_dir / "step-000000010.safetensors").exists() and list(
        save_dir.glob("*.safetensors.*.tmp")
    )
    finished = run(save_dir, "--resume", "auto")
    assert_ok(finished)
    assert "removed 1 unfinished save(s) of a killed run: step-000000010.safetensors." in finished.stdout
    assert not list(save_dir.glob("*.pt"))  # no pickle anywhere
    ours, theirs = (
        checkpoint.load(str(path / "last.safetensors")) for path in (save_dir, tmp_path / "reference")
    )
    assert ours["global_step"] == theirs["global_step"] == 16 and ours["scheduler"] == theirs["scheduler"]
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    for index, slots in theirs["optimizer"]["state"].items():
        for slot, tensor in slots.items():
            assert torch.equal(ours["optimizer"]["state"][index][slot], tensor), (index, slot)
    # The file is safetensors through and through: its own reader takes it, the state is JSON in the header.
    stored = safetensors.load_file(str(save_dir / "last.safetensors"))
    assert torch.equal(stored["/model/net.1.weight"], theirs["model"]["net.1.weight"])
    # What --resume auto without --save-dir (and the launcher) read, torch-free: the config in the header.
    assert run_settings.saved_settings(str(save_dir / "last.safetensors"))["save_dir"] == str(save_dir)
    outputs = {}
    for name in ("last.safetensors", "best.safetensors"):
        out = tmp_path / f"{name}.pt"
        assert predict_multi_gpu.main(["--checkpoint", str(save_dir / name), "--output", str(out)]) == 0
        outputs[name] = torch.load(out, weights_only=True)
    assert outputs["last.safetensors"].shape == (64, 10)


def test_every_kind_of_value_a_checkpoint_holds_survives_the_round_trip(tmp_path):
    shared = torch.arange(6.0)
    state = {
        "format_version": 2,
        "model": {"embed.weight": shared, "head.weight": shared, "count": torch.tensor(3)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(2, 3)[:, 1]}},
            "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": 1e-3}],
        },
        "rng": [{"torch": torch.zeros(5, dtype=torch.uint8), "cuda": None, "python": [3, [1, 2], None]}],
        "best_value": math.inf,
        "nan": math.nan,
        "flag": True,
        "name": "__tensor__",
        "empty": {},
        "__odd": {"__key": 1},
    }
    path = str(tmp_path / "state.safetensors")
    tensor_files.save_state(state, path)
    loaded = tensor_files.load_state(path)
    assert loaded["model"]["embed.weight"] is loaded["model"]["head.weight"]  # tied: stored once, one tensor
    assert (
        torch.equal(loaded["model"]["embed.weight"], shared) and loaded["model"]["count"].dtype == torch.int64
    )
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(2))  # a view, copied
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert type(loaded["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert loaded["rng"][0]["python"] == [3, [1, 2], None] and loaded["best_value"] == math.inf
    assert math.isnan(loaded["nan"]) and (loaded["flag"], loaded["name"], loaded["empty"]) == (
        True,
        "__tensor__",
        {},
    )
    assert loaded["__odd"] == {"__key": 1}


def test_a_weights_file_or_a_cut_short_one_is_refused_as_a_checkpoint_in_one_line(tmp_path):
    weights_only = tmp_path / "weights.safetensors"
    tensor_files.save({"w": torch.ones(2)}, str(weights_only))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"^checkpoint .*weights.safetensors refused: it holds "
        r"weights only, no trainer state: start from them with "
        r"--init-from$",
    ):
        checkpoint.load(str(weights_only))
    cut = tmp_path / "last.safetensors"
    tensor_files.save_state({"model": {"w": torch.ones(1000)}}, str(cut))
    cut.write_bytes(cut.read_bytes()[:-100])
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"^checkpoint .*last.safetensors refused: truncated or "
        r"corrupt \(",
    ):
        checkpoint.load(str(cut))


def test_a_checkpoint_whose_header_length_begins_with_the_pickle_mark_loads(tmp_path):
    """A safetensors file begins with its header's length: 0x80 as its first byte is also pickle's mark."""
    path = tmp_path / "last.safetensors"
    for padding in range(256):
        state = {name: 0 for name in checkpoint.REQUIRED_KEYS} | {"format_version": 2, "pad": "x" * padding}
        tensor_files.save_state(state, str(path))
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80 and checkpoint.load(str(path))["pad"] == "x" * padding
