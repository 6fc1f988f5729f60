"""--dataset hf: local files read through Hugging Face `datasets` (the optional extra: pip install -e '.[hf]').

`--data-files` (and `--val-files`) name Parquet, JSON Lines/JSON, CSV or text files by glob; the format comes
from the extension. Each sample's input is `--input-column` (a list of numbers, reshaped to --image-shape, or
flat with --mode flatten; or an image, turned into a tensor) and its class `--label-column`. Strings are
refused: the built-in models read numbers, so tokenize text into a column of numbers first (--dataset text
reads characters of one plain file).

Map-style by default: the whole table, the trainer's sampler splits it over ranks. With `--streaming` the
files are read as they are consumed: an HF IterableDataset that `datasets.distributed.split_dataset_by_node`
splits over ranks (whole files per rank when their number divides by the world size, else every rank keeps
one sample in world-size) and that splits its files over each rank's DataLoader workers itself, so the trainer
takes it as a stream that shards itself (data/streaming.py: the uneven ends, the exact resume at the same
layout). Its length, counted from the files (Parquet metadata; lines of the others), sizes an epoch as one pass.

A row that cannot be read (broken JSON, a number count that does not fit the shape) is one line naming its
file and row, said by the rank (or the loader worker's rank) that met it; so is a set of files with no rows.

Only local files are read: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set, so no network is tried.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, IterableDataset

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

from .files import UnreadableFile

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text"}
INPUT_COLUMNS = ("image", "pixels", "x", "features", "input")  # tried in order without --input-column
INSTALL = "pip install -e '.[hf]' from the checkout"


def import_datasets(module: str = "datasets") -> Any:
    """The `datasets` library, or UsageError saying what to install (`module`: its import name)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a network round trip
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        library = __import__(module)
    except ImportError:
        raise UsageError(
            f"--dataset hf needs the Hugging Face datasets library, which is not installed: "
            f"{INSTALL} (or pip install datasets)"
        ) from None
    # Its progress bars and notes ("Too many dataloader workers ...: stopping 1", when a rank's files are fewer
    # than its workers: harmless, the others read them) would print on every rank, and its error logs ("Failed
    # to load JSON from file ...") beside the one line each of its errors becomes here (Files.bad_row).
    library.disable_progress_bars()
    library.logging.set_verbosity(library.logging.CRITICAL)
    return library


