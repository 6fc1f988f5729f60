"""Instruction data (data/instructions.py): prompt/completion rows count their completion's tokens alone, chat rows
their assistant turns' alone under a template without {% generation %} markers (the counts equal the hand
count), a step on prompt/completion data has the loss and gradient of the completion tokens alone, and what
cannot train is refused or said once (tests/conftest.py's tiny_lm: the tiny model's texts as prompts,
completions and conversations too, and a chat template of plain words)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import main_multi_gpu
from conftest import assert_one_line, assert_untouched, config_for, contents, read_scalars
from examples.tiny_language_model import CHAT_TEMPLATE
from multigpu.config import parse_config
from multigpu.data import build_datasets
from multigpu.data.instructions import assistant_spans
from multigpu.models import build_model
from train_multi_gpu import MultiGPUTrainer

BLOCK = 64


def _flags(tiny_lm: Path, files: Path, kind: str, *extra: str) -> list[str]:
    columns = (
        ["--prompt-column", "prompt", "--completion-column", "completion"]
        if kind == "prompt"
        else ["--messages-column", "messages", "--chat-template", str(files.parent / "chat_template.jinja")]
    )
    return [
        "--dataset",
        "hf",
        "--data-files",
        str(files),
        *columns,
        "--model-path",
        str(tiny_lm / "model"),
        "--block-size",
        str(BLOCK),
        *extra,
    ]


def _counted(dataset) -> int:
    """The targets the model's loss counts over the whole set (it shifts the labels: a window's first is none)."""
    return sum(int((dataset[i]["labels"][1:] != -100).sum()) for i in range(len(dataset)))


def _tokenizer(tiny_lm: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_lm / "model")


@pytest.fixture(scope="module")
def data(tiny_lm: Path) -> Path:
    """The tiny model's folder: its texts as sft.jsonl (prompt/completion) and chat.jsonl (messages) too."""
    return tiny_lm


@pytest.mark.parametrize("packing", ["--packing=documents", "--pad-to-batch"])
def test_completion_only_counts_the_completions_and_their_end_of_text(tiny_lm, data, packing):
    spec = build_datasets(parse_config(_flags(tiny_lm, data / "sft.jsonl", "prompt", packing)))
    tokenizer = _tokenizer(tiny_lm)
    rows = [json.loads(line) for line in (data / "sft.jsonl").read_text().splitlines()]
    by_hand = sum(len(tokenizer(row["completion"])["input_ids"]) + 1 for row in rows)  # and the end-of-text
    train = spec.train
    if packing == "--pad-to-batch":  # a text a sample: count the padded batches' labels
        train = [spec.collate_fn([spec.train[i]]) for i in range(len(spec.train))]
        train = [{"labels": batch["labels"][0]} for batch in train]
    assert _counted(train) == by_hand
    assert spec.notes[0].startswith(
        "text: columns prompt then completion then the end-of-text token; loss on"
    )
    everything = build_datasets(
        parse_config(_flags(tiny_lm, data / "sft.jsonl", "prompt", "--loss-on", "all"))
    )
    assert _counted(everything.train) > by_hand


def test_assistant_only_counts_the_assistant_turns_of_a_template_without_generation_markers(tiny_lm, data):
    assert "{% generation %}" not in CHAT_TEMPLATE
    spec = build_datasets(parse_config(_flags(tiny_lm, data / "chat.jsonl", "messages")))
    tokenizer = _tokenizer(tiny_lm)
    rows = [json.loads(line)["messages"] for line in (data / "chat.jsonl").read_text().splitlines()]
    # Each assistant turn is its content then the template's end of turn, <|endoftext|>: one token.
    by_hand = sum(
        len(tokenizer(message["content"])["input_ids"]) + 1
        for messages in rows
        for message in messages
        if message["role"] == "assistant"
    )
    assert _counted(spec.train) == by_hand
    assert (
        "column messages rendered with --chat-template" in spec.notes[0]
        and "loss on assistant" in spec.notes[0]
    )


def test_a_turn_ends_where_a_template_closes_the_conversation_after_its_last_message():
    def render(messages: list, prompt: bool) -> str:
        text = "".join(f"<{message['role']}>{message['content']}</s>" for message in messages)
        return text + ("<assistant>" if prompt else "\n")

    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    text = render(messages, False)
    spans = assistant_spans(render, messages, text)
    assert [text[start:stop] for start, stop in spans] == ["hello</s>", "ciao</s>\n"]


