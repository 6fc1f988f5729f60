"""Command line: a trained checkpoint's predictions over a data set, in dataset order, on any devices.

    python predict_multi_gpu.py --checkpoint checkpoints/run-1/best.pt --output checkpoints/run-1/predictions.csv
    torchrun --nproc_per_node=4 predict_multi_gpu.py --checkpoint checkpoints/best.pt --output logits.pt
    python predict_multi_gpu.py --checkpoint checkpoints/best.pt --imagefolder photos/ --output p.csv --topk 3

The model, data set and shapes come from the checkpoint's config (flags
override them); the batches and autocast are the evaluation's, so on a
labelled set the printed loss and metrics are those training reported for
that checkpoint. See docs/prediction.md, "Prediction".
Exit status: 0 done, 1 failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from main_multi_gpu import main_guarded
from multigpu import safe_files
from multigpu.checkpoints import checkpoint, run_folders, sharded
from multigpu.config import FIELDS, OneLineParser, TrainConfig, field_kind, flag
from multigpu.data import TORCHVISION_SETS, build_datasets
from multigpu.data.unlabeled import UnlabeledImages
from multigpu.engine.state import check_adapters
from multigpu.errors import UsageError
from multigpu.loop.amp import Amp, resolve_dtype
from multigpu.loop.callbacks import ema_weights
from multigpu.loop.evaluation import Evaluator
from multigpu.loop.forward import fitted_forward
from multigpu.loop.prediction import Predictor, written_whole
from multigpu.models import TEXT_MODELS, build_model
from multigpu.parallel import lora
from multigpu.parallel.distributed import Runtime, barrier, setup, teardown

OUTPUT_KINDS = (".csv", ".pt")
# Flags that describe the data and model: by default the checkpoint's own values.
FROM_CHECKPOINT = ("dataset", "data_dir", "data_file", "image_shape", "num_classes", "model", "amp")
# Flags that describe this machine: by default TrainConfig's defaults, as for training.
FROM_MACHINE = ("multi_gpu", "gpu_ids", "num_workers", "dist_timeout", "download")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="last.pt, best.pt or a step checkpoint of a training run, or a sharded checkpoint folder "
        "(last/)",
    )
    parser.add_argument("--split", choices=["val", "train"], default="val", help="which split of --dataset")
    parser.add_argument(
        "--imagefolder",
        metavar="DIR",
        help="predict every image under DIR (no labels) instead of a split of --dataset",
    )
    parser.add_argument(
        "--output",
        metavar="FILE",
        help=".csv: index, [file, label,] predicted class and its "
        "probability, top-k with --topk; .pt: the raw outputs tensor, in dataset order",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output file (never the "
        "checkpoint, a folder, nor a file named like a checkpoint: last.pt, best.pt, step-*.pt)",
    )
    parser.add_argument(
        "--topk",
        type=int,
        default=0,
        help="add the K most probable classes and their probabilities to the CSV",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="samples per device per batch (default: the checkpoint's "
        "evaluation batch, so the metrics match training's bit for bit)",
    )
    for name in FROM_CHECKPOINT + FROM_MACHINE:
        field = FIELDS[name]
        kind = field_kind(field)
        help = field.metadata["help"]
        if name in FROM_CHECKPOINT:
            help = re.sub(r" \(default: [^)]*\)", "", help) + " (default: the checkpoint's)"
        elif "default" not in help and field.default not in (None, False):
            help += f" (default: {field.default})"
        if kind == "bool":
            parser.add_argument(f"--{flag(name)}", action="store_true", default=None, help=help)
        else:
            parser.add_argument(
                f"--{flag(name)}",
                type={"int": int, "float": float}.get(kind, str),
                choices=field.metadata["choices"],
                help=help,
            )
    return parser.parse_args(argv)


def prediction_config(args: argparse.Namespace, state: dict[str, Any]) -> TrainConfig:
    """The checkpoint's config with this command's flags applied (validated as any TrainConfig)."""
    saved = TrainConfig.from_dict(state["config"])
    changes: dict[str, Any] = {
        name: getattr(args, name) for name in FROM_CHECKPOINT if getattr(args, name) is not None
    }
    changes.update(
        {
            name: getattr(args, name) if getattr(args, name) is not None else FIELDS[name].default
            for name in FROM_MACHINE
        }
    )
    changes.update(
        progress=False, eval_batch_size=args.batch_size or saved.eval_batch_size or saved.batch_size
    )
    return dataclasses.replace(saved, **changes)


def check_arguments(args: argparse.Namespace) -> None:
    if args.output is not None and os.path.splitext(args.output)[1] not in OUTPUT_KINDS:
        raise UsageError(f"--output {args.output}: the file name must end in {' or '.join(OUTPUT_KINDS)}")
    if args.output is not None:
        check_output(args.output, args.checkpoint, args.overwrite)
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.topk < 0 or (args.topk and (args.output or "").endswith(".pt")):
        raise UsageError("--topk K adds K >= 1 classes to a .csv --output")
    if args.imagefolder is not None and args.split != "val":
        raise UsageError("--split chooses a split of --dataset; --imagefolder predicts a folder of its own")


def check_text_model(args: argparse.Namespace, config: TrainConfig) -> None:
    """UsageError where a text model (--model gpt) cannot give what is asked: it reads windows of characters, not
    images, and gives scores at every position of a window, more than one CSV row per sample holds. A transformers
    model (--model hf) is loaded as one instead."""
    if config.model_name not in TEXT_MODELS:
        return
    if (
        config.model_name == "hf"
    ):  # its outputs are a transformers model's, its padded batches need their collate_fn
        raise UsageError(
            "--model hf's checkpoints are not predicted here: load the model as a transformers model "
            "(--export-on-end hf, or python -m multigpu.export CKPT FOLDER --format hf --tokenizer "
            "TOKENIZER_FOLDER, then from_pretrained; docs/language-models.md)"
        )
    if args.imagefolder is not None:
        raise UsageError(
            f"--imagefolder gives images, and the checkpoint's --model {config.model_name} reads "
            f"characters; predict its --dataset text instead (drop --imagefolder)"
        )
    if (args.output or "").endswith(".csv"):
        raise UsageError(
            f"--output {args.output}: --model {config.model_name} scores every position of a window, "
            f"more than a CSV row per sample holds; write a .pt file, e.g. --output logits.pt"
        )


def check_output(output: str, checkpoint_path: str, overwrite: bool) -> None:
    """Refuse an --output that would destroy something: a symbolic link (safe_files), a folder, the
    checkpoint being read, a checkpoint's name (a training run in that folder would resume from it),
    and, without --overwrite, any existing file. Refused: nothing is read or written."""
    safe_files.refuse_link(output)
    if os.path.isdir(output):
        raise UsageError(
            f"--output {output} is a folder; name a file in it, e.g. {os.path.join(output, 'p.csv')}"
        )
    if (
        os.path.exists(output)
        and os.path.exists(checkpoint_path)
        and os.path.samefile(output, checkpoint_path)
    ):
        raise UsageError(
            f"--output {output} is the checkpoint being read (--checkpoint {checkpoint_path}); "
            f"choose another file"
        )
    name = os.path.basename(output)
    names = [
        pattern for pattern in run_folders.CHECKPOINT_FILES if pattern.endswith(".pt")
    ]  # --output: .pt or .csv
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in names):
        raise UsageError(
            f"--output {output}: {name} is a save-dir's checkpoint name "
            f"({', '.join(names)}), refused even with --overwrite; "
            f"choose another name"
        )
    if os.path.exists(output) and not overwrite:
        raise UsageError(
            f"--output {output} exists; add --overwrite to replace it (only once the prediction "
            f"is complete), or choose another file"
        )


# ---------------------------------------------------------------- data and model
@dataclasses.dataclass
class PredictionSet:
    """What is predicted: the data set, whether it has labels, and what the model is built for."""

    data: Any
    labelled: bool
    input_shape: tuple[int, ...]
    num_classes: int
    files: list[str] | None = None  # --imagefolder: the image paths, in dataset order


def prediction_set(
    args: argparse.Namespace, config: TrainConfig, state: dict[str, Any], runtime: Runtime
) -> PredictionSet:
    """The set to predict; with --download, rank 0 fetches it while the others wait, then they read its files."""
    if args.imagefolder is None:
        spec = build_datasets(config, download_allowed=runtime.is_main)
        if args.split == "val":
            return PredictionSet(spec.val, True, spec.input_shape, spec.num_classes)
        _evaluation_transform(spec.train, spec.val)
        return PredictionSet(spec.train, True, spec.input_shape, spec.num_classes)
    channels, height, width = (
        TORCHVISION_SETS[config.dataset][1] if config.dataset in TORCHVISION_SETS else config.image_dims()
    )
    images = UnlabeledImages(args.imagefolder, _image_transform(config, (channels, height, width)))
    shape = (channels * height * width,) if config.mode == "flatten" else (channels, height, width)
    return PredictionSet(images, False, shape, _classes(config, state), images.files)


def _evaluation_transform(train: Any, val: Any) -> None:
    """Predict the training split without its augmentation: the validation split's transform."""
    inner_train, inner_val = getattr(train, "dataset", train), getattr(val, "dataset", val)  # under Flattened
    if hasattr(inner_train, "transform"):
        inner_train.transform = inner_val.transform


