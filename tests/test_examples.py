"""examples/: a user's own task on the trainer, run as a user would, in one process and under 2-process
torchrun, killed mid-run and resumed to the same final weights as an uninterrupted run; and the ported clients
whose model signatures need no forward_fn, each learning in one process and under torchrun.

The runs that are not about how a process starts or ends (the one-process run, the uninterrupted reference) are
forked from the preloaded server with the environment torchrun gives (conftest.run_script_forked); the killed run
and its resume are real torchrun jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_ok, read_scalars, run_cli, run_script_forked
from multigpu.checkpoints import checkpoint
from multigpu.resilience.faults import FAULT_ENV

# 96 samples, 8 per process: 6 steps per epoch with 2 processes; step checkpoints every 2 steps.
SMALL = [
    "--train-size",
    "96",
    "--val-size",
    "40",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--no-progress",
    "--dist-timeout",
    "60",
    "--log-every",
    "2",
    "--save-every-steps",
    "2",
]
EXAMPLES = {  # script: (its own flags, the metric best.pt follows)
    "regression.py": (["--lr", "0.01"], "val_loss"),
    "dict_batches.py": (["--lr", "0.01"], "val_acc"),
    "adadelta_steplr.py": (
        ["--lr", "1.0", "--model", "mlp", "--mode", "flatten", "--image-shape", "1,8,8"],
        "val_acc",
    ),
}


def run_example(
    name: str, save_dir: Path, *extra: str, nproc: int | None = None, fault: str = "", forked: bool = False
):
    flags, _ = EXAMPLES[name]
    args = [*SMALL, *flags, "--save-dir", str(save_dir), *extra]
    env = {FAULT_ENV: fault} if fault else None
    if forked:
        return run_script_forked(REPO / "examples" / name, args, nproc, env)
    return run_cli(args, nproc=nproc, script=REPO / "examples" / name, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_trains_picks_its_best_checkpoint_and_resumes_bit_identically_under_torchrun(name, tmp_path):
    _, monitor = EXAMPLES[name]
    single = run_example(name, tmp_path / "single", forked=True)
    assert_ok(single)
    best = checkpoint.load(str(tmp_path / "single" / "best.pt"))
    values = [value for _, value in read_scalars(tmp_path / "single" / "tb")[monitor.replace("_", "/", 1)]]
    assert best["monitor"] == monitor and best["best_value"] == pytest.approx(
        min(values) if monitor == "val_loss" else max(values), rel=1e-6
    )

    assert_ok(run_example(name, tmp_path / "whole", nproc=2, forked=True))
    killed = run_example(name, tmp_path / "resumed", nproc=2, fault="1:5")  # rank 1 dies after step 5
    assert killed.returncode != 0
    resumed = run_example(name, tmp_path / "resumed", "--resume", "auto", nproc=2)
    assert_ok(resumed)
    # Rank 0 kept the last completed step from its own replica when it lost rank 1 (issue 24).
    assert "resumed from" in resumed.stdout and "step 5," in resumed.stdout
    ours, theirs = (checkpoint.load(str(tmp_path / run / "last.pt")) for run in ("resumed", "whole"))
    assert ours["global_step"] == theirs["global_step"] == 12
    for key, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][key], tensor), key
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert ours["scheduler"] == theirs["scheduler"]


# Clients ported as their authors wrote them: the model's forward signature decides what each batch passes.
PORTED = {
    "hf_dict_batch.py": ["--lr", "0.01"],  # {"input_ids", "attention_mask", "label"} into forward(input_ids)
    "nanogpt.py": [
        "--lr",
        "0.01",
    ],  # forward(idx, targets=None) -> (logits, loss), two AdamW groups, clipping
    "dict_inputs_pair.py": ["--lr", "0.01"],  # ({"numeric", "city"}, label) into forward(features)
}
TINY = [
    "--train-size",
    "256",
    "--val-size",
    "64",
    "--batch-size",
    "16",
    "--epochs",
    "2",
    "--no-progress",
    "--dist-timeout",
    "60",
    "--log-every",
    "4",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", PORTED)
@pytest.mark.parametrize("nproc", [None, 2])
def test_ported_clients_train_without_a_forward_fn_and_their_loss_falls(name, nproc, tmp_path):
    result = run_cli(
        [*TINY, *PORTED[name], "--save-dir", str(tmp_path)], nproc=nproc, script=REPO / "examples" / name
    )
    assert_ok(result)
    losses = [value for _, value in read_scalars(tmp_path / "tb")["train/loss"]]
    assert len(losses) >= 3 and losses[-1] < 0.8 * losses[0], losses
    val_losses = [value for _, value in read_scalars(tmp_path / "tb")["val/loss"]]
    assert len(val_losses) == 2 and val_losses[1] < val_losses[0], val_losses
