"""The settings a run was trained with, read from its checkpoint, and how a command's settings differ from them.

`--resume auto` without --save-dir continues the newest run folder whose
settings match the command (`run_folders.choose_run_dir`), and the launcher makes
the same choice before it runs anything. The launcher imports no torch, and a
choice must not read gigabytes of weights, so `saved_settings` reads only the
pickled part of a checkpoint (torch.save's zip archive keeps each tensor's bytes
in entries of their own) and builds no object it names: every class or function
in the pickle becomes an inert placeholder, so no code in the file runs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import struct
import zipfile
from typing import Any

from multigpu.config import AUTO, FIELDS, TrainConfig

# The groups of settings that decide what a run learns and how (multigpu/config.py).
RUN_GROUPS = ("data", "model", "optimisation")
# Those that may still differ in a command that continues the run: --epochs is the total, so continuing a run
# to more epochs is the point; the others change where data is read from, or how fast, not what is learned.
MAY_DIFFER = (
    "epochs",
    "data_dir",
    "download",
    "num_workers",
    "eval_batch_size",
    "compile",
    "channels_last",
    "autotune",
    "data_on_device",
)
# How one start of a run goes, never a setting of the run: a resume does not report them as changed.
START_ONLY = ("resume", "overwrite", "allow_low_disk")
# What a resume takes from its checkpoint where the command leaves them all out: a LoRA checkpoint holds the
# adapters alone, which fit only a model adapted as the run's was (multigpu/parallel/lora.py).
FROM_THE_CHECKPOINT = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "qlora")


class _Inert:
    """Whatever a checkpoint's pickle names (tensors, dtypes, storages): accepts any arguments, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _SettingsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return collections.OrderedDict if (module, name) == ("collections", "OrderedDict") else _Inert

    def persistent_load(self, pid: Any) -> None:
        return None  # a tensor's bytes: not read


# The header entry of a safetensors checkpoint (--checkpoint-format safetensors) that holds its trainer state
# as JSON (multigpu/checkpoints/tensor_files.py); read here as JSON alone, no tensor.
TRAINER_STATE_KEY = "multigpu.trainer_state"


def _safetensors_state(path: str) -> Any:
    """The trainer state in a safetensors checkpoint's header: 8 bytes of length, then the header's JSON."""
    with open(path, "rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        if length > 100 * 1024 * 1024:  # safetensors' own limit: no header is larger
            raise ValueError("not a safetensors header")
        return json.loads(json.loads(file.read(length))["__metadata__"][TRAINER_STATE_KEY])


def saved_settings(path: str) -> dict[str, Any] | None:
    """The `config` a checkpoint was saved with (TrainConfig.to_dict), or None when the file has none or cannot be
    read that way (not a torch.save zip archive nor a safetensors checkpoint, truncated, not written by this
    trainer)."""
    if not os.path.isfile(path):  # a named pipe would block the read for good
        return None
    try:
        if path.endswith(".safetensors"):
            state = _safetensors_state(path)
            config = state.get("config") if isinstance(state, dict) else None
            return config if isinstance(config, dict) else None
        with zipfile.ZipFile(path) as archive:
            name = next(entry for entry in archive.namelist() if entry.endswith("/data.pkl"))
            with archive.open(name) as data:
                state = _SettingsUnpickler(data).load()
    except (
        OSError,
        StopIteration,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        struct.error,
    ):
        return None
    config = state.get("config") if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None


def differences(saved: dict[str, Any], config: TrainConfig, also: tuple[str, ...] = ()) -> list[str]:
    """The settings that decide what a run learns (and `also` these) where `config` differs from the run's
    `saved` ones, as "name: saved -> command"; empty when the command continues that run (epochs may differ)."""
    taken = taken_from_the_checkpoint(config)
    names = [
        name
        for name, f in FIELDS.items()
        if f.metadata["group"] in RUN_GROUPS and name not in MAY_DIFFER and name not in taken
    ] + list(also)
    if config.batch_size == AUTO:  # found at start: any batch the run settled on may be what auto finds again
        names.remove("batch_size")
    return _changes(saved, config, names)


def changes(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """Every setting of the run that `config` changes, as "name: saved -> command" (a resume logs them)."""
    return _changes(saved, config, [name for name in FIELDS if name not in START_ONLY])


def _changes(saved: dict[str, Any], config: TrainConfig, names: list[str]) -> list[str]:
    # A name the saved config lacks was added after that run: nothing to compare.
    return [
        f"{name}: {saved[name]} -> {getattr(config, name)}"
        for name in names
        if name in saved and saved[name] != getattr(config, name)
    ]


def taken_from_the_checkpoint(config: TrainConfig) -> tuple[str, ...]:
    """FROM_THE_CHECKPOINT where `config` gives none of them (else none: the command's own hold)."""
    return () if set(FROM_THE_CHECKPOINT) & config.fields_given else FROM_THE_CHECKPOINT


def with_saved_adapters(config: TrainConfig, saved: dict[str, Any] | None) -> TrainConfig:
    """`config` with the LoRA settings of the `saved` config of the checkpoint it resumes, where the command gave
    none of them (its flags, `given`, kept)."""
    taken = taken_from_the_checkpoint(config)
    if not taken or not saved or not saved.get("lora_r"):
        return config
    adopted = dataclasses.replace(config, **{name: saved[name] for name in taken if name in saved})
    adopted.given = config.given  # type: ignore[misc]  # set per instance on purpose, as parse_config does
    return adopted
