"""`python -m multigpu.export CKPT OUT [--format pt|safetensors|hf]`: a checkpoint's weights where users load them.

- `pt` (OUT.pt): a sharded checkpoint folder (or a safetensors checkpoint) as the one
  `.pt` file rank 0's writer would have written: the whole model, the optimizer's state
  keyed by parameter name and the rest of the run, so training may also resume from it.
- `safetensors` (OUT.safetensors): the weights alone, under the plain module's names,
  tied weights once; above `--max-shard-size`, shards and `OUT.index.json` as Hugging
  Face writes them; `--dtype bf16` converts the floating-point tensors.
- `hf` (a folder): a transformers model's own `save_pretrained` folder, loadable by
  `AutoModel...from_pretrained(OUT)`; with `--tokenizer FOLDER` that folder's tokenizer
  too, so `AutoTokenizer.from_pretrained(OUT)` loads it (--export-on-end hf adds the run's).
- `adapter` (a folder): a LoRA run's adapters as peft saves them, for `PeftModel.from_pretrained(base, OUT)`.
  A LoRA checkpoint's `hf` and `safetensors` are its adapters merged into its base
  (multigpu/checkpoints/adapter_export.py).

The format follows OUT's name unless `--format` says it. From a file or a sharded
folder alike; one process reads the whole model (docs/checkpoints.md, "Weights in and out").
An OUT that exists is refused unless `--overwrite`, and is then replaced only once the new
export is complete; the checkpoint being read is never replaced.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch

from multigpu import safe_files
from multigpu.checkpoints import adapter_export, checkpoint, run_folders, sharded, tensor_files, weights
from multigpu.checkpoints.weights import INDEX_SUFFIX
from multigpu.config import OneLineParser
from multigpu.data.hf import last_line
from multigpu.errors import TrainingStopped, UsageError
from multigpu.parallel import lora
from multigpu.parallel.distributed import gather_objects

FORMATS = ("pt", "safetensors", "hf", "adapter")
DEFAULT_MAX_SHARD_SIZE = "5GB"  # Hugging Face's save_pretrained default


def format_of(out: str, given: str | None) -> str:
    """The format `--format` gives, else the one OUT's name says: .pt, .safetensors, or a folder (hf)."""
    if given:
        return given
    if out.endswith(".pt"):
        return "pt"
    if out.endswith(tensor_files.SUFFIX):
        return "safetensors"
    if os.path.isdir(out) or out.endswith("/") or not os.path.splitext(out)[1]:
        return "hf"
    raise UsageError(
        f"cannot tell the format from OUT {out}: name it .pt, .safetensors or a folder (hf), or give "
        f"--format {'|'.join(FORMATS)}"
    )


def export(
    source: str,
    out: str,
    kind: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
    tokenizer: str | None = None,
    overwrite: bool = False,
) -> str:
    """Write checkpoint `source`'s weights (or, `pt`, its whole state) to `out`; the line that says so.
    `tokenizer`: hf only, a folder whose tokenizer is saved beside the weights. `overwrite`: replace what is at
    `out` (else refused), once the new export is complete."""
    kind = format_of(out, kind)
    max_bytes = parse_size(max_shard_size)
    if tokenizer and kind != "hf":
        raise UsageError(
            f"--tokenizer is saved beside the weights of --format hf, and this export writes {kind}"
        )
    earlier = check_output(source, out, kind, overwrite)
    if kind == "pt":
        return _export_pt(source, out, dtype) + replaced(earlier)
    state = sharded.load_whole(source, keys=("model",))
    if adapter_export.is_adapter_checkpoint(state):
        return _export_adapters(state, source, out, kind, max_bytes, dtype, tokenizer) + replaced(earlier)
    if kind == adapter_export.ADAPTER:
        raise UsageError(
            f"--format adapter writes a LoRA run's adapters, and checkpoint {source} trained every weight: use "
            f"--format hf or safetensors"
        )
    tensors, which = weights.weights_of(state)
    tensors = in_dtype(tensors, weights.DTYPES[dtype] if dtype else None)
    info = state.get("model_info", {})
    checkpoint.check_writable(os.path.dirname(os.path.abspath(out.rstrip("/"))), flag="OUT")
    if kind == "hf":
        if not info.get("hf"):
            raise UsageError(
                f"--format hf writes a transformers model's own folder, and checkpoint {source} holds "
                f"another model (or was saved before it recorded its class): use --format safetensors"
            )
        written, padding = write_hf(
            info["hf"], tensors, out, max_bytes, weights.DTYPES[dtype] if dtype else None, tokenizer
        )
    else:
        if not out.endswith(tensor_files.SUFFIX):
            raise UsageError(
                f"--format safetensors writes a .safetensors file: name OUT like model.safetensors, got {out}"
            )
        written = write_safetensors(tensors, out, max_bytes, info.get("tied", {}))
        padding = ""
        remove_stale(
            earlier, written
        )  # the other layout's files (one file, or shards) would shadow the new one
    size = sum(os.path.getsize(path) for path in written if os.path.isfile(path))
    files = written[0] if len(written) == 1 else f"{out} ({len(written)} files)"
    return (
        f"exported {which} of {source} (step {state['global_step']}, {len(tensors)} tensors) to {files}: "
        f"{checkpoint.megabytes(size)}{replaced(earlier)}{padding}"
    )


