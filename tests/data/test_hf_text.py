"""--dataset hf --text-column (data/hf_text.py): JSONL text tokenized by a model folder's tokenizer through
datasets.map, packed into run_clm's windows or padded per batch, map-style and streamed, on the tiny GPT-2 folder
of tests/conftest.py (`tiny_lm`: its JSONL rows hold "text" and "label")."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from multigpu.config import parse_config
from multigpu.data import build_datasets
from multigpu.errors import UsageError

BLOCK = 32


def _spec(tiny_lm: Path, *flags: str, files: Path | None = None):
    """The DataSpec of `files` (the tiny model's training text) at --block-size 32, and the config it was built
    from."""
    config = parse_config(
        [
            "--dataset",
            "hf",
            "--data-files",
            str(files or tiny_lm / "train.jsonl"),
            "--text-column",
            "text",
            "--model-path",
            str(tiny_lm / "model"),
            "--block-size",
            str(BLOCK),
            *flags,
        ]
    )
    return build_datasets(config), config


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def _token_stream(tiny_lm: Path) -> list[int]:
    """run_clm's stream of the training texts (400: one map batch): each text's ids and the end-of-text token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm / "model")
    return [
        i
        for text in _texts(tiny_lm / "train.jsonl")
        for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    ]


def test_packed_windows_are_the_token_stream_cut_into_block_size_windows(tiny_lm):
    spec, _ = _spec(tiny_lm, "--packing", "stream")
    stream = _token_stream(tiny_lm)
    assert len(spec.train) == len(stream) // BLOCK  # the remainder dropped
    sample = spec.train[3]
    assert sorted(sample) == ["attention_mask", "input_ids", "labels"]
    assert sample["input_ids"].tolist() == stream[3 * BLOCK : 4 * BLOCK]
    assert sample["labels"].tolist() == sample["input_ids"].tolist()  # the model shifts them itself
    assert sample["labels"].data_ptr() != sample["input_ids"].data_ptr()  # a copy
    assert sample["attention_mask"].tolist() == [1] * BLOCK
    assert spec.collate_fn is None and spec.input_shape == (BLOCK,) and spec.num_classes == 150


def test_tokenizing_is_cached_and_a_second_build_reuses_it(tiny_lm):
    first, _ = _spec(tiny_lm)
    cache = first.train.table.cache_files[0]["filename"]
    written = os.stat(cache).st_mtime_ns
    again, _ = _spec(tiny_lm)
    assert again.train.table.cache_files[0]["filename"] == cache and os.stat(cache).st_mtime_ns == written


def test_padded_batches_mask_the_padding_with_the_end_of_text_token(tiny_lm):
    spec, _ = _spec(tiny_lm, "--pad-to-batch")
    assert len(spec.train) == 400  # a text a sample
    samples = [spec.train[i] for i in range(3)]
    assert all(sorted(sample) == ["input_ids"] for sample in samples)
    lengths = [len(sample["input_ids"]) for sample in samples]
    assert len(set(lengths)) > 1 and max(lengths) <= BLOCK
    batch = spec.collate_fn(samples)
    assert batch["input_ids"].shape == (3, max(lengths))
    for row, length in enumerate(lengths):
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (max(lengths) - length)
        assert batch["labels"][row, :length].tolist() == samples[row]["input_ids"].tolist()
        assert set(batch["labels"][row, length:].tolist()) <= {-100}
        assert set(batch["input_ids"][row, length:].tolist()) <= {0}  # the tokenizer's end-of-text id pads


def test_a_classifier_pads_each_text_with_its_class(tiny_lm):
    spec, config = _spec(tiny_lm, "--num-classes", "2")
    assert config.text_classification and spec.num_classes == 2
    batch = spec.collate_fn([spec.train[i] for i in range(4)])
    rows = [json.loads(line) for line in (tiny_lm / "train.jsonl").read_text().splitlines()[:4]]
    assert batch["labels"].tolist() == [row["label"] for row in rows]  # one class a text, 1-D
    assert batch["input_ids"].shape[1] <= BLOCK


def test_a_stream_is_tokenized_and_packed_as_it_is_read(tiny_lm):
    windows, _ = _spec(tiny_lm, "--packing", "stream")
    stream, _ = _spec(tiny_lm, "--streaming", "--packing", "stream")
    read = [sample["input_ids"].tolist() for sample in stream.train]
    assert read == [windows.train[i]["input_ids"].tolist() for i in range(len(windows.train))]
    padded, _ = _spec(tiny_lm, "--streaming", "--pad-to-batch")
    assert len(padded.train) == 400  # a padded text is a sample: its length is the files' rows


@pytest.mark.parametrize(
    "rows, flags, message",
    [
        (
            [{"text": "the fox ."}, {"text": "a dog ."}, {"text": 5}],
            [],
            "row 3: column text holds int (5), not text; fix or remove it",
        ),
        (
            [{"text": "the fox ."}],
            ["--packing", "stream"],
            "hold fewer tokens than one window of --block-size 32; give more text or a smaller",
        ),
        ([{"body": "the fox ."}], [], "--text-column text: the files' columns are body; name the column"),
        (
            [{"text": "the fox .", "label": "fox"}],
            ["--label-column", "label"],
            "--label-column label holds str values",
        ),
    ],
)
def test_bad_text_files_are_one_line_naming_what_to_change(tiny_lm, tmp_path, rows, flags, message):
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match=re.escape(message)):
        _spec(tiny_lm, *flags, files=tmp_path / "bad.jsonl")