def _image_transform(config: TrainConfig, shape: tuple[int, int, int]) -> Any:
    """What the checkpoint's validation images went through: resize, channels, tensor, normalisation, flatten."""
    from torchvision import transforms

    steps = [transforms.Resize(shape[1:])] + ([transforms.Grayscale()] if shape[0] == 1 else [])
    steps.append(transforms.ToTensor())
    if config.dataset in TORCHVISION_SETS:
        steps.append(transforms.Normalize(*TORCHVISION_SETS[config.dataset][3:]))
    if config.mode == "flatten":
        steps.append(transforms.Lambda(torch.flatten))
    return transforms.Compose(steps)


def _classes(config: TrainConfig, state: dict[str, Any]) -> int:
    """The checkpoint's class count: its data set's, or (an image folder's) its model's output layer's."""
    if config.dataset in TORCHVISION_SETS:
        return TORCHVISION_SETS[config.dataset][2]
    if config.dataset == "imagefolder":
        return next(reversed(state["model"].values())).shape[
            0
        ]  # every registered model ends in its head's bias
    return config.num_classes


def load_model(
    config: TrainConfig, data: PredictionSet, state: dict[str, Any], path: str, runtime: Runtime
) -> nn.Module:
    """The checkpoint's model on this process's device (DataParallel over the GPUs in dp mode): its EMA weights
    when it was trained with --ema-decay."""
    torch.manual_seed(config.seed)  # a LoRA checkpoint's frozen base is the one its run built from --seed
    model = lora.add_adapters(
        build_model(config.model_name, data.input_shape, data.num_classes, config), config
    )
    try:
        if lora.is_adapted(model):  # --lora-r: the adapters alone, on the base their fingerprint names
            check_adapters(path, state.get("adapters"), lora.adapters_of(model, config))
            lora.load_trainable_part(model, state["model"])
        else:
            model.load_state_dict(ema_weights(state) or state["model"])
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise checkpoint.CheckpointError(
            f"checkpoint {path} does not fit --model {config.model_name} for "
            f"{'x'.join(map(str, data.input_shape))} inputs and {data.num_classes} "
            f"classes: {lines[min(1, len(lines) - 1)][:200]}"
        ) from None
    model = model.to(runtime.device)
    if runtime.mode == "dp":
        return nn.DataParallel(
            model, device_ids=runtime.dp_device_ids, output_device=runtime.dp_device_ids[0]
        )
    return model


