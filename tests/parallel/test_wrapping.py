"""--compile and --channels-last (multigpu/parallel/wrapping.py prepare_model): each trains to what the plain model
trains to, compiled checkpoints keep plain keys, and a run resumes compiled or not whichever way it was saved."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, REPO, blobs, cli_env, config_for, needs_compiler, run_ranks, tiny_model
from multigpu.data import SyntheticImages
from multigpu.models import build_model
from multigpu.parallel.wrapping import uncompiled
from train_multi_gpu import MultiGPUTrainer


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def fit(tmp_path: Path, name: str, epochs: int, **overrides) -> MultiGPUTrainer:
    # A constant LR: the schedule of a run resumed with more --epochs would otherwise differ from one run's.
    config = config_for(tmp_path / name, 1, epochs=epochs, batch_size=16, lr_schedule="constant", **overrides)
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config)
    trainer.fit()
    return trainer


@pytest.mark.slow
@needs_compiler
def test_a_compiled_run_resumes_uncompiled_and_compiled_again_and_matches_a_plain_run(tmp_path, capsys):
    compiled = fit(tmp_path, "mixed", 1, compile=True)
    assert compiled.model._compiled_call_impl is not None  # compiled in place: the module itself, plain keys
    saved = tmp_path / "mixed" / "ckpt" / "last.pt"
    assert not [key for key in weights(saved) if "_orig_mod" in key]
    fit(tmp_path, "mixed", 2, resume="auto")  # uncompiled, from the compiled run's checkpoint
    fit(tmp_path, "mixed", 3, resume="auto", compile=True)  # and compiled again
    assert capsys.readouterr().out.count("resumed from") == 2
    fit(tmp_path, "plain", 3)
    mixed, plain = weights(saved), weights(tmp_path / "plain" / "ckpt" / "last.pt")
    assert mixed.keys() == plain.keys()
    for key in plain:  # compiled kernels may sum in another order: equal up to rounding
        assert torch.allclose(mixed[key], plain[key], atol=1e-5), key


def _compiled_ddp(rank: int, world_size: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    config = config_for(tmp_path, world_size, epochs=2, batch_size=8, lr_schedule="constant", compile=True)
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config)
    assert isinstance(trainer.step.wrapped, torch.nn.parallel.DistributedDataParallel)
    assert (
        trainer.step.wrapped.module is trainer.model and trainer.model._compiled_call_impl is not None
    )  # then wrapped
    trainer.fit()
    return {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}


@pytest.mark.slow
@needs_compiler
def test_compiled_under_ddp_two_ranks_train_as_one_process_with_their_whole_batch(tmp_path):
    ranks = run_ranks(_compiled_ddp, 2, tmp_path / "ddp", tmp_path / "ddp")
    fit(tmp_path, "one", 2)  # one process, batch 16 = 2 ranks x 8
    one = weights(tmp_path / "one" / "ckpt" / "last.pt")
    for key in one:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
        assert torch.allclose(ranks[0][key], one[key], atol=1e-5), key


def images(size: int) -> torch.utils.data.TensorDataset:
    source = SyntheticImages(size, (3, 12, 12), 10, seed=0)
    return torch.utils.data.TensorDataset(
        torch.stack([source[i][0] for i in range(size)]), torch.tensor([source[i][1] for i in range(size)])
    )


def test_channels_last_trains_to_the_same_weights_as_channels_first(tmp_path):
    results, layouts = {}, []
    for channels_last in (False, True):
        torch.manual_seed(0)
        model = build_model("cnn", (3, 12, 12), 10)
        config = config_for(
            tmp_path / str(channels_last),
            1,
            epochs=1,
            batch_size=16,
            optimizer="sgd",
            lr=0.05,
            channels_last=channels_last,
        )  # SGD: no Adam division to magnify rounding
        trainer = MultiGPUTrainer(model, images(64), images(16), config)
        trainer.model.register_forward_pre_hook(
            lambda module, args: layouts.append(
                args[0].is_contiguous(memory_format=torch.channels_last) and not args[0].is_contiguous()
            )
        )
        trainer.fit()
        conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last) == channels_last
        results[channels_last] = weights(tmp_path / str(channels_last) / "ckpt" / "last.pt")
    assert (
        layouts == [False] * 5 + [True] * 5
    )  # 4 training batches and 1 evaluation batch, in the layout asked for
    for key in results[False]:
        assert torch.allclose(results[True][key], results[False][key], atol=1e-5), key


def test_uncompiled_runs_a_compiled_module_eagerly_so_the_start_probes_compile_nothing():
    import torch._dynamo

    model = torch.nn.Linear(4, 2)
    model.compile(
        backend="eager"
    )  # dynamo's capture without a C++ build: the counter still sees each compile
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with uncompiled():
        model(torch.randn(8, 4))  # a probe's batch of 8
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    model(torch.randn(16, 4))  # training's batch: the first compile, at its own shape
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_run_of_an_uncompiled_model_never_imports_dynamo():
    """Importing dynamo only to set its stance cost every run 1.7 s of start: uncompiled() leaves it alone when
    nothing was compiled (compiling imports it)."""
    probe = (
        "import sys, torch\n"
        "from multigpu.parallel.wrapping import uncompiled\n"
        "with uncompiled():\n"
        "    torch.nn.Linear(4, 2)(torch.randn(8, 4))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([PYTHON, "-c", probe], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
