"""TrainConfig: the one typed description of a training run.

The command line (`main_multi_gpu.py --help`), the launcher's printed command,
the checkpoint's `config` entry and TensorBoard's hparams are all generated
from this dataclass, so they cannot drift apart. A field `batch_size` is the
flag `--batch-size`; a bool field `download` is `--download/--no-download`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from multigpu.errors import UsageError


def _opt(default: Any, help: str, choices: Optional[Sequence[str]] = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """Every setting of a run. Field names are the long CLI flags with '-' as '_'."""

    # --- devices -------------------------------------------------------
    multi_gpu: str = _opt("auto", "ddp: one process per device under torchrun; dp: nn.DataParallel in one process; "
                          "none: one device; auto: ddp under torchrun, else dp with several GPUs, else none",
                          ["auto", "ddp", "dp", "none"])
    gpu_ids: Optional[str] = _opt(None, "comma-separated GPU ids for dp, e.g. 0,1,3 (default: all visible GPUs)")
    dist_timeout: float = _opt(1800.0, "seconds a collective may wait for the other ranks before the job fails")
    # --- data ----------------------------------------------------------
    dataset: str = _opt("synthetic", "data set", ["synthetic", "mnist", "fashion-mnist", "cifar10", "cifar100",
                                                  "imagefolder", "fake"])
    data_dir: str = _opt("datasets", "where torchvision data sets live (imagefolder: a folder with train/ and val/)")
    download: bool = _opt(False, "download torchvision data sets that are missing from --data-dir")
    train_size: int = _opt(8192, "samples in the synthetic/fake training set")
    val_size: int = _opt(1000, "samples in the synthetic/fake validation set")
    image_shape: str = _opt("1,28,28", "C,H,W of synthetic/fake images (and the resize target of imagefolder)")
    num_classes: int = _opt(10, "classes of the synthetic/fake data sets")
    num_workers: Optional[int] = _opt(None, "data-loader worker processes per rank (default: 0 on CPU, 4 on CUDA)")
    # --- model ---------------------------------------------------------
    mode: str = _opt("image", "image: samples are CxHxW; flatten: samples are vectors", ["image", "flatten"])
    model: Optional[str] = _opt(None, "model (default: cnn for --mode image, mlp for --mode flatten)",
                                ["mlp", "cnn", "resnet18", "resnet50"])
    sync_bn: bool = _opt(False, "convert BatchNorm to SyncBatchNorm before the DDP wrap (CUDA only)")
    # --- optimisation ----------------------------------------------------
    epochs: int = _opt(3, "training epochs")
    batch_size: int = _opt(64, "samples per GPU/process per micro-batch (effective batch = "
                           "batch_size x devices x grad_accum_steps)")
    grad_accum_steps: int = _opt(1, "micro-batches per optimizer step")
    optimizer: str = _opt("adamw", "optimizer", ["sgd", "adamw"])
    lr: float = _opt(1e-3, "learning rate, used as given unless --lr-scaling says otherwise")
    lr_scaling: str = _opt("none", "scale --lr from --lr-base-batch to the effective batch",
                           ["none", "linear", "sqrt"])
    lr_base_batch: int = _opt(32, "the batch size --lr was tuned for")
    lr_schedule: str = _opt("cosine", "schedule after warm-up, stepped per optimizer step",
                            ["cosine", "step", "constant"])
    warmup_epochs: float = _opt(0.0, "linear LR warm-up length in epochs (may be fractional)")
    lr_step_epochs: float = _opt(30.0, "--lr-schedule step: epochs between LR decays")
    lr_gamma: float = _opt(0.1, "--lr-schedule step: factor applied at each decay")
    weight_decay: float = _opt(0.01, "weight decay")
    momentum: float = _opt(0.9, "SGD momentum")
    clip_grad_norm: float = _opt(0.0, "clip the global gradient norm to this value after unscaling (0: off)")
    amp: str = _opt("off", "mixed precision: fp16 (with GradScaler) or bf16 autocast", ["off", "fp16", "bf16"])
    seed: int = _opt(0, "seed of model init, data order and augmentation")
    # --- output --------------------------------------------------------
    save_dir: str = _opt("checkpoints", "where last.pt, best.pt and step checkpoints are written")
    log_dir: Optional[str] = _opt(None, "TensorBoard directory (default: <save-dir>/tb)")
    log_every: int = _opt(50, "optimizer steps between loss/throughput logs (the only host syncs)")
    progress: bool = _opt(True, "show the rank-0 progress bar")
    resume: Optional[str] = _opt(None, "checkpoint to continue from, or 'auto' for the newest good one in --save-dir")
    save_every_steps: int = _opt(0, "also save a step checkpoint every N optimizer steps (0: only at epoch ends)")
    keep_last: int = _opt(3, "step checkpoints to keep")

    def __post_init__(self) -> None:
        positive = ["epochs", "batch_size", "grad_accum_steps", "lr_base_batch", "log_every",
                    "train_size", "val_size", "num_classes"]
        for name in positive:
            if getattr(self, name) < 1:
                raise UsageError(f"--{flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ["lr", "dist_timeout"]:
            if not getattr(self, name) > 0:
                raise UsageError(f"--{flag(name)} must be positive, got {getattr(self, name)}")
        for name in ["warmup_epochs", "weight_decay", "clip_grad_norm", "save_every_steps", "momentum"]:
            if getattr(self, name) < 0:
                raise UsageError(f"--{flag(name)} must not be negative, got {getattr(self, name)}")
        if self.keep_last < 1:
            raise UsageError(f"--keep-last must be at least 1, got {self.keep_last}")
        if self.num_workers is not None and self.num_workers < 0:
            raise UsageError(f"--num-workers must not be negative, got {self.num_workers}")
        self.image_dims()  # validates --image-shape
        for name in ["multi_gpu", "dataset", "mode", "model", "optimizer", "lr_scaling", "lr_schedule", "amp"]:
            choices = FIELDS[name].metadata["choices"]
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise UsageError(f"--{flag(name)} must be one of {', '.join(choices)}; got {value!r}")

    # --- derived values: computed, never stored, so they cannot go stale ---
    def image_dims(self) -> tuple[int, int, int]:
        """--image-shape as (C, H, W)."""
        try:
            dims = tuple(int(part) for part in self.image_shape.split(","))
        except ValueError:
            dims = ()
        if len(dims) != 3 or min(dims) < 1:
            raise UsageError(f"--image-shape must be C,H,W with positive integers, e.g. 3,32,32; got {self.image_shape!r}")
        return dims  # type: ignore[return-value]

    @property
    def model_name(self) -> str:
        """The model to build: --model, or the default for --mode."""
        return self.model or ("mlp" if self.mode == "flatten" else "cnn")

    @property
    def tensorboard_dir(self) -> str:
        return self.log_dir or os.path.join(self.save_dir, "tb")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (str/int/float/bool/None only): safe for weights_only checkpoints and hparams."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Inverse of to_dict; unknown keys (from a newer version) are ignored."""
        return cls(**{name: value for name, value in values.items() if name in FIELDS})


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def flag(name: str) -> str:
    """The CLI flag (without dashes) of a config field: batch_size -> batch-size."""
    return name.replace("_", "-")


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input in one line (no usage block), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see --help)")


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """An ArgumentParser whose flags are exactly TrainConfig's fields."""
    parser = _OneLineParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        option = f"--{flag(f.name)}"
        if f.type in ("bool", bool):
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
        parser.add_argument(option, type=kind, default=f.default, choices=f.metadata["choices"],
                            help=f.metadata["help"])
    # Old launchers (torch.distributed.launch) pass --local-rank/--local_rank; ranks come from the environment.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


# Test-only: flags read before the command line's own, which win over them. The docs test
# (tests/test_docs.py) runs the documented commands as written, with smaller data and fewer epochs.
TEST_ARGS_ENV = "MULTIGPU_TEST_ARGS"


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """Parse command-line arguments into a validated TrainConfig."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = shlex.split(os.environ.get(TEST_ARGS_ENV, "")) + argv
    args = vars(build_parser().parse_args(argv))
    args.pop("local_rank")
    return TrainConfig(**args)


def to_argv(config: TrainConfig) -> list[str]:
    """The flags that reproduce `config` (only those that differ from the defaults)."""
    argv: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(f"--{flag(f.name)}" if value else f"--no-{flag(f.name)}")
        else:
            argv += [f"--{flag(f.name)}", str(value)]
    return argv
