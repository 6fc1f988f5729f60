"""Flags that would silently do nothing: one warning line each, naming the flag and why it has no effect.

A flag is warned about only when the user gave it: on the command line (parse_config records the flags it
named, whatever their values, as `TrainConfig.given`), or from Python a field set to something other than its
default. Defaults never warn, so neither does a command that the launcher or a sweep builds from them.
The trainer's plan (multigpu/monitoring/plan.py) prints these lines once, on rank 0, before the first step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from multigpu.config import TrainConfig, flag

GENERATED = ("synthetic", "fake")  # data sets made up in memory: nothing is read or downloaded
SIZES_OF_GENERATED = ("train_size", "val_size", "num_classes")


@dataclass(frozen=True)
class RunFacts:
    """What the rules need to know beyond the config: whether the trainer uses its own optimizer and schedule
    (a user's replace them), whether the model has convolution weights (the only 4-D tensors
    channels-last changes), and the optimizer steps of an epoch (0: not known yet)."""

    builtin_optimizer: bool = True
    builtin_schedule: bool = True
    convolutions: bool = True
    steps_per_epoch: int = 0


def ignored_flags(config: TrainConfig, given_fields: frozenset[str], facts: RunFacts) -> list[str]:
    """A "warning: --FLAG has no effect: why" line for each given flag this run does not use."""
    lines = []
    for name, why in _unused(config, facts):
        value = getattr(config, name)
        if name in given_fields and value is not False:  # --no-download and the like ask for nothing
            shown = f"--{flag(name)}" if value is True else f"--{flag(name)} {value}"
            lines.append(f"warning: {shown} has no effect: {why}")
    return lines


def _unused(config: TrainConfig, facts: RunFacts) -> Iterator[tuple[str, str]]:
    """(field, why) for every field that this run's other settings leave unused, given or not."""
    if facts.builtin_schedule and config.lr_schedule != "step":
        for name in ("lr_gamma", "lr_step_epochs"):
            yield (
                name,
                (
                    f"it shapes --lr-schedule step, and this run's schedule is {config.lr_schedule}; "
                    f"add --lr-schedule step to decay the LR in steps"
                ),
            )
    if facts.builtin_optimizer and config.optimizer != "sgd":
        yield (
            "momentum",
            f"it is SGD's momentum, and --optimizer {config.optimizer} has none; use --optimizer sgd",
        )
    if config.lr_scaling == "none":
        yield (
            "lr_base_batch",
            (
                "--lr-scaling none uses --lr as given; add --lr-scaling linear or sqrt to scale it "
                "from this batch to the effective batch"
            ),
        )
    if config.save_every_steps == 0:
        yield (
            "keep_last",
            (
                "it counts step checkpoints, and without --save-every-steps there are none "
                "(last.pt and best.pt are always kept)"
            ),
        )
    if config.early_stop_patience == 0:
        yield (
            "early_stop_min_delta",
            "it is the least improvement --early-stop-patience counts, and that is off",
        )
    if config.dataset not in GENERATED:
        for name in SIZES_OF_GENERATED:
            if not (
                name == "num_classes" and config.dataset == "hf"
            ):  # hf: a label column without class names
                yield (
                    name,
                    f"it sizes the synthetic and fake data sets, and --dataset {config.dataset} has its own",
                )
        if config.dataset not in ("imagefolder", "text", "hf"):  # hf: the shape a column of numbers takes
            yield "image_shape", f"--dataset {config.dataset} has images of its own shape"
    if config.dataset in GENERATED:
        for name in ("data_dir", "download"):
            yield name, f"--dataset {config.dataset} is generated in memory: no file is read or downloaded"
    elif config.dataset == "imagefolder":
        yield "download", "an image folder is read as it is: there is nothing to download"
    elif config.dataset == "text":
        yield from _unused_by_text()
    if config.model_name not in ("gpt", "hf"):  # hf: its windows of tokens
        yield (
            "block_size",
            f"it sizes --model gpt and --model hf, and this run's model is {config.model_name}",
        )
    if config.model_name != "gpt":
        for name in ("n_layer", "n_head", "n_embd"):
            yield name, f"it sizes --model gpt, and this run's model is {config.model_name}"
    if config.text_kind is not None:
        yield from _unused_by_hf_text(config)
    if config.eval_only:
        for name in ("eval_every_steps", "save_every_steps", "export_on_end", "early_stop_patience"):
            yield name, "--eval-only trains nothing: it evaluates and writes eval.json"
    if config.multi_gpu != "fsdp":
        for name in (
            "fsdp_blocks",
            "fsdp_reshard_after_forward",
            "dp_replicate",
            "dp_shard",
            "fsdp_accumulate",
        ):
            yield name, f"it shapes --multi-gpu fsdp, and this run is --multi-gpu {config.multi_gpu}"
    elif config.grad_accum_steps == 1:
        yield (
            "fsdp_accumulate",
            (
                "it says how the inner micro-steps of --grad-accum-steps keep their gradients, and "
                "this run takes one micro-step per optimizer step"
            ),
        )
    if facts.steps_per_epoch and config.max_steps > config.epochs * facts.steps_per_epoch:
        yield (
            "max_steps",
            (
                f"--epochs {config.epochs} of {facts.steps_per_epoch} steps end the run first, at "
                f"{config.epochs * facts.steps_per_epoch} steps; raise --epochs to train "
                f"{config.max_steps} steps"
            ),
        )
    if not facts.convolutions:
        yield (
            "channels_last",
            ("the model has no convolutions (no 4-D weights), so there is nothing to store channels-last"),
        )


def _unused_by_hf_text(config: TrainConfig) -> Iterator[tuple[str, str]]:
    """What --text-column leaves unused: its samples are tokens, not numbers or images; a classifier pads."""
    for name in ("input_column", "image_shape", "mode"):
        yield name, "--model hf's text gives tokens (--block-size of them), not numbers or images"
    if config.text_classification:
        yield (
            "pad_to_batch",
            "a classifier's texts are always padded per batch (each is a sample with its class)",
        )


def _unused_by_text() -> Iterator[tuple[str, str]]:
    """What --dataset text leaves unused: it reads --data-file as windows of characters, not images."""
    for name in ("data_dir", "download"):
        yield name, "--dataset text reads --data-file as it is: no folder is read and nothing is downloaded"
    for name in ("image_shape", "mode"):
        yield name, "--dataset text gives windows of characters (--block-size of them), not images"
