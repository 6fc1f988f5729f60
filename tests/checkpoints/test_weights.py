"""--init-from and --init-strict (multigpu/checkpoints/weights.py) from the command line: a run starts from another
run's exported weights (not a resume: fresh optimizer, schedule and progress), a resumed run keeps its own; weights
of another shape are refused in one line, or with --init-strict false loaded where they fit with one line per kind
of misfit; a path that does not exist, holds no weights or holds pickled code is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import main_multi_gpu
from conftest import TINY
from multigpu.checkpoints import checkpoint

pytest.importorskip("safetensors", reason="the [hf] extra (safetensors) is not installed")

MLP = [
    *TINY,
    "--train-size",
    "64",
    "--val-size",
    "32",
    "--mode",
    "flatten",
    "--model",
    "mlp",
    "--image-shape",
    "1,4,4",
    "--epochs",
    "1",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step run whose best weights --export-on-end wrote as safetensors."""
    save_dir = tmp_path_factory.mktemp("source") / "run"
    assert (
        main_multi_gpu.main(
            [*MLP, "--save-dir", str(save_dir), "--max-steps", "2", "--export-on-end", "safetensors"]
        )
        == 0
    )
    return save_dir


def test_a_run_starts_from_the_weights_afresh_and_a_resumed_run_keeps_its_own(source, tmp_path, capsys):
    weights_file = source / "best-weights.safetensors"
    args = [
        *MLP,
        "--save-dir",
        str(tmp_path / "run"),
        "--init-from",
        str(weights_file),
        "--seed",
        "1",
        "--lr",
        "1e-12",
        "--max-steps",
        "1",
    ]
    capsys.readouterr()
    assert main_multi_gpu.main(args) == 0
    out = capsys.readouterr().out
    assert (
        f"--init-from {weights_file}: 6 tensors loaded from safetensors (weights only: the optimizer, schedule "
        f"and progress start afresh)\n" in out
    )
    started = checkpoint.load(str(tmp_path / "run" / "last.pt"))
    assert started["global_step"] == 1 and started["optimizer"]["state"][0]["step"].item() == 1  # afresh
    trained = checkpoint.load(str(source / "best.pt"))["model"]
    for name, tensor in trained.items():  # one step at an LR of 1e-12 from the loaded weights
        torch.testing.assert_close(started["model"][name], tensor, rtol=0, atol=1e-9)
    assert main_multi_gpu.main([*args[:-1], "2", "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert (
        f"--init-from {weights_file} not loaded: this run resumed from {tmp_path / 'run' / 'last.pt'}, whose "
        f"weights it continues\n" in out
    )


def test_weights_of_another_shape_are_refused_or_with_init_strict_false_loaded_where_they_fit(
    source, tmp_path, capsys
):
    weights_file = source / "best-weights.safetensors"
    args = [*MLP, "--num-classes", "4", "--max-steps", "1", "--init-from", str(weights_file)]
    capsys.readouterr()
    assert main_multi_gpu.main([*args, "--save-dir", str(tmp_path / "strict")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --init-from {weights_file} does not fit this model: 0 missing key(s) (none), "
        f"0 unexpected (none), 2 of another shape (net.5.weight, net.5.bias); pass --init-strict false "
        f"to load what fits\n"
    )
    assert main_multi_gpu.main([*args, "--save-dir", str(tmp_path / "loose"), "--init-strict", "false"]) == 0
    out = capsys.readouterr().out
    assert f"--init-from {weights_file}: 4 tensors loaded from safetensors" in out
    assert "--init-from: 0 missing key(s), left as initialised: none\n" in out
    assert "--init-from: 0 unexpected key(s), not loaded: none\n" in out
    assert "--init-from: 2 key(s) of another shape, left as initialised: net.5.weight, net.5.bias\n" in out


class Payload:
    """What an attacker pickles: unpickling it would call os.system."""

    def __reduce__(self):  # noqa: D105
        import os

        return os.system, ("echo pwned",)


@pytest.mark.parametrize("kind", ["missing", "text", "pickled code", "folder"])
def test_a_path_without_weights_is_one_line_and_exit_2(tmp_path, capfd, kind):
    path = (
        tmp_path
        / {
            "missing": "nothing.safetensors",
            "text": "notes.txt",
            "pickled code": "evil.pt",
            "folder": "empty",
        }[kind]
    )
    if kind == "text":
        path.write_text("these are not weights\n")
    elif kind == "pickled code":
        torch.save({"weight": Payload()}, path)  # a zip, as torch.save writes
    elif kind == "folder":
        path.mkdir()
    capfd.readouterr()
    assert main_multi_gpu.main([*MLP, "--save-dir", str(tmp_path / "run"), "--init-from", str(path)]) == 2
    captured = capfd.readouterr()  # the file descriptors: what os.system would print
    assert "pwned" not in captured.out and captured.err.count("\n") == 1
    assert (
        captured.err
        == "error: --init-from "
        + str(path)
        + " "
        + {
            "missing": "does not exist: name a .safetensors file or index, a Hugging Face folder, a .pt weights "
            "file or a checkpoint",
            "text": "holds no weights (it holds text; a checkpoint is what torch.save writes): name a .safetensors "
            "file or index, a Hugging Face folder, a .pt weights file or a checkpoint",
            "pickled code": "refused: it holds something other than tensors and plain data, or is not a checkpoint "
            "(Trying to load unsupported GLOBAL posix.system whose module posix is "
            "blocked.); it is not loaded, since that would run code from the file",
            "folder": "is a folder without weights (no model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin, nor a sharded checkpoint)",
        }[kind]
        + "\n"
    )


def test_a_safetensors_checkpoint_gives_its_model_weights(tmp_path):
    from conftest import tiny_model
    from multigpu.checkpoints import tensor_files, weights

    trained = tiny_model()
    torch.nn.init.normal_(trained[0].weight)
    state = {key: {} for key in checkpoint.REQUIRED_KEYS} | {
        "format_version": 2,
        "model": trained.state_dict(),
        "optimizer": {"state": {0: {"x": torch.ones(3)}}},
    }
    tensor_files.save_state(state, str(tmp_path / "last.safetensors"))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    lines: list[str] = []
    weights.load_initial(model, str(tmp_path / "last.safetensors"), strict=True, say=lines.append)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in trained.state_dict().items())
    assert lines[0].endswith(
        "4 tensors loaded from a checkpoint (the trained weights) (weights only: the "
        "optimizer, schedule and progress start afresh)"
    )


@pytest.mark.parametrize("strict", ["true", "false"])
def test_weights_of_another_model_that_load_nothing_are_refused_naming_the_first_keys_of_each(
    source, tmp_path, capsys, strict
):
    """Another model's weights under --init-strict false loaded 0 tensors and trained from scratch, exit 0."""
    weights_file = source / "best-weights.safetensors"
    args = [
        *TINY,
        "--train-size",
        "64",
        "--val-size",
        "32",
        "--model",
        "cnn",
        "--image-shape",
        "1,8,8",
        "--epochs",
        "1",
        "--save-dir",
        str(tmp_path / "run"),
        "--init-from",
        str(weights_file),
        "--init-strict",
        strict,
    ]
    capsys.readouterr()
    assert main_multi_gpu.main(args) == 2
    assert capsys.readouterr().err == (
        f"error: --init-from {weights_file} has no tensor of this model's names and shapes (its first keys: "
        f"net.1.bias, net.1.weight, net.3.bias, ...; the model's: features.0.weight, features.0.bias, "
        f"features.1.weight, ...): nothing would load, and the run would train from scratch; name weights of this "
        f"model, or drop --init-from to train from scratch\n"
    )
    assert not (tmp_path / "run" / "last.pt").exists()