def _export_adapters(
    state: dict[str, Any],
    source: str,
    out: str,
    kind: str,
    max_bytes: int,
    dtype: str | None,
    tokenizer: str | None,
) -> str:
    """A LoRA checkpoint's export: its adapters as a PEFT folder, or merged into its base (hf, safetensors)."""
    checkpoint.check_writable(os.path.dirname(os.path.abspath(out.rstrip("/"))), flag="OUT")
    record = state["adapters"]
    what = (
        f"the LoRA adapters (r {record['rank']} on {record['layers']} layers) of {source} "
        f"(step {state['global_step']})"
    )
    if kind == adapter_export.ADAPTER:
        written, _ = save_folder(adapter_export.adapted_model(state, source), out, max_bytes, None)
        return f"exported {what} to {out}, a PEFT adapter folder: {_size(written)}"
    merged = adapter_export.merged_model(state, source)
    to_dtype = weights.DTYPES[dtype] if dtype else None
    padding = ""
    if kind == "hf":
        written, padding = save_folder(merged, out, max_bytes, to_dtype, tokenizer)
    else:
        tensors = in_dtype(merged.state_dict(), to_dtype)
        written = write_safetensors(tensors, out, max_bytes, weights.tied_names(merged))
    return f"exported {what}, merged into its base {record['base']}, to {out}: {_size(written)}{padding}"


def _size(written: list[str]) -> str:
    return checkpoint.megabytes(sum(os.path.getsize(path) for path in written if os.path.isfile(path)))


def existing_outputs(out: str, kind: str) -> list[str]:
    """What an export to `out` would replace: the file, a non-empty folder (hf), or for safetensors also the
    shards and index of a sharded export of that name."""
    if kind in ("hf", adapter_export.ADAPTER) and os.path.isdir(out) and not os.path.islink(out.rstrip("/")):
        return [out] if os.listdir(out) else []
    found = [out.rstrip("/")] if os.path.lexists(out.rstrip("/")) else []
    if kind == "safetensors" and out.endswith(tensor_files.SUFFIX):
        stem = out.removesuffix(tensor_files.SUFFIX)
        found += sorted(glob.glob(glob.escape(stem) + f"-*-of-*{tensor_files.SUFFIX}"))
        found += [stem + INDEX_SUFFIX] if os.path.lexists(stem + INDEX_SUFFIX) else []
    return found


def check_output(source: str, out: str, kind: str, overwrite: bool) -> list[str]:
    """The files an export to `out` replaces; UsageError (one line) when there are any and not `overwrite`, and
    always when `out` is the checkpoint being read (its training state would be lost)."""
    if os.path.exists(out) and os.path.exists(source) and os.path.samefile(out, source):
        raise UsageError(
            f"OUT {out} is the checkpoint being read; refused even with --overwrite: choose another name"
        )
    earlier = existing_outputs(out, kind)
    if earlier and not overwrite:
        raise UsageError(
            f"OUT {earlier[0]} exists; add --overwrite to replace it (only once the export is "
            f"complete), or choose another name"
        )
    return earlier