# ---------------------------------------------------------------- outputs
class CsvOutput:
    """Rank 0's CSV, a chunk of rows at a time: index, [file,] [label,] predicted, probability, [top-k]."""

    def __init__(self, path: str, data: PredictionSet, topk: int):
        self.file_context = written_whole(path, "w", newline="")
        self.data, self.topk, self.count = data, topk, 0

    def __enter__(self) -> CsvOutput:
        self.writer = csv.writer(self.file_context.__enter__())
        columns = ["index"] + ["file"] * (self.data.files is not None) + ["label"] * self.data.labelled
        self.writer.writerow(
            columns
            + ["predicted", "probability"]
            + [name for k in range(1, self.topk + 1) for name in (f"top{k}", f"top{k}_probability")]
        )
        return self

    def write(self, chunk: tuple[torch.Tensor, torch.Tensor]) -> None:
        logits, labels = chunk
        probabilities = logits.float().softmax(-1)
        predicted = logits.float().argmax(-1)  # as the accuracy metric decides
        top = probabilities.topk(self.topk, dim=-1) if self.topk else None
        for row in range(len(logits)):
            index = self.count + row
            cells: list[Any] = [index]
            if self.data.files is not None:
                cells.append(self.data.files[index])
            if self.data.labelled:
                cells.append(int(labels[row]))
            cells += [int(predicted[row]), f"{float(probabilities[row, predicted[row]]):.6g}"]
            for k in range(self.topk):
                cells += [int(top.indices[row, k]), f"{float(top.values[row, k]):.6g}"]  # type: ignore[union-attr]  # topk > 0
            self.writer.writerow(cells)
        self.count += len(logits)

    def __exit__(self, *exc_info: Any) -> None:
        self.file_context.__exit__(*exc_info)


