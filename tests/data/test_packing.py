"""--packing (data/packing.py): whole documents packed best-fit decreasing into windows in which each attends to
itself alone (a packed document's logits are its logits alone, for GPT-2 and a Llama-style model, under sdpa and
eager attention), long documents cut into pieces whose targets cover every token once, the stream cut as run_clm
cuts it, and the same windows whatever the number of tokenizing processes and the state of datasets' cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_gpt2
from multigpu.config import parse_config
from multigpu.data import build_datasets, hf_text
from multigpu.data.packing import (
    IGNORE_INDEX,
    Plan,
    TokenColumns,
    assemble,
    best_fit_decreasing,
    keep_documents_apart,
)

VOCAB = 32


def tiny_llama() -> torch.nn.Module:
    """A Llama-style causal LM (rotary positions, grouped-query attention) from a config: 2 layers of width 16."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config)


def _documents(lengths: list[int]) -> list[list[int]]:
    draw = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (length,), generator=draw).tolist() for length in lengths]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_a_packed_documents_logits_are_its_logits_alone(build, implementation):
    documents = _documents([5, 3, 9, 2, 7, 4, 6])
    tokens = TokenColumns.of_lists(documents, None)
    plan = Plan.of_documents(tokens.starts, tokens.lengths, 16)
    windows = [assemble(tokens, plan.window(w), 16, True, 0) for w in range(len(plan))]
    batch = {
        name: torch.tensor(np.stack([w[name] for w in windows])) for name in ("input_ids", "position_ids")
    }
    model = build().eval()
    model.set_attn_implementation(implementation)
    keep_documents_apart(model)
    with torch.no_grad():
        packed = model(**batch).logits
        worst = 0.0
        for w in range(len(plan)):
            at = 0
            for start, stop in plan.window(w).tolist():
                alone = model(input_ids=torch.from_numpy(tokens.take(False, start, stop))[None]).logits[0]
                worst = max(worst, (packed[w, at : at + stop - start] - alone).abs().max().item())
                at += stop - start
    assert len(plan) < len(documents) and worst <= 1e-5, worst  # packed together, and each apart
    hook = model._forward_pre_hooks.popitem()  # without the mask the documents see each other: a real switch
    with torch.no_grad():
        mixed = model(**batch).logits
    assert hook and (mixed - packed).abs().max().item() > 1e-3


def test_best_fit_decreasing_places_every_item_once_in_bins_it_fits():
    draw = np.random.default_rng(0)
    lengths = draw.integers(1, 60, 300).tolist()
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(item for window in bins for item in window) == list(range(300))
    assert all(sum(lengths[item] for item in window) <= 64 for window in bins)
    assert len(bins) <= sum(lengths) / 64 * 1.1 + 1  # nearly full: the longest first, each where it fits best
    assert bins == best_fit_decreasing(lengths, 64)  # deterministic
    assert best_fit_decreasing([5, 2, 3, 1, 4, 4], 6) == [[0, 3], [4, 1], [5], [2]]


def test_a_long_document_is_cut_into_pieces_that_predict_each_token_once():
    tokens = TokenColumns.of_lists([list(range(1, 4)), list(range(10, 20))], None)
    plan = Plan.of_documents(tokens.starts, tokens.lengths, 4)
    targets = []
    for w in range(len(plan)):
        window = assemble(tokens, plan.window(w), 4, True, 0)
        assert window["position_ids"][0] == 0 and window["labels"][0] == IGNORE_INDEX
        targets += [int(label) for label in window["labels"] if label != IGNORE_INDEX]
    assert sorted(targets) == [2, 3, *range(11, 20)]  # every token but each document's first, once


def test_the_stream_is_cut_as_run_clm_cuts_it_and_validation_keeps_its_remainder():
    tokens = TokenColumns.of_lists([[1, 2, 3], [4, 5, 6, 7, 8]], None)
    train = Plan.of_stream(tokens.total, 3, keep_remainder=False)
    assert [
        assemble(tokens, train.window(w), 3, False, 0)["input_ids"].tolist() for w in range(len(train))
    ] == [
        [1, 2, 3],
        [4, 5, 6],
    ]
    val = Plan.of_stream(tokens.total, 3, keep_remainder=True)
    last = assemble(tokens, val.window(len(val) - 1), 3, False, 0)
    assert last["input_ids"].tolist() == [7, 8, 0] and last["labels"].tolist() == [7, 8, IGNORE_INDEX]
    assert last["attention_mask"].tolist() == [1, 1, 0]


def _windows(tiny_lm: Path, files: Path, *flags: str, shards: int = 1) -> list[list[int]]:
    """Each window's input_ids and labels (the training set of `files` at --block-size 32 and `flags`); for a
    table, asserts that `shards` map processes tokenized the files."""
    config = parse_config(
        ["--dataset", "hf", "--data-files", str(files), "--text-column", "text"]
        + ["--model-path", str(tiny_lm / "model"), "--block-size", "32", *flags]
    )
    train = build_datasets(config).train
    if not config.streaming:
        assert len(train.table.cache_files) == shards  # one cache file per map process
    return [sample["input_ids"].tolist() + sample["labels"].tolist() for sample in _read(train)]


def _read(dataset):
    return (dataset[index] for index in range(len(dataset))) if hasattr(dataset, "plan") else iter(dataset)


@pytest.mark.parametrize("packing", ["documents", "stream"])
def test_the_windows_are_the_same_at_one_and_two_tokenizing_processes(
    tiny_lm, tmp_path, monkeypatch, packing
):
    rows = (
        (tiny_lm / "train.jsonl").read_text().splitlines()[:301]
    )  # shards of 150 and 151 rows at num_proc 2
    for name in ("one", "two"):  # each its own file: a cache of its own, written by that many processes
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(hf_text.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(hf_text, "ROWS_PER_PROCESS", 10**6)
    one = _windows(tiny_lm, tmp_path / "one" / "train.jsonl", "--packing", packing)
    monkeypatch.setattr(hf_text, "ROWS_PER_PROCESS", 150)
    two = _windows(tiny_lm, tmp_path / "two" / "train.jsonl", "--packing", packing, shards=2)
    cached = _windows(
        tiny_lm, tmp_path / "two" / "train.jsonl", "--packing", packing, shards=2
    )  # from the cache
    assert len(one) > 10 and one == two == cached


def test_a_stream_packs_each_map_batch_as_the_table_packs_it(tiny_lm):
    assert len((tiny_lm / "val.jsonl").read_text().splitlines()) < 1000  # one map batch: the table's windows
    table = _windows(tiny_lm, tiny_lm / "val.jsonl", "--packing", "documents")
    assert _windows(tiny_lm, tiny_lm / "val.jsonl", "--streaming") == table