def remove_stale(earlier: list[str], written: list[str]) -> None:
    """Delete the earlier export's files that this one did not rewrite (its shards or index, or its one file),
    now that the new export is complete."""
    for path in sorted(set(earlier) - set(written)):
        if os.path.lexists(path):
            safe_files.remove(path)


def replaced(earlier: list[str]) -> str:
    """The export line's note that it replaced an earlier export."""
    return f" (replaced the earlier {earlier[0]})" if earlier else ""


def _export_pt(source: str, out: str, dtype: str | None) -> str:
    """The sharded folder (or safetensors checkpoint) `source` as one .pt checkpoint file."""
    if dtype:
        raise UsageError(
            "--dtype converts weights for --format safetensors or hf; a .pt checkpoint keeps the "
            "run's own, to resume from"
        )
    if not os.path.isdir(source) and not source.endswith(tensor_files.SUFFIX):
        checkpoint.load(source)  # a missing file, or one that is no checkpoint, is refused for what it is
        raise UsageError(
            f"{source} is a .pt checkpoint already, and --format pt (OUT {out}) makes one of a sharded checkpoint "
            f"folder or a safetensors checkpoint; for its weights name OUT .safetensors or a folder (hf)"
        )
    if os.path.isdir(source) and not checkpoint.is_sharded(source):
        raise UsageError(
            f"{source} is not a sharded checkpoint folder (last/, best/, step-N/ of a run with "
            f"--checkpoint-format sharded): name one"
        )
    state = sharded.load_whole(source)
    checkpoint.check_writable(os.path.dirname(os.path.abspath(out)), flag="OUT.pt")
    checkpoint.atomic_save(state, out)
    return (
        f"exported {source} (step {state['global_step']}, {len(state['model'])} tensors) to {out}: "
        f"{checkpoint.megabytes(os.path.getsize(out))}"
    )


# --export-on-end's, in the save-dir
END_NAMES = {"safetensors": "best-weights.safetensors", "hf": "best-hf", "adapter": "best-adapter"}


# ---------------------------------------------------------------- writing weights
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """A size as Hugging Face writes max_shard_size: "5GB" (powers of 1000), "500MiB" (of 1024), or bytes."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--max-shard-size must be a size such as 5GB, 500MB or 2GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def in_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors in `dtype` (integer buffers, such as BatchNorm's counts, as they are)."""
    if dtype is None:
        return weights
    converted: dict[int, torch.Tensor] = {}  # tied names keep one tensor
    return {
        name: converted.setdefault(id(t), t.to(dtype)) if t.is_floating_point() else t
        for name, t in weights.items()
    }


def shard_names(out: str, count: int) -> list[str]:
    """Hugging Face's names of `count` shards of `out` (model.safetensors: model-00001-of-00003.safetensors)."""
    stem = out.removesuffix(tensor_files.SUFFIX)
    return [f"{stem}-{index:05d}-of-{count:05d}{tensor_files.SUFFIX}" for index in range(1, count + 1)]


