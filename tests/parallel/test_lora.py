"""LoRA adapters (--lora-r, --qlora; multigpu/parallel/lora.py): only the adapters train, under one device, DDP
and FSDP2 alike; their checkpoints hold the adapters alone and resume exactly; the exports compute what the trained
model computes.

The runs at 2 and 3 processes share one start of real gloo processes each (module fixtures): starting processes
costs far more than these tiny trainings.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from conftest import (
    TokenDicts,
    assert_one_line,
    assert_untouched,
    config_for,
    contents,
    full_weights,
    run_cli_forked,
    run_ranks,
    tiny_gpt2,
)
from multigpu.checkpoints import checkpoint, sharded
from multigpu.checkpoints import export as export_module
from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.parallel import lora
from multigpu.resilience.faults import FAULT_ENV
from train_multi_gpu import MultiGPUTrainer

pytest.importorskip(
    "peft", reason="the [lora] extra (peft) is not installed: bash scripts/ensure_env.sh lora"
)

WORLD = 2
TOLERANCE = 1e-6  # fp32, a different summation order only
SIZE = 64  # token windows of TokenDicts: 8 steps of 8 samples, the batch of 2 processes x 4
# SGD: AdamW divides by the root of tiny squared gradients, which turns summation-order noise into 1e-5 steps.
LORA = dict(lora_r=4, optimizer="sgd", lr=0.1, epochs=1, lr_schedule="constant")


def gpt2() -> torch.nn.Module:
    """tiny_gpt2 without dropout: its draws differ per rank, and only a different summation order may differ."""
    return without_dropout(tiny_gpt2())


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def train(tmp_path: Path, world_size: int, mode: str, model: Any = None, **overrides: Any) -> dict[str, Any]:
    """A LoRA run of the tiny GPT-2 on token windows: its whole weights (rank 0), and what it was."""
    settings = {**LORA, "batch_size": 4, **overrides}
    config = config_for(tmp_path, world_size, multi_gpu=mode, **settings)
    trainer = MultiGPUTrainer(model if model is not None else gpt2(), TokenDicts(SIZE, 0), None, config)
    trainer.fit()
    wrapped = sum(isinstance(module, CheckpointWrapper) for module in trainer.model.modules())
    return {"weights": full_weights(trainer), "adapters": trainer.adapters, "checkpoint_wrappers": wrapped}


def adapter_part(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in weights.items() if ".lora_" in name}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key] - b[key]).abs().max().item() for key in a)


def four_bit_gpt2(folder: Path) -> torch.nn.Module:
    """tiny_gpt2 saved in `folder` (once) and loaded back with its linear layers in 4-bit NF4, as --qlora loads."""
    import transformers

    from multigpu.models.hf import four_bit

    if not (folder / "config.json").exists():
        model: Any = tiny_gpt2()
        model.save_pretrained(folder)
    config = TrainConfig(lora_r=4, qlora=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, **four_bit(transformers, config)
    )
    return without_dropout(loaded)


# ---------------------------------------------------------------- two processes: DDP, FSDP, QLoRA under DDP
def _two_ranks(rank: int, world_size: int, tmp_path: Path) -> dict[str, Any]:
    # Every rank saves into the same folders: fsdp's checkpoint is every rank's shards (last/, resumed at 1 and 3).
    results = {mode: train(tmp_path / mode, world_size, mode)["weights"] for mode in ("ddp", "fsdp")}
    results["fsdp, checkpointed"] = train(
        tmp_path / "checkpointed", world_size, "fsdp", activation_checkpointing=True
    )
    results["qlora"] = train(
        tmp_path / "qlora", world_size, "ddp", four_bit_gpt2(tmp_path / "base"), qlora=True
    )["weights"]
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    pytest.importorskip("bitsandbytes", reason="the [lora] extra (bitsandbytes) is not installed")
    tmp_path = tmp_path_factory.mktemp("lora")
    four_bit_gpt2(tmp_path / "base")  # the folder, written once before the ranks read it
    rank0, _ = run_ranks(_two_ranks, WORLD, tmp_path, tmp_path)
    return rank0, tmp_path


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_train_the_adapters_of_one_process_at_twice_the_batch(two_ranks, tmp_path, mode):
    single = train(tmp_path, 1, "none", batch_size=8)["weights"]
    start = tiny_gpt2().state_dict()
    trained = adapter_part(single)
    assert max(tensor.abs().max().item() for name, tensor in trained.items() if "lora_B" in name) > 1e-3
    assert max_difference(two_ranks[0][mode], single) <= TOLERANCE
    # The base is bit-identical to the model it started from, under its peft names.
    base = {name: tensor for name, tensor in single.items() if ".lora_" not in name}
    plain = {name.removeprefix("base_model.model.").replace(".base_layer", ""): t for name, t in base.items()}
    assert plain.keys() == start.keys() and all(torch.equal(plain[name], start[name]) for name in start)


def test_fsdp_checkpoints_the_activations_of_each_unit_and_trains_the_same_adapters(two_ranks):
    checkpointed = two_ranks[0]["fsdp, checkpointed"]
    assert checkpointed["checkpoint_wrappers"] == 2  # GPT-2's 2 blocks, each its own FSDP unit
    assert max_difference(checkpointed["weights"], two_ranks[0]["fsdp"]) <= TOLERANCE


def test_qlora_trains_on_a_4_bit_base_under_ddp_as_in_one_process(two_ranks, tmp_path):
    single = train(tmp_path, 1, "none", four_bit_gpt2(two_ranks[1] / "base"), qlora=True, batch_size=8)
    assert single["adapters"].four_bit_layers == 8  # 2 blocks x c_attn, c_proj, c_fc, mlp's c_proj
    ddp = adapter_part(two_ranks[0]["qlora"])
    assert max_difference(ddp, adapter_part(single["weights"])) <= TOLERANCE
    assert max(tensor.abs().max().item() for name, tensor in ddp.items() if "lora_B" in name) > 1e-3


def _resumed(rank: int, world_size: int, tmp_path: Path, folder: Path) -> dict[str, torch.Tensor]:
    """The adapters an fsdp run holds once it has resumed `folder`, before its next step."""
    settings = {**LORA, "epochs": 2, "batch_size": 4, "resume": str(folder)}
    config = config_for(tmp_path / f"resumed-{world_size}-{rank}", world_size, multi_gpu="fsdp", **settings)
    with MultiGPUTrainer(gpt2(), TokenDicts(SIZE, 0), None, config) as trainer:
        trainer.resume()
        return adapter_part(full_weights(trainer))


def test_a_two_process_fsdp_checkpoint_restores_its_whole_adapters_at_1_and_at_3_processes(
    two_ranks, tmp_path
):
    """Accelerate's FSDP2 + PEFT resume restored 1/N of the adapters on N ranks (accelerate PR 4206): here every
    value of every adapter comes back, at any number of processes."""
    folder = two_ranks[1] / "fsdp" / "ckpt" / "last"
    saved = sharded.load_whole(str(folder))["model"]
    assert saved.keys() == adapter_part(saved).keys() and len(saved) == 16  # 8 layers' A and B, no base
    at_one = _resumed(0, 1, tmp_path, folder)
    at_three = run_ranks(_resumed, 3, tmp_path, tmp_path, folder)[0]
    for resumed in (at_one, at_three):
        assert resumed.keys() == saved.keys()
        assert all(torch.equal(resumed[name], saved[name]) for name in saved)


# ---------------------------------------------------------------- one process
def test_only_the_adapters_train_with_the_runs_weight_decay_and_scaled_lr_and_the_plan_says_so(
    tmp_path, capsys
):
    config = config_for(tmp_path, 1, **LORA, lr_scaling="linear", lr_base_batch=2, weight_decay=0.1)
    trainer = MultiGPUTrainer(tiny_gpt2(), TokenDicts(SIZE, 0), None, config)
    trainable = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == trainable and len(optimized) == 16
    assert {(group["weight_decay"], group["lr"]) for group in trainer.optimizer.param_groups} == {
        (0.1, 0.1 * 4)
    }
    trainer.fit()
    assert "LoRA r 4 on 8 linear layers: 2.0k of 9.4k parameters train (21.77%)" in capsys.readouterr().out
    saved = checkpoint.load(str(tmp_path / "ckpt" / "last.pt"))
    assert saved["model"].keys() == adapter_part(saved["model"]).keys()
    assert saved["adapters"]["fingerprint"] == lora.base_fingerprint(trainer.model)


def test_a_peft_model_of_the_users_own_trains_its_adapters_as_given(tmp_path):
    import peft

    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"]))
    result = train(tmp_path, 1, "none", model, lora_r=0)
    assert (result["adapters"].layers, result["adapters"].rank) == (2, 2)
    assert (
        checkpoint.load(str(tmp_path / "ckpt" / "last.pt"))["model"].keys()
        == adapter_part(result["weights"]).keys()
    )


def test_targets_all_linear_leaves_the_head_out_and_names_must_name_layers():
    model = tiny_gpt2()
    assert lora.target_names(model, "all-linear") == [
        f"transformer.h.{block}.{layer}"
        for block in (0, 1)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert lora.target_names(model, "c_attn, c_fc") == ["c_attn", "c_fc"]
    with pytest.raises(UsageError) as refused:
        lora.target_names(model, "q_proj,c_attn")
    assert str(refused.value) == (
        "--lora-targets q_proj,c_attn: the model has no module named q_proj; its linear layers are named "
        "c_attn, c_fc, c_proj, lm_head (or give all-linear)"
    )
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert lora.target_names(mlp, "all-linear") == ["0"]  # a model without output embeddings: its last layer


# ---------------------------------------------------------------- the command line: resume, refusals, exports
def lm_args(tiny_lm: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        "--dataset", "hf", "--data-files", str(tiny_lm / "train.jsonl"), "--val-files", str(tiny_lm / "val.jsonl"),
        "--text-column", "text", "--model", "hf", "--model-path", str(tiny_lm / "model"), "--block-size", "32",
        "--batch-size", "8", "--max-steps", "12", "--save-every-steps", "4", "--log-every", "4", "--no-progress",
        "--save-dir", str(save_dir), *extra,
    ]  # fmt: skip


def test_a_run_killed_mid_epoch_resumes_without_the_lora_flags_to_the_uninterrupted_adapters(
    tiny_lm, tmp_path
):
    whole = run_cli_forked(lm_args(tiny_lm, tmp_path / "whole", "--lora-r", "4"))
    assert whole.returncode == 0, whole.stderr
    killed = run_cli_forked(lm_args(tiny_lm, tmp_path / "killed", "--lora-r", "4"), env={FAULT_ENV: "0:10"})
    assert killed.returncode == -9
    resumed = run_cli_forked(lm_args(tiny_lm, tmp_path / "killed", "--resume", "auto"))  # no LoRA flag
    assert resumed.returncode == 0, resumed.stderr
    assert "LoRA r 4 on 4 linear layers" in resumed.stdout and "resumed from " in resumed.stdout
    ours = checkpoint.load(str(tmp_path / "killed" / "last.pt"))["model"]
    theirs = checkpoint.load(str(tmp_path / "whole" / "last.pt"))["model"]
    assert ours.keys() == theirs.keys() and max_difference(ours, theirs) == 0
    # The adapters, their optimizer state and the run's: smaller than the base's weights alone.
    assert os.path.getsize(tmp_path / "whole" / "last.pt") < os.path.getsize(
        tiny_lm / "model" / "model.safetensors"
    )


def test_a_lora_checkpoint_resumed_onto_another_base_is_refused_in_one_line(tiny_lm, tmp_path):
    run = tmp_path / "run"
    assert run_cli_forked(lm_args(tiny_lm, run, "--lora-r", "4", "--max-steps", "4")).returncode == 0
    other = changed_copy(tiny_lm / "model", tmp_path / "other-base")
    before = contents(run)
    args = lm_args(tiny_lm, run, "--resume", "auto")
    args[args.index("--model-path") + 1] = str(other)
    refused = run_cli_forked(args)
    assert_one_line(refused.returncode, refused.stderr, "holds LoRA adapters of another base model")
    assert_untouched(run, before)


def changed_copy(model_folder: Path, copy: Path) -> Path:
    """A copy of a model folder whose every weight is 0.01 larger: the same model, another base."""
    import safetensors.torch

    shutil.copytree(model_folder, copy, dirs_exist_ok=True)
    weights = safetensors.torch.load_file(str(copy / "model.safetensors"))
    weights = {
        name: tensor + 0.01 if tensor.is_floating_point() else tensor for name, tensor in weights.items()
    }
    safetensors.torch.save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora-r", "-1"], "--lora-r must not be negative, got -1"),
        (["--qlora"], "--qlora trains LoRA adapters on a 4-bit base: give --lora-r R too (e.g. --lora-r 8)"),
        (
            ["--lora-r", "4", "--lora-targets", "q_proj"],
            "--lora-targets q_proj: the model has no module named",
        ),
        (
            ["--lora-r", "4", "--qlora", "--multi-gpu", "fsdp"],
            "--qlora's 4-bit base (bitsandbytes) cannot be",
        ),
        (
            ["--lora-r", "4", "--ema-decay", "0.9"],
            "--ema-decay keeps an average of every weight, a second copy",
        ),
    ],
)
def test_bad_lora_settings_are_one_line_and_exit_2_with_nothing_written(
    tiny_lm, tmp_path, capsys, args, message
):
    from main_multi_gpu import main

    assert main(lm_args(tiny_lm, tmp_path / "run", *args)) == 2
    err = capsys.readouterr().err
    assert_one_line(2, err, message)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("*.pt"))


def lm_settings(tiny_lm: Path, model_folder: Path) -> dict[str, Any]:
    """The settings of --model hf on the tiny LM's files (the trainer here gets token windows of its own)."""
    data = str(tiny_lm / "train.jsonl")
    return dict(model="hf", model_path=str(model_folder), dataset="hf", data_files=data, text_column="text")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_the_merged_and_the_adapter_exports_compute_what_the_trained_model_computes(tiny_lm, tmp_path, qlora):
    """--export-on-end adapter and `python -m multigpu.export --format hf` (merged; a 4-bit base dequantized)."""
    import peft
    import transformers

    from multigpu.models.hf import hf_model

    flags = dict(lora_r=4, qlora=qlora, export_on_end="adapter", **lm_settings(tiny_lm, tiny_lm / "model"))
    config = config_for(tmp_path, 1, **flags, lr=0.05, epochs=1, batch_size=8)
    model = hf_model(0, config)
    trainer = MultiGPUTrainer(model, TokenDicts(SIZE, 0, length=16, vocab=140), None, config)
    trainer.fit()
    merged_folder = tmp_path / "merged"
    assert export_module.main([str(tmp_path / "ckpt" / "last.pt"), str(merged_folder), "--format", "hf"]) == 0
    assert not (merged_folder / "adapter_config.json").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_folder)  # no peft: a plain GPT-2
    base = (
        hf_model(0, config) if qlora else transformers.AutoModelForCausalLM.from_pretrained(tiny_lm / "model")
    )
    lora.keep_off_cpu_inference_packing(base)
    adapter = peft.PeftModel.from_pretrained(base, tmp_path / "ckpt" / "best-adapter")
    ids = TokenDicts(4, 7, length=16, vocab=140).ids
    trained = _logits(trainer.model, ids)
    assert (_logits(merged, ids) - trained).abs().max().item() <= 1e-5
    assert (_logits(adapter, ids) - trained).abs().max().item() <= 1e-5
    assert (
        _logits(transformers.AutoModelForCausalLM.from_pretrained(tiny_lm / "model"), ids) - trained
    ).abs().max() > 1e-3


