"""Model weights in the formats users keep, read into a model (--init-from): a safetensors file or index, a
Hugging Face folder, a .pt weights file or a checkpoint (writing them: multigpu/checkpoints/export.py).

Weights here are the plain module's `state_dict` names: no `module.` (DDP),
`_orig_mod.` (torch.compile) or FSDP wrapper prefixes. Tied weights (one tensor
under two names, a GPT's embedding and output layer) are written once and their
other name recorded, and a model's own ties are honoured when loading: a file
that holds either name loads both (docs/checkpoints.md, "Weights in and out").
Nothing here unpickles code: .pt files load with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import warnings
from typing import Any, Callable

import torch

from multigpu.checkpoints import checkpoint, tensor_files
from multigpu.errors import UsageError
from multigpu.loop.callbacks import ema_weights
from multigpu.parallel import lora

INDEX_SUFFIX = ".safetensors.index.json"  # Hugging Face's name for the index of a sharded safetensors file
HF_WEIGHTS = ("model.safetensors", "model" + INDEX_SUFFIX, "pytorch_model.bin")  # a Hugging Face folder's
_WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (torch.compile's, FSDP1's, activation checkpointing's)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def plain_names(names: list[str]) -> dict[str, str]:
    """{plain name: name} for a file's names; DDP's `module.` goes when every name has it."""
    ddp = bool(names) and all(name.startswith("module.") for name in names)
    return {plain_name(name.removeprefix("module.") if ddp else name): name for name in names}


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for each parameter or buffer `model` holds under more than one name (tied weights)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in first:
            tied[plain_name(name)] = plain_name(first[id(tensor)])
        else:
            first[id(tensor)] = name
    return tied


# ---------------------------------------------------------------- what a checkpoint records of its model
def hf_model(model: torch.nn.Module) -> dict[str, Any] | None:
    """A transformers model's class and config (plain JSON), what `--format hf` rebuilds it from; None for
    any other model."""
    model = lora.base_of(getattr(model, "_orig_mod", model))  # a LoRA run's: the model its adapters are in
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    return {
        "module": type(model).__module__,
        "class": type(model).__name__,
        "config": json.loads(model.config.to_json_string(use_diff=False)),
    }


class ModelInfo:
    """What a checkpoint keeps of the model beside its weights (DCP's Stateful protocol, saved under
    "model_info"): its tied weights' names and, for a transformers model, its class and config."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"tied": tied_names(self.model), "hf": hf_model(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: the live model is what it describes."""