class TensorOutput:
    """Rank 0's outputs in memory, saved as one tensor in dataset order (when all went well)."""

    def __init__(self, path: str):
        self.path = path
        self.chunks: list[torch.Tensor] = []  # the outputs, in dataset order
        self.count = 0

    def __enter__(self) -> TensorOutput:
        return self

    def write(self, chunk: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.chunks.append(chunk[0])
        self.count += len(chunk[0])

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:
            checkpoint.atomic_save(torch.cat(self.chunks), self.path)  # type: ignore[arg-type]  # any torch.save object


class Counter(TensorOutput):
    """No --output (or not rank 0): the predictions are only counted."""

    def __init__(self) -> None:
        super().__init__("")

    def write(self, chunk: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.count += len(chunk[0])

    def __exit__(self, *exc_info: Any) -> None:
        pass


def output_for(args: argparse.Namespace, data: PredictionSet, is_main: bool) -> Any:
    if not is_main or args.output is None:
        return Counter()
    return (
        CsvOutput(args.output, data, args.topk) if args.output.endswith(".csv") else TensorOutput(args.output)
    )


# ---------------------------------------------------------------- the run
def predict(argv: Sequence[str] | None = None) -> None:
    """Parse, check, predict, write, and print the metrics on a labelled set."""
    args = parse_args(argv)
    check_arguments(args)
    state = sharded.load_whole(args.checkpoint, keys=("model",))  # a file, or a sharded folder's whole model
    config = prediction_config(args, state)
    check_text_model(args, config)
    runtime = setup(config)
    try:
        _predict(args, config, state, runtime)
    finally:
        teardown()


def _predict(args: argparse.Namespace, config: TrainConfig, state: dict[str, Any], runtime: Runtime) -> None:
    say = print if runtime.is_main else (lambda *_: None)
    if args.output is not None:  # on every rank, so all of them stop with the same line
        checkpoint.check_writable(os.path.dirname(os.path.abspath(args.output)), flag="--output")
    if not runtime.is_main:
        barrier()
    data = prediction_set(args, config, state, runtime)
    if runtime.is_main:
        barrier()
    if args.topk > data.num_classes:
        raise UsageError(f"--topk {args.topk} is more than the model's {data.num_classes} classes")
    model = load_model(config, data, state, args.checkpoint, runtime)
    amp = Amp(resolve_dtype(config.amp, runtime.device, say), runtime.device.type)
    assert config.eval_batch_size is not None  # --batch-size, else the checkpoint's (prediction_config)
    batch = config.eval_batch_size * max(1, len(runtime.dp_device_ids))
    say(
        f"{runtime.describe()}; checkpoint {args.checkpoint} (epoch {state['epoch']}), model {config.model_name}, "
        f"{len(data.data)} samples, batch {config.eval_batch_size} per device, amp {amp.name}"
        f"{', its EMA weights' if ema_weights(state) else ''}"
    )
    with output_for(args, data, runtime.is_main) as output:
        Predictor(runtime, amp, num_workers=config.num_workers).each_chunk(
            model, data.data, batch, output.write, everywhere=False, with_targets=True
        )
    say(f"predicted {output.count} samples" + (f", written to {args.output}" if args.output else ""))
    if data.labelled:
        # Through forward's signature, as in training: a model that takes the targets (gpt) gives its own loss.
        evaluator = Evaluator(
            runtime, amp, fitted_forward(model), nn.CrossEntropyLoss(), num_workers=config.num_workers
        )
        result = evaluator.run(model, data.data, batch)
        assert result is not None  # None only where a stop request ends it, and none is given
        say(metrics_line(result, args, state))


def metrics_line(result: dict[str, float], args: argparse.Namespace, state: dict[str, Any]) -> str:
    """The loss and every metric; on the checkpoint's own validation set, how they compare with what
    training recorded in the checkpoint."""
    names = [name for name in result if name != "count"]
    line = f"{args.split} set ({result['count']} samples): " + ", ".join(
        f"{name} {result[name]:.6g}" for name in names
    )
    recorded = {name: state.get("metrics", {}).get(f"val_{name}") for name in names}
    same_set = (
        args.split == "val"
        and args.imagefolder is None
        and all(
            getattr(args, name) is None
            for name in ("dataset", "data_dir", "data_file", "image_shape", "num_classes")
        )
    )
    if not same_set or None in recorded.values():
        return line
    if all(recorded[name] == result[name] for name in names):
        return f"{line}; the same as training recorded in this checkpoint"
    return f"{line}; training recorded {', '.join(f'{name} {value:.6g}' for name, value in recorded.items())}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: bad input is one line and exit 2, a failed run one line and exit 1."""
    return main_guarded(predict, sys.argv[1:] if argv is None else list(argv))


def cli() -> None:
    """The `multigpu-predict` console command (pip install .): the same as `python predict_multi_gpu.py`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