def import_transformers(what: str) -> Any:
    """The `transformers` library, quiet and offline, or UsageError saying that `what` needs it and what to
    install."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never a network round trip
    # Tokenizing runs in datasets.map's processes (num_proc) and loader workers, not in the tokenizer's threads,
    # which a fork would leave behind with a warning on every rank.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torchao (the [float8] extra), which transformers imports where it is installed, registers enums with torch's
    # pytree, and torch 2.14 logs a deprecation for each, on every rank: nothing the user can act on.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        import transformers
    except ImportError:
        raise UsageError(
            f"{what} needs the Hugging Face transformers library, which is not installed: "
            f"{INSTALL} (or pip install transformers)"
        ) from None
    # Its progress bars ("Loading weights") and notes (newly initialised heads, long texts that packing cuts)
    # would print on every rank.
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def files_of(patterns: str, flag: str) -> tuple[str, list[str]]:
    """The files `patterns` (comma-separated globs) match, and their one format; UsageError naming the flag when
    none match or the extensions mix or are unknown."""
    files = sorted(
        {
            path
            for pattern in patterns.split(",")
            if pattern.strip()
            for path in glob.glob(os.path.expanduser(pattern.strip()), recursive=True)
            if os.path.isfile(path)
        }
    )
    if not files:
        raise UsageError(
            f"{flag} {patterns!r} matches no file; give a path or glob of local .parquet, .jsonl, "
            f".json, .csv or .txt files"
        )
    kinds = {os.path.splitext(path)[1].lower() for path in files}
    unknown = sorted(kinds - set(FORMATS))
    if unknown or len({FORMATS[kind] for kind in kinds}) > 1:
        raise UsageError(
            f"{flag} {patterns!r} matches files of {', '.join(sorted(kinds))}: give files of one "
            f"format, .parquet, .jsonl/.json, .csv or .txt"
        )
    return FORMATS[kinds.pop()], files


def count_rows(kind: str, files: list[str]) -> int | None:
    """Rows in `files` without reading them as a table: Parquet's metadata, or lines; None for a .json file,
    which may hold one array."""
    if kind == "parquet":
        import pyarrow.parquet as parquet

        return sum(parquet.ParquetFile(path).metadata.num_rows for path in files)
    if any(path.lower().endswith(".json") for path in files):
        return None
    rows = 0
    for path in files:
        with open(path, "rb") as lines:
            rows += sum(1 for line in lines if line.strip()) - (1 if kind == "csv" else 0)  # a CSV's header
    return rows


# A row (a dict of columns) made the trainer's sample: HFSamples below, or data/hf_text.py's TokenSamples.
SampleOf = Callable[[dict[str, Any]], dict[str, Any]]


class HFSamples:
    """Turns one HF example (a dict of columns) into the trainer's sample: {"x": input, "y": class}, plus the
    `keep` columns as they are (an id a model records, say)."""

    def __init__(
        self, input_column: str, label_column: str, shape: tuple[int, ...] | None, keep: tuple[str, ...] = ()
    ):
        self.input_column, self.label_column, self.shape, self.keep = input_column, label_column, shape, keep
        self.numbers = math.prod(shape) if shape is not None else 0  # what each input must hold

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        value = example[self.input_column]
        if hasattr(value, "convert"):  # a PIL image
            import torchvision.transforms.functional as functional

            x = functional.to_tensor(value)
        else:
            x = torch.as_tensor(value, dtype=torch.float32)
        if self.shape is not None:
            if (
                self.numbers > 0 and x.numel() != self.numbers
            ):  # (-1,): an image, flattened, whatever its size
                raise ValueError(
                    f"its column {self.input_column} holds {x.numel()} numbers, and a sample needs "
                    f"{self.numbers}"
                )
            x = x.reshape(self.shape)
        return {
            "x": x,
            "y": torch.as_tensor(example[self.label_column], dtype=torch.long),
            **{name: example[name] for name in self.keep},
        }


class Files:
    """The files of one flag (--data-files or --val-files) and their format: what a bad row's line names.
    `rows`: what each row as read must pass, where samples are made from rows changed first (tokenized text);
    None: the samples themselves."""

    def __init__(self, flag: str, kind: str, paths: list[str], rows: Any | None = None):
        self.flag, self.kind, self.paths, self.rows = flag, kind, paths, rows

    def bad_row(self, samples: SampleOf | None, error: BaseException) -> str:
        """One line for `error`, met reading these files: the first row of them that cannot be read or made a
        sample, by file and row (1 = the first data row; a JSON Lines file's row is its line), and how to go on.
        Found by reading the files again, one at a time: only on this error's path."""
        where = self._first_bad_row(samples) or f"{', '.join(self.paths)}: {last_line(error)}"
        return (
            f"{self.flag}: {where}; fix or remove it (--resume auto then continues from the last checkpoint)"
        )

    def _first_bad_row(self, samples: SampleOf | None) -> str | None:
        datasets, samples = import_datasets(), self.rows or samples
        for path in self.paths:
            broken = _broken_json(path) if self.kind == "json" else None
            if broken:
                return broken
            try:
                rows = datasets.load_dataset(self.kind, data_files=[path], split="train", streaming=True)
                for row, example in enumerate(rows, 1):
                    try:
                        if samples is not None:
                            samples(example)
                    except Exception as error:  # noqa: BLE001 -- whatever makes a row unusable is named
                        return f"{path} row {row}: {last_line(error)}"
            except Exception as error:  # noqa: BLE001 -- the file itself does not read
                return f"{path} cannot be read: {last_line(error)}"
        return None


def _broken_json(path: str) -> str | None:
    """'<path> row N is not valid JSON (why)' for the first such line of a JSON Lines file (a .json file: the
    line where its document breaks), else None."""
    with open(path, encoding="utf-8", errors="replace") as text:
        if not path.lower().endswith(".jsonl"):
            try:
                json.load(text)
            except json.JSONDecodeError as error:
                return f"{path} line {error.lineno} is not valid JSON ({error.msg})"
            return None
        for row, line in enumerate(text, 1):
            try:
                if line.strip():
                    json.loads(line.rstrip())
            except json.JSONDecodeError as error:
                return f"{path} row {row} is not valid JSON ({error.msg} at column {error.colno})"
    return None


def last_line(error: BaseException) -> str:
    """The last line of an error's message (a library's own long story ends in what went wrong), or its type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


class HFTable(Dataset):
    """A map-style HF Dataset as the trainer's samples (the sampler splits it over ranks)."""

    def __init__(self, table: Any, samples: SampleOf, files: Files):
        self.table, self.samples, self.files = table, samples, files

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            return self.samples(self.table[int(index)])
        except Exception as error:  # a row the checks at start could not see: named, not a traceback
            raise UnreadableFile(self.files.bad_row(self.samples, error)) from None


class HFStream(IterableDataset):
    """A streaming HF IterableDataset as the trainer's samples: this rank's part (split_dataset_by_node, by the
    RANK and WORLD_SIZE torchrun sets, which DataLoader workers inherit), split over the workers by HF itself.
    Where the ranks that run out cannot join the others' steps (`ranks_join`, which the trainer sets: fsdp), and
    the files are not all of one length, every rank keeps one example in world-size of its workers' files instead
    of whole files: whole files of unequal length would leave the longer ranks' tails untrained."""

    shards_itself = True  # data/streaming.py takes what each (rank, worker) yields

    def __init__(self, stream: Any, samples: SampleOf, rows: list[int | None], files: Files):
        self.stream, self.samples, self.files = stream, samples, files
        self.length = None if None in rows else sum(rows)  # type: ignore[arg-type]
        self.equal_files = None not in rows and len(set(rows)) == 1
        self.ranks_join = True  # set by the trainer (data/stream_split.py) before it reads the stream

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this stream's length is not counted")  # streaming.stream_length reads None
        return self.length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from datasets.distributed import split_dataset_by_node

        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        by_example = world_size > 1 and not self.ranks_join and not self.equal_files
        try:
            # By example: each rank reads every one of its workers' files and keeps every world-size-th row.
            if by_example:
                for index, example in enumerate(self.stream):
                    if index % world_size == rank:
                        yield self.samples(example)
                return
            for example in split_dataset_by_node(self.stream, rank=rank, world_size=world_size):
                yield self.samples(example)
        except Exception as error:  # in a loader worker too: UnreadableFile reaches the rank as its one line
            raise UnreadableFile(self.files.bad_row(self.samples, error)) from None


def hf_datasets(
    config: TrainConfig, keep: tuple[str, ...] = ()
) -> tuple[Dataset, Dataset | None, tuple[int, ...], int]:
    """(train, val or None, one input's shape, classes) of --dataset hf; `keep`: columns passed on as they are."""
    datasets = import_datasets()
    kind, paths = files_of(config.data_files or "", "--data-files")
    files = Files("--data-files", kind, paths)
    train = load_files(datasets, files, config.streaming)
    first = first_row(train, files)
    input_column = _input_column(config, first)
    check_label(config, first)
    shape = _shape(config, first[input_column], input_column)
    samples = HFSamples(input_column, config.label_column, shape, keep)
    classes = class_count(config, train)
    sample_shape = tuple(samples(first)["x"].shape)

    def wrap(table: Any, of: Files) -> Dataset:  # each flag's files counted in their own format
        if config.streaming:
            return HFStream(table, samples, [count_rows(of.kind, [path]) for path in of.paths], of)
        return HFTable(table, samples, of)

    val = None
    if config.val_files:
        val_files = Files("--val-files", *files_of(config.val_files, "--val-files"))
        val = wrap(load_files(datasets, val_files, config.streaming), val_files)
    return wrap(train, files), val, sample_shape, classes


def load_files(datasets: Any, files: Files, streaming: bool) -> Any:
    """load_dataset of `files`; a set without rows, or a row that breaks the load, is one line."""
    try:
        return datasets.load_dataset(files.kind, data_files=files.paths, split="train", streaming=streaming)
    except Exception as error:  # noqa: BLE001 -- datasets raises what its readers raise
        try:
            empty = count_rows(files.kind, files.paths) == 0
        except Exception:  # noqa: BLE001 -- a file that does not even count: bad_row names it
            empty = False
        raise (_no_rows(files) if empty else UsageError(files.bad_row(None, error))) from None


def first_row(table: Any, files: Files) -> dict[str, Any]:
    """The first row of `files`, read; one line when there is none, or it does not read."""
    try:
        return next(iter(table))
    except StopIteration:
        raise _no_rows(files) from None
    except Exception as error:  # noqa: BLE001 -- a first row that does not read
        raise UsageError(files.bad_row(None, error)) from None


def _no_rows(files: Files) -> UsageError:
    return UsageError(f"{files.flag}: {', '.join(files.paths)} hold no rows; give files with data")


def _input_column(config: TrainConfig, example: dict[str, Any]) -> str:
    column = config.input_column or next((name for name in INPUT_COLUMNS if name in example), None)
    if column is None or column not in example:
        raise UsageError(
            f"--input-column {column or '(not given)'}: the files' columns are "
            f"{', '.join(example)}; name the column that holds each sample's input"
        )
    if isinstance(example[column], str):
        raise UsageError(
            f"--input-column {column} holds text; the built-in models read numbers or images: for "
            f"a transformers model give --text-column {column} --model-path FOLDER (or, for "
            f"characters of one plain file, use --dataset text --data-file FILE)"
        )
    return column


def check_label(config: TrainConfig, example: dict[str, Any]) -> None:
    """UsageError where `example` has no --label-column, or holds something else than an integer class id there."""
    label = example.get(config.label_column)
    if config.label_column not in example:
        raise UsageError(
            f"--label-column {config.label_column}: the files' columns are {', '.join(example)}; name "
            f"the column that holds each sample's class"
        )
    if isinstance(label, bool) or not isinstance(label, int):
        raise UsageError(
            f"--label-column {config.label_column} holds {type(label).__name__} values ({label!r}); "
            f"it must hold integer class ids 0..N-1"
        )


def class_count(config: TrainConfig, table: Any) -> int:
    """The classes of --label-column: the names of its ClassLabel feature, else --num-classes."""
    label_feature: Any = (table.features or {}).get(config.label_column)
    return len(label_feature.names) if hasattr(label_feature, "names") else config.num_classes


def _shape(config: TrainConfig, value: Any, column: str) -> tuple[int, ...] | None:
    """How a numeric input is reshaped: to --image-shape (--mode image) or flat (--mode flatten); None keeps an
    image as its tensor is (flattened under --mode flatten)."""
    if hasattr(value, "convert"):
        return (-1,) if config.mode == "flatten" else None
    count = torch.as_tensor(value, dtype=torch.float32).numel()
    if config.mode == "flatten":
        return (count,)
    dims = config.image_dims()
    if dims[0] * dims[1] * dims[2] != count:
        raise UsageError(
            f"--input-column {column} holds {count} numbers per sample; --mode image reads them as "
            f"--image-shape {config.image_shape} ({dims[0] * dims[1] * dims[2]}): give an --image-shape "
            f"C,H,W whose product is {count}, or --mode flatten --model mlp"
        )
    return dims