def _shards(weights: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, in groups of at most `max_bytes` (a larger tensor alone), as Hugging Face splits."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


def write_safetensors(
    weights: dict[str, torch.Tensor], out: str, max_bytes: int, tied: dict[str, str]
) -> list[str]:
    """`weights` as the safetensors file `out`, or above `max_bytes` as shards beside it and their index
    (`<out>.index.json`, Hugging Face's layout, written last); the files written.

    The shards are written under temporary names first, so an earlier export of the same name stays whole while
    they are; then its index goes, the shards are renamed into place and the new index is written: a crash
    between leaves no index, never an index over old and new shards mixed."""
    kept, aliases = tensor_files.stored_once(weights, tied)
    total = sum(tensor.numel() * tensor.element_size() for tensor in kept.values())
    header = {tensor_files.TIED_KEY: json.dumps(aliases)} if aliases else {}
    groups = _shards(kept, max_bytes)
    if len(groups) == 1:
        tensor_files.save(kept, out, metadata=header)
        return [out]
    names = shard_names(out, len(groups))
    for name, group in zip(names, groups):
        tensor_files.save(group, name + safe_files.TMP_SUFFIX, metadata=header)
    index_path = out.removesuffix(tensor_files.SUFFIX) + INDEX_SUFFIX
    if os.path.lexists(index_path):
        safe_files.remove(index_path)
    for name in names:
        os.replace(name + safe_files.TMP_SUFFIX, name)
    index = {
        "metadata": {"total_size": total, **header},
        "weight_map": {key: os.path.basename(name) for name, group in zip(names, groups) for key in group},
    }
    safe_files.write_atomically(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, index_path]


def transformers_module(what: str) -> Any:
    """transformers, or UsageError naming the extra that brings it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise UsageError(
            f"{what} needs the transformers library, which is not installed: pip install '.[hf]'"
        ) from None


def rebuild_hf(info: dict[str, Any], weights: dict[str, torch.Tensor]) -> Any:
    """The transformers model (a PreTrainedModel, its class imported by name) a checkpoint's ModelInfo describes,
    holding `weights`."""
    transformers_module("--format hf")
    try:
        model_class = getattr(importlib.import_module(info["module"]), info["class"])
    except (ImportError, AttributeError):
        raise UsageError(
            f"--format hf: the model class {info['module']}.{info['class']} cannot be imported here"
        ) from None
    model = model_class(model_class.config_class.from_dict(info["config"]))
    model.load_state_dict(weights, strict=True)
    return model


def write_hf(
    info: dict[str, Any],
    weights: dict[str, torch.Tensor],
    out: str,
    max_bytes: int,
    dtype: torch.dtype | None,
    tokenizer: str | None = None,
) -> tuple[list[str], str]:
    """The model's own `save_pretrained` folder (config.json and safetensors) at `out`, with `tokenizer`'s
    files where a tokenizer folder is named, written into `<out>.tmp` and renamed into place whole; and the
    words of the export's line on the tokenizer's padding token (save_folder)."""
    return save_folder(rebuild_hf(info, weights), out, max_bytes, dtype, tokenizer)


def save_folder(
    model: Any, out: str, max_bytes: int, dtype: torch.dtype | None, tokenizer: str | None = None
) -> tuple[list[str], str]:
    """`model`'s own `save_pretrained` folder at `out` (a transformers model's, or a PeftModel's adapter folder),
    with `tokenizer`'s files where a tokenizer folder is named, written into `<out>.tmp` and renamed into place
    whole: the files written, and the words of the export's line on the tokenizer's padding token (given the
    end-of-text token where it had none, so that tokenizer(..., padding=True) works on the export as it did in
    the run)."""
    transformers = transformers_module("--format hf")
    transformers.utils.logging.disable_progress_bar()  # a bar for one file says nothing
    saved_tokenizer = (
        _tokenizer_of(transformers, tokenizer) if tokenizer else None
    )  # refused before any write
    if dtype is not None:
        model.to(dtype)
    tmp = out.rstrip("/") + safe_files.TMP_SUFFIX
    if os.path.lexists(tmp):
        safe_files.remove(tmp)
    if lora.is_adapted(model):
        model.save_pretrained(tmp)  # peft's adapter folder: the adapters alone, one small file
    else:
        model.save_pretrained(tmp, max_shard_size=max_bytes)
    padding = ""
    if saved_tokenizer is not None:
        if saved_tokenizer.pad_token is None and saved_tokenizer.eos_token is not None:
            saved_tokenizer.pad_token = saved_tokenizer.eos_token
            padding = (
                f"; its tokenizer pads with its end-of-text token {saved_tokenizer.eos_token} (it had no "
                f"padding token)"
            )
        saved_tokenizer.save_pretrained(tmp)
    safe_files.replace_folder(tmp, out.rstrip("/"))
    return sorted(os.path.join(out, name) for name in os.listdir(out)), padding


def _tokenizer_of(transformers: Any, folder: str) -> Any:
    """The tokenizer saved in `folder`, or UsageError naming it."""
    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 -- whatever keeps the folder from being a tokenizer
        raise UsageError(
            f"--tokenizer {folder} holds no tokenizer that transformers reads ({last_line(error)[:200]})"
        ) from None


class ExportOnEnd:
    """--export-on-end FORMAT as a built-in callback: once training has ended, rank 0 writes best's weights
    (last's, for a run without validation) beside the checkpoints, and for hf the run's `tokenizer` folder's
    tokenizer with them (--tokenizer, else --model-path's). A transformers model is required for hf: checked at
    the start, not after the training."""

    def __init__(self, kind: str, tokenizer: str | None = None):
        self.kind, self.tokenizer = kind, tokenizer if kind == "hf" else None

    def on_fit_start(self, trainer: Any) -> None:
        if self.kind == "hf" and weights.hf_model(trainer.model) is None:
            raise UsageError(
                "--export-on-end hf writes a transformers model's own folder, and this model is not a "
                "transformers PreTrainedModel: use --export-on-end safetensors"
            )
        adapters = trainer.adapters
        if self.kind == adapter_export.ADAPTER and adapters is None:
            raise UsageError(
                "--export-on-end adapter writes a LoRA run's adapters, and this run trains every weight: give "
                "--lora-r R, or --export-on-end hf or safetensors"
            )
        if adapters is not None and adapters.base is None:
            raise UsageError(
                f"--export-on-end {self.kind} of a LoRA run rebuilds the model from its base's folder, and this "
                f"run's base was not loaded from one: train from a model folder (--model hf --model-path)"
            )
        # Rank 0 writes the export, so it looks; every rank learns its verdict and stops alike.
        refusal = gather_objects(self._refusal(trainer) if trainer.runtime.is_main else None)[0]
        if refusal:
            raise UsageError(str(refusal))

    def _refusal(self, trainer: Any) -> str | None:
        """The refusal of a run whose end would replace an earlier export in its save-dir; None where there is
        none, or where this run may replace it: --overwrite, or the run continues the save-dir's own run (whose
        best only ever gets better)."""
        save_dir = trainer.checkpointer.save_dir
        earlier = existing_outputs(os.path.join(save_dir, END_NAMES[self.kind]), self.kind)
        resumed = trainer.checkpointer.last_saved
        continued = resumed is not None and os.path.samefile(
            os.path.dirname(os.path.abspath(resumed)), save_dir
        )
        if not earlier or trainer.config.overwrite or continued:
            return None
        return (
            f"--export-on-end {self.kind} would replace {earlier[0]}, an earlier export, when this run ends: add "
            f"--overwrite to replace it then, move it away, or choose another --save-dir"
        )

    def on_fit_end(self, trainer: Any) -> None:
        trainer.checkpointer.finish_saves()  # best/ may still be written in the background
        if not trainer.runtime.is_main:
            return
        save_dir = trainer.checkpointer.save_dir
        source = next(
            (
                path
                for name in ("best", "last")
                for path in run_folders.matching(
                    save_dir, tuple(name + suffix for suffix in run_folders.FILE_SUFFIXES), (name,)
                )
            ),
            None,
        )
        if source is None:
            raise TrainingStopped(f"--export-on-end: no best or last checkpoint in {save_dir} to export")
        try:  # an earlier export here was refused at the start, unless this run may replace it (on_fit_start)
            trainer.report.line(
                export(
                    source,
                    os.path.join(save_dir, END_NAMES[self.kind]),
                    self.kind,
                    tokenizer=self.tokenizer,
                    overwrite=True,
                )
            )
        except (UsageError, OSError) as error:
            raise TrainingStopped(
                f"--export-on-end {self.kind} failed ({error}); the checkpoints are kept"
            ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input is one line on stderr and exit 2."""
    parser = OneLineParser(prog="python -m multigpu.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a checkpoint: last.pt, best.safetensors, a sharded folder (best/) ..."
    )
    parser.add_argument("out", help="OUT.pt, OUT.safetensors, or a folder (hf; a LoRA run's: also adapter)")
    parser.add_argument("--format", choices=FORMATS, help="default: from OUT's name")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="larger weights are written as shards and an index, as Hugging Face does (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(weights.DTYPES),
        help="the floating-point weights in this type (default: as trained)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="hf: also save the tokenizer of this folder (a model "
        "folder, or a tokenizer's save_pretrained folder) into OUT",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUT, once the new export is complete (never the checkpoint being read)",
    )
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        print(
            export(
                args.checkpoint,
                args.out,
                args.format,
                args.max_shard_size,
                args.dtype,
                args.tokenizer,
                args.overwrite,
            )
        )
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