def test_a_base_changed_since_training_is_refused_by_the_export(tiny_lm, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_lm / "model", base)
    config = config_for(tmp_path, 1, lora_r=4, epochs=1, batch_size=8, **lm_settings(tiny_lm, base))
    from multigpu.models.hf import hf_model

    MultiGPUTrainer(hf_model(0, config), TokenDicts(16, 0, length=16, vocab=140), None, config).fit()
    changed_copy(tiny_lm / "model", base)
    digest = hashlib.sha256((tmp_path / "ckpt" / "last.pt").read_bytes()).hexdigest()
    assert (
        export_module.main([str(tmp_path / "ckpt" / "last.pt"), str(tmp_path / "out"), "--format", "adapter"])
        == 2
    )
    assert "is not the one checkpoint" in capsys.readouterr().err
    assert hashlib.sha256((tmp_path / "ckpt" / "last.pt").read_bytes()).hexdigest() == digest
    assert not (tmp_path / "out").exists()


def test_a_missing_peft_or_bitsandbytes_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    from multigpu.models.hf import four_bit

    monkeypatch.setitem(sys.modules, "peft", None)  # as where it is not installed: its import fails
    with pytest.raises(UsageError) as no_peft:
        MultiGPUTrainer(gpt2(), TokenDicts(SIZE, 0), None, config_for(tmp_path, 1, lora_r=4))
    assert (
        str(no_peft.value) == "--lora-r needs the peft library, which is not installed: pip install '.[lora]'"
    )
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(UsageError) as no_bitsandbytes:
        four_bit(None, TrainConfig(lora_r=4, qlora=True))
    assert (
        str(no_bitsandbytes.value)
        == "--qlora needs bitsandbytes, which is not installed: pip install '.[lora]'"
    )