def weights_of(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """A checkpoint's weights, the ones its predictions use (the EMA's average when it kept one), and which."""
    average = ema_weights(state)
    if average is not None:
        return average, "the EMA's average (--ema-decay)"
    return state["model"], "the trained weights"


# ---------------------------------------------------------------- reading weights from any format
class Source:
    """Weights to read by name: a safetensors file or index, a Hugging Face folder, a .pt file or a checkpoint.
    `shapes` maps each plain name (tied aliases included) to its shape; `read` gives a tensor or a slice of it,
    reading no more of the file than asked."""

    def __init__(
        self,
        path: str,
        shapes: dict[str, tuple[int, ...]],
        read: Callable[[str, Any], torch.Tensor],
        describe: str,
    ):
        self.path, self.shapes, self.read, self.describe = path, shapes, read, describe
        self.dcp_folder: str | None = None  # a sharded checkpoint's: read through DCP, each rank its shards
        self.closers: list[Callable[[], None]] = []

    def close(self) -> None:
        for close in self.closers:
            close()


def _refusal(path: str, why: str) -> UsageError:
    return UsageError(f"--init-from {path} {why}")


def open_source(path: str) -> Source:
    """The weights at `path`, or UsageError (one line) when there are none: no such path, a file that holds
    no weights, or one that holds pickled code."""
    if not os.path.exists(path):
        raise _refusal(
            path,
            "does not exist: name a .safetensors file or index, a Hugging Face folder, a .pt "
            "weights file or a checkpoint",
        )
    if os.path.isdir(path):
        return _folder_source(path)
    if path.endswith(".json"):
        return _index_source(path)
    if tensor_files.is_safetensors(path) or checkpoint._file_kind(path) == checkpoint.SAFETENSORS_KIND:
        return _safetensors_source(path, [path])  # one cut short too: safetensors' reader says what is wrong
    return _torch_file_source(path)


def _folder_source(path: str) -> Source:
    if checkpoint.is_sharded(path):
        return _checkpoint_source(path, checkpoint.load(path), sharded=True)
    for name in HF_WEIGHTS:
        inside = os.path.join(path, name)
        if os.path.isfile(inside):
            return _index_source(inside) if name.endswith(".json") else open_source(inside)
    raise _refusal(
        path, f"is a folder without weights (no {', '.join(HF_WEIGHTS)}, nor a sharded checkpoint)"
    )


def _index_source(path: str) -> Source:
    try:
        with open(path, encoding="utf-8") as file:
            index = json.load(file)
        files = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise _refusal(path, "is not a safetensors index (a JSON file with a weight_map)") from None
    folder = os.path.dirname(path)
    missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise _refusal(path, f"names {missing[0]}, which is not beside it: an incomplete copy")
    return _safetensors_source(path, [os.path.join(folder, name) for name in files])


def _safetensors_source(path: str, files: list[str]) -> Source:
    tensor_files.library("--init-from")  # the extra's one line when it is missing
    from safetensors import safe_open

    where: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    stack = contextlib.ExitStack()
    prefix, describe = "", "safetensors"
    try:
        for name in files:
            handle = stack.enter_context(safe_open(name, framework="pt"))
            metadata = handle.metadata() or {}
            aliases.update(json.loads(metadata.get(tensor_files.TIED_KEY, "{}")))
            if (
                tensor_files.STATE_KEY in metadata
            ):  # a checkpoint (--checkpoint-format safetensors): its weights
                prefix, describe = _checkpoint_weights(json.loads(metadata[tensor_files.STATE_KEY]))
            for key in handle.keys():
                where[key] = handle
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    except Exception as error:  # safetensors' own error: a header cut short or not JSON
        stack.close()
        raise _refusal(path, f"cannot be read as safetensors ({str(error).splitlines()[0][:160]})") from None
    raw = plain_names([key.removeprefix(prefix) for key in shapes if key.startswith(prefix)])
    raw = {plain: prefix + name for plain, name in raw.items()}
    for alias, stored in aliases.items():
        if stored in shapes and alias.startswith(prefix):
            raw[alias.removeprefix(prefix)] = stored

    def read(plain: str, index: Any = None) -> torch.Tensor:
        name = raw[plain]
        if index is None or not shapes[name]:
            return where[name].get_tensor(name)
        return where[name].get_slice(name)[index]

    source = Source(path, {plain: shapes[name] for plain, name in raw.items()}, read, describe)
    source.closers.append(stack.close)
    return source


def _checkpoint_weights(state: dict[str, Any]) -> tuple[str, str]:
    """Where a safetensors checkpoint keeps the weights its predictions use (see weights_of): the prefix of their
    names in the file, and which they are."""
    if ema_weights(state) is not None:
        return "/callbacks/EMA/weights/", "a checkpoint (the EMA's average (--ema-decay))"
    return "/model/", "a checkpoint (the trained weights)"


def _torch_file_source(path: str) -> Source:
    """A torch.save file: a checkpoint, or a state_dict (or a dict holding one under "state_dict"/"model")."""
    kind = checkpoint._file_kind(path)
    if kind is not None:
        raise _refusal(
            path,
            f"holds no weights ({kind}): name a .safetensors file or index, a Hugging Face "
            f"folder, a .pt weights file or a checkpoint",
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="torch._weights_only_unpickler")
            try:  # mapped, not read: a rank reads only the slices it holds
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                loaded = torch.load(path, map_location="cpu", weights_only=True)  # the legacy format
    except pickle.UnpicklingError as error:
        raise _refusal(
            path,
            f"refused: {checkpoint.load_failure(error)}; it is not loaded, since that would "
            f"run code from the file",
        ) from None
    except Exception as error:
        raise _refusal(path, f"refused: {checkpoint.load_failure(error)}") from None
    if isinstance(loaded, dict) and all(key in loaded for key in checkpoint.REQUIRED_KEYS):
        return _checkpoint_source(path, loaded, sharded=False)
    tensors = _state_dict_in(loaded)
    if tensors is None:
        raise _refusal(path, 'holds no weights (no dict of tensors, nor one under "state_dict" or "model")')
    return _dict_source(path, tensors, {}, "a .pt weights file")


def _state_dict_in(loaded: Any) -> dict[str, torch.Tensor] | None:
    for candidate in (
        loaded,
        *(loaded.get(key) for key in ("state_dict", "model") if isinstance(loaded, dict)),
    ):
        if (
            isinstance(candidate, dict)
            and candidate
            and all(
                isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in candidate.items()
            )
        ):
            return candidate
    return None


def _checkpoint_source(path: str, state: dict[str, Any], sharded: bool) -> Source:
    if sharded and ema_weights(state) is None:  # DCP reads each rank's part of the shards
        return _dcp_source(path)
    tensors, which = weights_of(state)
    return _dict_source(path, tensors, state.get("model_info", {}).get("tied", {}), f"a checkpoint ({which})")


def _dict_source(path: str, tensors: dict[str, torch.Tensor], tied: dict[str, str], describe: str) -> Source:
    names = plain_names(list(tensors))
    full = {plain: tensors[name] for plain, name in names.items()}
    full = tensor_files.with_aliases(
        full, {alias: source for alias, source in tied.items() if alias not in full}
    )

    def read(plain: str, index: Any = None) -> torch.Tensor:
        return full[plain] if index is None else full[plain][index]

    return Source(path, {name: tuple(tensor.shape) for name, tensor in full.items()}, read, describe)


def _dcp_source(path: str) -> Source:
    from multigpu.checkpoints.dcp_metadata import check_complete

    metadata = check_complete(path).state_dict_metadata  # read without running code, its shard files checked
    shapes = {
        key.removeprefix("model."): tuple(entry.size)
        for key, entry in metadata.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }

    def unread(name: str, index: Any = None) -> torch.Tensor:
        return torch.empty(0)  # its tensors are read through DCP (dcp_folder), not by name

    source = Source(path, shapes, unread, "a sharded checkpoint")
    source.dcp_folder = path
    return source


# ---------------------------------------------------------------- --init-from: into a live model
def _match(
    model: torch.nn.Module, targets: dict[str, torch.Tensor], source: Source
) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """({model's name: the source's name} to load, missing, unexpected, of another shape). A name tied to
    another in the model is found under either."""
    groups: dict[str, list[str]] = {}
    for alias, name in tied_names(model).items():
        groups.setdefault(name, [name]).append(alias)
    group_of = {member: members for members in groups.values() for member in members}
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in targets:
        candidates = [name] + [other for other in group_of.get(name, []) if other != name]
        match = next((other for other in candidates if other in source.shapes), None)
        if match is None:
            missing.append(name)
        else:
            found[name] = match
    used = set(found.values()) | {member for name in found for member in group_of.get(name, [])}
    unexpected = [name for name in source.shapes if name not in targets and name not in used]
    mismatched = [name for name, match in found.items() if tuple(targets[name].shape) != source.shapes[match]]
    return (
        {name: match for name, match in found.items() if name not in mismatched},
        missing,
        unexpected,
        mismatched,
    )


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else "none"


def load_initial(model: torch.nn.Module, path: str, strict: bool, say: Callable[[str], None]) -> None:
    """--init-from: `path`'s weights into `model` (every rank calls this alike; a sharded model's ranks each
    read only the part of each tensor they hold). UsageError, before anything is loaded, when no tensor fits, or
    the names or shapes differ and `strict`; else what does not fit is said in one line each and left as
    initialised."""
    model = getattr(model, "_orig_mod", model)
    source = open_source(path)
    try:
        targets = model.state_dict()
        if lora.is_adapted(model):  # a LoRA run starts its adapters from the file; its base is --model-path's
            targets = lora.trainable_part(model, targets)
        found, missing, unexpected, mismatched = _match(model, targets, source)
        if targets and not found:  # strict or not: a fine-tune from nothing would be a run from scratch
            raise _refusal(
                path,
                f"has no tensor of this model's names and shapes (its first keys: "
                f"{_names(list(source.shapes))}; the model's: {_names(list(targets))}): nothing "
                f"would load, and the run would train from scratch; name weights of this model, or "
                f"drop --init-from to train from scratch",
            )
        if strict and (missing or unexpected or mismatched):
            raise _refusal(
                path,
                f"does not fit this model: {len(missing)} missing key(s) ({_names(missing)}), "
                f"{len(unexpected)} unexpected ({_names(unexpected)}), {len(mismatched)} of another "
                f"shape ({_names(mismatched)}); pass --init-strict false to load what fits",
            )
        with torch.no_grad():
            if source.dcp_folder is not None:
                _load_through_dcp(source.dcp_folder, {name: targets[name] for name in found}, found)
            else:
                for name, match in found.items():
                    _copy_into(targets[name], source, match)
    finally:
        source.close()
    say(
        f"--init-from {path}: {len(found)} tensors loaded from {source.describe} (weights only: the optimizer, "
        f"schedule and progress start afresh)"
    )
    if not strict:
        say(f"--init-from: {len(missing)} missing key(s), left as initialised: {_names(missing)}")
        say(f"--init-from: {len(unexpected)} unexpected key(s), not loaded: {_names(unexpected)}")
        say(
            f"--init-from: {len(mismatched)} key(s) of another shape, left as initialised: {_names(mismatched)}"
        )


def _copy_into(target: torch.Tensor, source: Source, name: str) -> None:
    """The source's tensor `name` into `target`: whole, or (a DTensor's) this rank's part of it only."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        local = target.to_local()  # FSDP's own storage of this rank's shard (no autograd here)
        if local.numel():
            local.copy_(
                source.read(name, tuple(slice(start, start + size) for start, size in zip(offset, shape)))
            )
        return
    target.copy_(source.read(name, None))


def _load_through_dcp(folder: str, targets: dict[str, torch.Tensor], found: dict[str, str]) -> None:
    """A sharded checkpoint's model tensors into `targets` with DCP: each rank reads the shards it holds."""
    from multigpu.checkpoints.sharded import load_entries

    load_entries({"model": {found[name]: tensor for name, tensor in targets.items()}}, folder)


class InitFrom:
    """--init-from as a built-in callback, ahead of the others (an EMA starts from the loaded weights): at the
    first fit() of a run that did not resume, every rank loads the weights; a resumed run keeps its
    checkpoint's instead."""

    def __init__(self, path: str, strict: bool):
        self.path, self.strict, self.done = path, strict, False

    def on_fit_start(self, trainer: Any) -> None:
        if self.done:
            return
        self.done = True
        if trainer.checkpointer.last_saved is not None:  # resumed: the checkpoint's weights go on training
            trainer.report.line(
                f"--init-from {self.path} not loaded: this run resumed from "
                f"{trainer.checkpointer.last_saved}, whose weights it continues"
            )
            return
        load_initial(trainer.model, self.path, self.strict, trainer.report.line)

    def state_dict(self) -> dict[str, Any]:
        return {"path": self.path}  # in the checkpoint: where the run's weights came from

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: a resumed run is told apart by the checkpoint it resumed from."""