def test_a_step_trains_on_the_completion_tokens_alone(tiny_lm, data, tmp_path):
    lines = (data / "sft.jsonl").read_text().splitlines()[:12]
    (tmp_path / "few.jsonl").write_text("\n".join(lines) + "\n")
    config = parse_config(_flags(tiny_lm, tmp_path / "few.jsonl", "prompt"))
    spec = build_datasets(config)
    model = build_model("hf", spec.input_shape, spec.num_classes, config)
    for module in model.modules():  # no dropout: the step and the hand computation see the same model
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = copy.deepcopy(model)
    # By hand: each row alone, its completion's tokens and the end-of-text predicted, nothing of the prompt.
    tokenizer = _tokenizer(tiny_lm)
    losses, count = [], 0
    for row in map(json.loads, lines):
        prompt = len(tokenizer(row["prompt"])["input_ids"])
        ids = torch.tensor(
            tokenizer(row["prompt"] + row["completion"])["input_ids"] + [tokenizer.eos_token_id]
        )
        logits = reference(input_ids=ids[None]).logits[0]
        losses.append(F.cross_entropy(logits[prompt - 1 : -1], ids[prompt:], reduction="sum"))
        count += len(ids) - prompt
    by_hand = torch.stack(losses).sum() / count
    by_hand.backward()
    # One SGD step of lr 1 over every window at once: the weights move by minus the gradient.
    step = config_for(
        tmp_path,
        1,
        batch_size=len(spec.train),
        epochs=1,
        optimizer="sgd",
        momentum=0.0,
        weight_decay=0.0,
        lr=1.0,
        lr_schedule="constant",
        log_every=1,
    )
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    with MultiGPUTrainer(model, spec.train, None, step, collate_fn=spec.collate_fn) as trainer:
        trainer.fit()
    moved = max(
        (before[name] - value.detach() - expected.grad).abs().max().item()
        for (name, value), expected in zip(model.named_parameters(), reference.parameters())
    )
    logged = read_scalars(tmp_path / "ckpt" / "tb")["train/loss"]
    assert moved <= 1e-5 and logged == [(1, pytest.approx(by_hand.item(), abs=1e-5))], (moved, logged)


BAD = {  # name: (the files, given the instruction data and a scratch folder; their kind; the line's words)
    "a missing prompt column": (
        lambda data, tmp: data / "chat.jsonl",
        "prompt",
        "--prompt-column prompt: the files' columns are messages; name the column that holds each sample's prompt",
    ),
    "a missing messages column": (
        lambda data, tmp: data / "sft.jsonl",
        "messages",
        "--messages-column messages: the files' columns are prompt, completion; name the column that holds "
        "each sample's messages",
    ),
    "messages that are no list of role and content": (
        lambda data, tmp: _written(tmp, [{"messages": [{"role": "user", "text": "the fox ."}]}]),
        "messages",
        "--messages-column messages: the first row's column messages's message 1 is {'role': 'user', 'text': "
        '\'the fox .\'}, not {"role": text, "content": text}',
    ),
    "a template with no assistant turn": (
        lambda data, tmp: data / "chat.jsonl",
        "messages",
        "makes no assistant token countable in the first 16 conversation(s)",
    ),
    "--loss-on assistant on plain text": (
        lambda data, tmp: data / "sft.jsonl",
        "text",
        "--loss-on assistant counts the assistant tokens of --messages-column data, and this run's data is "
        "plain text (--text-column prompt): give --loss-on all (or leave it out)",
    ),
}


def _written(folder: Path, rows: list[dict]) -> Path:
    """`rows` as folder/bad.jsonl, the chat template beside them."""
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "bad.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "bad.jsonl"


@pytest.mark.parametrize("name", BAD)
def test_what_cannot_train_is_one_line_exit_2_and_nothing_saved_changes(
    tiny_lm, data, tmp_path, capsys, name
):
    files, kind, message = BAD[name]
    if kind == "text":
        flags = _flags(tiny_lm, files(data, tmp_path), "prompt")[:4]
        flags += ["--text-column", "prompt", "--model-path", str(tiny_lm / "model"), "--loss-on", "assistant"]
    else:
        flags = _flags(tiny_lm, files(data, tmp_path), kind)
    if name == "a template with no assistant turn":  # one that renders the users' messages alone
        template = tmp_path / "user-only.jinja"
        template.write_text(
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }} {% endif %}{% endfor %}"
        )
        flags[flags.index("--chat-template") + 1] = str(template)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"an earlier run's checkpoint")
    before = contents(tmp_path / "run")
    code = main_multi_gpu.main([*flags, "--no-progress", "--save-dir", str(tmp_path / "run")])
    assert_one_line(code, capsys.readouterr().err, message)
    assert_untouched(tmp_path / "run", before)


def test_many_rows_that_count_nothing_are_said_once_with_their_count(tiny_lm, data, tmp_path):
    rows = [json.loads(line) for line in (data / "chat.jsonl").read_text().splitlines()[:40]]
    for row in rows[:10]:  # a conversation of a user message alone: no assistant turn to count
        row["messages"] = row["messages"][:1]
    spec = build_datasets(parse_config(_flags(tiny_lm, _written(tmp_path, rows), "messages")))
    said = [line for line in spec.notes if line.startswith("warning:")]
    assert said == [
        "warning: --data-files: 10 of 40 rows (25%) have no assistant turn that counts (--loss-on assistant): "
        "they train nothing"
    ]
