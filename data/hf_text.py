"""--dataset hf --text-column COLUMN: files of text as the tokens of a transformers model (--model hf).

The tokenizer is --tokenizer's folder, else --model-path's own (TrainConfig.tokenizer_path); one without a
padding token pads with its end-of-text token, as run_clm's users set it. Before any row is tokenized, the
column is checked, and so is the fit with the model's config (--model-path's or --model-config's): every id
the tokenizer makes must index the model's embedding (len(tokenizer) <= vocab_size), and --block-size must fit
its positions (max_position_embeddings, GPT-2's n_positions).

Tokenized by `datasets.map(batched=True)`, cached in datasets' cache folder beside the files' own table, on
several processes for larger files (a process per ROWS_PER_PROCESS rows, at most one per core); rank 0
tokenizes first and the other ranks find its cache (multigpu/launch/runner.py). Then:

- a causal language model (the default): each text followed by the end-of-text token (where the tokenizer has
  one), packed into --block-size windows by data/packing.py (--packing documents: whole texts, each attending
  to itself alone; stream: the texts joined and cut, as run_clm groups them), the same windows whatever the
  number of map processes. With --pad-to-batch each text is a sample of its own, {"input_ids"} of at most
  --block-size tokens, and PadBatch pads each batch and adds the labels. Prompt/completion and chat data
  (--prompt-column, --messages-column) are texts with labels, -100 where a token does not count
  (data/instructions.py);
- a classifier (--num-classes or --label-column given): each text a sample {"input_ids", "labels": its class},
  at most --block-size tokens, padded per batch.

--streaming maps the files' stream the same way as it is read (data/hf.py splits it over ranks and workers),
each map batch packed as it comes. A packed stream's windows are not counted before they are read: its epoch is
one pass of steps unknown until it ends (give --max-steps or --steps-per-epoch for a schedule that needs them).
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

from . import instructions, tokenizer_check
from .hf import (
    Files,
    HFStream,
    HFTable,
    check_label,
    class_count,
    count_rows,
    files_of,
    first_row,
    import_datasets,
    import_transformers,
    last_line,
    load_files,
)
from .packing import PackedWindows, PackRows, TokenColumns, packing_of, window_sample

ROWS_PER_PROCESS = 1000  # datasets.map's batch: a process started for fewer rows costs more than it saves


def hf_text_datasets(
    config: TrainConfig,
) -> tuple[Dataset, Dataset | None, tuple[int, ...], int, Callable | None, list[str]]:
    """(train, val or None, a sample's shape (--block-size,), the vocabulary (a classifier's: its classes), the
    collate_fn that pads each batch or None for packed windows, the plan's lines on the text and its windows) of
    --dataset hf --text-column, --prompt-column/--completion-column or --messages-column."""
    datasets = import_datasets()
    model = model_config(config)
    tokenizer = load_tokenizer(config)
    check_fit(config, len(tokenizer), model)
    packed = not config.text_classification and not config.pad_to_batch
    collate_fn = None if packed else PadBatch(padding_id(config, tokenizer))
    words = instructions.TextWords(config, packing_of(config, model) if packed else None, tokenizer)
    if config.text_kind == "text":
        tokenize: Callable = Tokenize(tokenizer, config, packed)
    else:
        tokenize = instructions.tokenize_for(config, tokenizer, packed)
    assert config.data_files is not None  # --dataset hf without it is refused in TrainConfig
    train, table = _token_samples(datasets, "--data-files", config.data_files, config, tokenize, words)
    val = (
        _token_samples(datasets, "--val-files", config.val_files, config, tokenize, words)[0]
        if config.val_files
        else None
    )
    classes = class_count(config, table) if config.text_classification else len(tokenizer)
    return train, val, (config.block_size,), classes, collate_fn, words.lines(train, collate_fn)


def model_config(config: TrainConfig) -> Any:
    """The transformers config of --model-path's folder, or --model-config's folder or file; one line where the
    path holds none."""
    transformers = import_transformers("--model hf")
    flag, path = (
        ("--model-path", config.model_path) if config.model_path else ("--model-config", config.model_config)
    )
    assert path is not None  # --model hf without either is refused in TrainConfig
    if not os.path.exists(path):
        raise UsageError(
            f"{flag} {path}: no such file or folder; give a folder that a transformers model's "
            f"save_pretrained wrote"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(
            f"{flag} {path} is not a transformers model: it holds no config.json; give a folder that "
            f"a transformers model's save_pretrained wrote"
        )
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 -- transformers raises OSError, ValueError, KeyError ...
        raise UsageError(
            f"{flag} {path} is not a transformers model's config ({last_line(error)[:200]}); give "
            f"a folder that a transformers model's save_pretrained wrote"
        ) from None


def load_tokenizer(config: TrainConfig) -> Any:
    """--model hf's tokenizer (TrainConfig.tokenizer_path); one without a padding token pads with its
    end-of-text token."""
    transformers = import_transformers("--model hf")
    path = config.tokenizer_path
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 -- whatever keeps the folder from being a tokenizer
        raise UsageError(
            f"{_tokenizer_flag(config)} holds no tokenizer that transformers reads "
            f"({last_line(error)[:200]}); give --tokenizer FOLDER, a folder that a tokenizer's "
            f"save_pretrained wrote"
        ) from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_flag(config: TrainConfig) -> str:
    """Where the tokenizer comes from, as the user named it: --tokenizer FOLDER or --model-path FOLDER."""
    return f"--tokenizer {config.tokenizer}" if config.tokenizer else f"--model-path {config.model_path}"


def check_fit(config: TrainConfig, tokens: int, model: Any) -> None:
    """UsageError where the tokenizer's `tokens` ids do not all index the embedding of `model` (a transformers
    config), or --block-size is above its positions."""
    vocabulary = getattr(model, "vocab_size", None)
    if vocabulary is not None and tokens > vocabulary:
        raise UsageError(
            f"{_tokenizer_flag(config)}: the tokenizer has {tokens} tokens, more than the model's "
            f"vocabulary of {vocabulary} (vocab_size in its config): ids from {vocabulary} up would "
            f"index past its embedding; use the model's own tokenizer, or a model built for this one"
        )
    context = getattr(model, "max_position_embeddings", None)  # GPT-2's n_positions under its common name
    if context is not None and config.block_size > context:
        raise UsageError(
            f"--block-size {config.block_size} is above the model's context of {context} positions "
            f"(max_position_embeddings, GPT-2's n_positions, in its config): give --block-size "
            f"{context} or less"
        )


def padding_id(config: TrainConfig, tokenizer: Any) -> int:
    """The id padded batches are filled with; UsageError for a tokenizer with no padding or end-of-text token."""
    if tokenizer.pad_token_id is None:
        unless = "" if config.text_classification else " (or drop --pad-to-batch to pack the texts instead)"
        raise UsageError(
            f"{_tokenizer_flag(config)}: the tokenizer has neither a padding nor an end-of-text token "
            f"to pad batches with; give it a pad_token{unless}"
        )
    return tokenizer.pad_token_id


def _token_samples(
    datasets: Any,
    flag: str,
    patterns: str,
    config: TrainConfig,
    tokenize: Callable,
    words: instructions.TextWords,
) -> tuple[Dataset, Any]:
    """The samples of one flag's files, and the files as read (a label column's class names are there)."""
    files = Files(flag, *files_of(patterns, flag), rows=_row_check(config))
    table = load_files(datasets, files, config.streaming)
    first = first_row(table, files)
    check_columns(config, first)
    packing, validation = words.packing, flag == "--val-files"
    if config.text_kind == "text":  # instruction rows are checked by instructions.check_first_rows
        _check_first_rows(config, tokenize, table, flag)
    try:
        if (
            config.text_kind != "text"
        ):  # a template that counts nothing is refused before the files are mapped
            instructions.check_first_rows(config, tokenize, _first_rows(table, instructions.CHECKED_ROWS))
        tokens = table.map(tokenize, batched=True, remove_columns=list(first), **_processes(table, config))
        if packing is not None and config.streaming:
            tokens = tokens.map(PackRows(packing, config.block_size, words.pad_id, validation), batched=True)
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 -- a row the tokenizer cannot take: named by file and row
        raise UsageError(files.bad_row(None, error)) from None
    if config.text_kind == "text" and not config.streaming:  # a stream is tokenized as it is read
        _check_rows_kept(config, tokenize, table, tokens, flag)
    if config.streaming:  # a padded text is one sample; packed windows are not counted before they are read
        rows = [None if packing else count_rows(files.kind, [path]) for path in files.paths]
        return HFStream(tokens, window_sample if packing else TokenSamples(), rows, files), table
    if config.text_kind != "text" and not validation:
        uncounted = instructions.uncounted_rows(TokenColumns.of_table(tokens))
        words.warnings += instructions.uncounted_warning(config, flag, len(tokens), uncounted)
    if packing is not None:
        tokens = PackedWindows.of(tokens, packing, config.block_size, words.pad_id, keep_remainder=validation)
    if len(tokens) == 0:
        raise UsageError(
            f"{flag}: {', '.join(files.paths)} hold fewer tokens than one window of --block-size "
            f"{config.block_size}; give more text or a smaller --block-size"
        )
    if packing is not None:
        return tokens, table
    return HFTable(tokens, TokenSamples(), files), table


def _check_first_rows(config: TrainConfig, tokenize: Any, table: Any, flag: str) -> None:
    """UsageError where the tokenizer makes (almost) nothing of the files' first rows (data/tokenizer_check.py)."""
    texts = _first_rows(table, tokenizer_check.FIRST_ROWS)[tokenize.column]
    words = [text for text in texts if isinstance(text, str)]
    tokenizer_check.check_first_rows(tokenize.tokenizer, words, _tokenizer_flag(config), flag)