def test_the_fingerprint_reads_every_tensor_to_its_last_value_and_tells_bases_apart():
    """A strided sample, first and last values included, of tensors larger than float32 counts exactly
    (GPT-2's embedding has 38.6M values)."""
    module = torch.nn.Module()
    module.big = torch.nn.Parameter(torch.zeros(2**24 + 3, dtype=torch.uint8), requires_grad=False)
    before = lora.base_fingerprint(module)
    with torch.no_grad():
        module.big[-1] = 1
    assert lora.base_fingerprint(module) != before
    assert lora.base_fingerprint(module) == lora.base_fingerprint(module)


def test_init_from_a_lora_checkpoint_starts_a_lora_run_from_its_adapters(tmp_path):
    from multigpu.checkpoints.weights import load_initial

    trained = train(tmp_path, 1, "none")["weights"]
    said: list[str] = []
    fresh = lora.add_adapters(gpt2(), TrainConfig(lora_r=4, seed=1))
    load_initial(fresh, str(tmp_path / "ckpt" / "last.pt"), True, said.append)
    assert said[0].startswith(f"--init-from {tmp_path / 'ckpt' / 'last.pt'}: 16 tensors loaded")
    loaded = adapter_part(fresh.state_dict())
    assert all(torch.equal(loaded[name], trained[name]) for name in adapter_part(trained))