def _check_rows_kept(config: TrainConfig, tokenize: Any, table: Any, tokens: Any, flag: str) -> None:
    """UsageError where most of a tokenized table's rows with text became no token (data/tokenizer_check.py)."""
    texts = table.data.column(tokenize.column)
    ended = tokenize.end is not None  # each text's ids end in an end-of-text token the tokenizer did not make
    tokenizer_check.check_rows_kept(
        texts, tokens.data.column("input_ids"), ended, _tokenizer_flag(config), flag
    )


def _row_check(config: TrainConfig) -> Callable[[dict[str, Any]], None]:
    """What each row as read must pass: text in --text-column, or the instruction columns' own."""
    return TextRows(config) if config.text_kind == "text" else instructions.InstructionRows(config)


def _first_rows(table: Any, count: int) -> dict[str, list]:
    """The first `count` rows of a table or a stream, as a map batch (a dict of columns)."""
    rows = list(itertools.islice(iter(table), count))
    return {name: [row[name] for row in rows] for name in rows[0]}


def _processes(table: Any, config: TrainConfig) -> dict[str, Any]:
    """datasets.map's num_proc for `table`: a process per ROWS_PER_PROCESS rows, at most one per core (a stream
    is mapped as it is read, in its reader's process)."""
    if config.streaming:
        return {}
    processes = min(os.cpu_count() or 1, len(table) // ROWS_PER_PROCESS)
    return {"num_proc": processes} if processes > 1 else {}


def check_columns(config: TrainConfig, example: dict[str, Any]) -> None:
    """UsageError where the files' first row has no text in --text-column (or, for a classifier, no class id in
    --label-column), or lacks the columns of prompt/completion or chat data (data/instructions.py)."""
    if config.text_kind != "text":
        return instructions.check_columns(config, example)
    if config.text_column not in example:
        raise UsageError(
            f"--text-column {config.text_column}: the files' columns are {', '.join(example)}; name "
            f"the column that holds each sample's text"
        )
    if config.text_classification:
        check_label(config, example)
    try:
        TextRows(config)(example)
    except ValueError as error:
        raise UsageError(
            f"--text-column {config.text_column}: the first row's {error}; name the column that "
            f"holds each sample's text"
        ) from None


class TextRows:
    """What each row as read must hold: text in --text-column (and, for a classifier, an integer class id in
    --label-column); a ValueError saying what it holds instead (Files.bad_row names the row)."""

    def __init__(self, config: TrainConfig):
        assert config.text_column is not None  # data/hf_text.py serves --text-column only
        self.column = config.text_column
        self.label_column = config.label_column if config.text_classification else None

    def __call__(self, example: dict[str, Any]) -> None:
        text = example.get(self.column)
        if not isinstance(text, str):
            raise ValueError(f"column {self.column} holds {type(text).__name__} ({text!r:.40}), not text")
        label = example.get(self.label_column) if self.label_column else 0
        if isinstance(label, bool) or not isinstance(label, int):
            raise ValueError(
                f"column {self.label_column} holds {type(label).__name__} ({label!r:.40}), not a class id"
            )


class Tokenize:
    """datasets.map's function: a batch of rows as their token ids; a packed text ends in the end-of-text token,
    a padded one keeps at most --block-size tokens, a classifier's keeps its class as "labels"."""

    def __init__(self, tokenizer: Any, config: TrainConfig, packed: bool):
        assert config.text_column is not None  # data/hf_text.py serves --text-column only
        self.tokenizer, self.column, self.packed = tokenizer, config.text_column, packed
        self.max_length = None if packed else config.block_size
        self.end = (
            tokenizer.eos_token_id if packed else None
        )  # one text's end, and the next one's start, marked
        self.label_column = config.label_column if config.text_classification else None

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        ids = self.tokenizer(
            batch[self.column], truncation=self.max_length is not None, max_length=self.max_length
        )["input_ids"]
        if self.end is not None:
            ids = [text + [self.end] for text in ids]
        if self.label_column is None:
            return {"input_ids": ids}
        return {"input_ids": ids, "labels": batch[self.label_column]}


class TokenSamples:
    """A tokenized row as the trainer's sample (the module docstring): a padded text's ids (PadBatch adds the
    rest), with the labels of an instruction row (-100 where a token does not count) or a classifier's class."""

    def __call__(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        ids = torch.tensor(example["input_ids"], dtype=torch.long)
        if "labels" in example:
            return {"input_ids": ids, "labels": torch.tensor(example["labels"], dtype=torch.long)}
        return {"input_ids": ids}


class PadBatch:
    """The collate_fn of padded texts: each batch padded at the end to its longest sample, input_ids with the
    padding token and attention_mask 0 there; a causal language model's labels are its ids (an instruction row's
    own labels) with -100 (no loss) there, a classifier's its samples' classes."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(
            1, max(len(sample["input_ids"]) for sample in samples)
        )  # a batch of empty texts: one pad
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            input_ids[row, : len(sample["input_ids"])] = sample["input_ids"]
            attention_mask[row, : len(sample["input_ids"])] = 1
        if "labels" in samples[0] and samples[0]["labels"].dim() == 0:  # a classifier's: one class a text
            labels = torch.stack([sample["labels"] for sample in samples])
        elif "labels" in samples[0]:  # an instruction row's: its own, -100 on the padding too
            labels = torch.full_like(input_ids, -100)
            for row, sample in enumerate(samples):
                labels[row, : len(sample["labels"])] = sample["labels"]
        else:
            labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
