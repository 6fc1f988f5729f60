"""Instruction data for a causal language model: each row one text, and labels that are -100 on the tokens whose
prediction does not count in the loss (--loss-on; docs/language-models.md, "Instruction data").

- --prompt-column P --completion-column C: the text is the prompt then the completion, joined as written, then
  the end-of-text token. The completion's tokens begin where the tokens of the prompt alone stop being a prefix
  of the whole text's (where a token merges across the join, it is the completion's; TRL finds them the same
  way). --loss-on completion (the default) counts the completion's tokens and the end-of-text token.
- --messages-column M: a conversation, a list of {"role", "content"} messages, rendered by the tokenizer's chat
  template (or --chat-template FILE) and tokenized as one text. The assistant's turns are found without
  `{% generation %}` markers, which most templates lack: for each assistant message, the conversation before
  it is rendered with the generation prompt, and the conversation through it without; the text the second adds
  to the first is the turn (its content and the template's end of turn), found in the whole conversation's
  text after the turn before. --loss-on assistant (the default) counts the tokens whose first character lies in
  a turn (the fast tokenizer's offsets). A template under which the first rows have no assistant token is
  refused before any row is tokenized: its mask would be all zeros, and nothing would train.

--loss-on all counts every token (the text's first predicts nothing: no token is before it).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

from .batches import sample_batch
from .packing import IGNORE_INDEX, PackedWindows, TokenColumns

CHECKED_ROWS = 16  # the first rows whose tokens must count somewhere, else the template (or data) is refused
UNCOUNTED_SHARE = 0.01  # above this share of rows with no token that counts, a warning says how many


# ------------------------------------------------------------------ the rows as read
def check_columns(config: TrainConfig, example: dict[str, Any]) -> None:
    """UsageError where the files' first row lacks the prompt/completion or messages column, or holds something
    else there."""
    for flag, column in _columns(config):
        if column not in example:
            raise UsageError(
                f"--{flag} {column}: the files' columns are {', '.join(example)}; name the column that holds "
                f"each sample's {flag.split('-')[0]}"
            )
    try:
        InstructionRows(config)(example)
    except ValueError as error:
        flag, column = _columns(config)[0]
        raise UsageError(f"--{flag} {column}: the first row's {error}") from None


def _columns(config: TrainConfig) -> list[tuple[str, str]]:
    if config.messages_column is not None:
        return [("messages-column", config.messages_column)]
    assert config.prompt_column is not None and config.completion_column is not None  # TrainConfig checked
    return [("prompt-column", config.prompt_column), ("completion-column", config.completion_column)]


class InstructionRows:
    """What each row as read must hold: text in the prompt and completion columns, or a conversation (a list of
    {"role": text, "content": text}) in the messages column; a ValueError saying what it holds instead
    (Files.bad_row names the row)."""

    def __init__(self, config: TrainConfig):
        self.columns = [column for _, column in _columns(config)]
        self.messages = config.messages_column is not None

    def __call__(self, example: dict[str, Any]) -> None:
        if not self.messages:
            for column in self.columns:
                value = example.get(column)
                if not isinstance(value, str):
                    raise ValueError(
                        f"column {column} holds {type(value).__name__} ({value!r:.40}), not text"
                    )
            return
        column = self.columns[0]
        conversation = example.get(column)
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(
                f"column {column} holds {type(conversation).__name__} ({conversation!r:.40}), not a list of "
                f'{{"role", "content"}} messages'
            )
        for index, message in enumerate(conversation, 1):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(
                    f'column {column}\'s message {index} is {message!r:.60}, not {{"role": text, "content": text}}'
                )


# ------------------------------------------------------------------ tokens and labels
def tokenize_for(config: TrainConfig, tokenizer: Any, packed: bool) -> Callable[[dict[str, list]], dict]:
    """datasets.map's function of this run's instruction data: a batch of rows as {"input_ids", "labels"}; a
    padded row (not `packed`) keeps at most --block-size tokens."""
    max_length = None if packed else config.block_size
    counts = config.loss_target != "all"
    if config.messages_column is not None:
        template = chat_template(config, tokenizer)
        return Conversations(tokenizer, config.messages_column, template, counts, max_length)
    assert config.prompt_column is not None and config.completion_column is not None  # TrainConfig checked
    return PromptCompletions(tokenizer, config.prompt_column, config.completion_column, counts, max_length)


class PromptCompletions:
    """Prompt then completion then the end-of-text token; with `completion_only` the prompt's labels -100."""

    def __init__(
        self, tokenizer: Any, prompt: str, completion: str, completion_only: bool, max_length: int | None
    ):
        self.tokenizer, self.prompt, self.completion = tokenizer, prompt, completion
        self.completion_only, self.max_length = completion_only, max_length
        self.end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        prompts = batch[self.prompt]
        texts = [prompt + completion for prompt, completion in zip(prompts, batch[self.completion])]
        whole = self.tokenizer(texts)["input_ids"]
        alone = self.tokenizer(prompts)["input_ids"] if self.completion_only else [[] for _ in prompts]
        ids, labels = [], []
        for text, prompt in zip(whole, alone):
            text = text + self.end
            start = _common_prefix(prompt, text)
            ids.append(text[: self.max_length])
            labels.append(([IGNORE_INDEX] * start + text[start:])[: self.max_length])
        return {"input_ids": ids, "labels": labels}


def _common_prefix(first: Any, second: Any) -> int:
    """How many tokens (or characters) `first` and `second` share from the start."""
    shared = 0
    for one, other in zip(first, second):
        if one != other:
            break
        shared += 1
    return shared


def chat_template(config: TrainConfig, tokenizer: Any) -> str:
    """--chat-template's file, else the tokenizer's own template; UsageError where there is neither."""
    if config.chat_template is not None:
        if not os.path.isfile(config.chat_template):
            raise UsageError(
                f"--chat-template {config.chat_template}: no such file; give a file holding a Jinja chat template"
            )
        with open(config.chat_template, encoding="utf-8") as template:
            return template.read()
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            "--messages-column: the tokenizer has no chat template to render the conversations with; give "
            '--chat-template FILE, a Jinja template (docs/language-models.md, "Instruction data")'
        )
    return tokenizer.chat_template


class Conversations:
    """A conversation rendered by the chat template and tokenized as one text; with `assistant_only` the labels
    of every token outside the assistant's turns -100 (the module docstring: how the turns are found)."""

    def __init__(
        self, tokenizer: Any, column: str, template: str, assistant_only: bool, max_length: int | None
    ):
        if assistant_only and not tokenizer.is_fast:
            raise UsageError(
                "--loss-on assistant finds the assistant's tokens by their characters, which only a fast "
                "tokenizer (a tokenizer.json) gives: use one, or --loss-on all"
            )
        self.tokenizer, self.column, self.template = tokenizer, column, template
        self.assistant_only, self.max_length = assistant_only, max_length

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        conversations = [[_message(message) for message in row] for row in batch[self.column]]
        texts = [self.render(messages, False) for messages in conversations]
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=self.assistant_only)
        ids, labels = [], []
        for row, (messages, text) in enumerate(zip(conversations, texts)):
            tokens = encoded["input_ids"][row]
            counted = tokens
            if self.assistant_only:
                spans = assistant_spans(self.render, messages, text)
                starts = [start for start, _ in encoded["offset_mapping"][row]]
                counted = [
                    token if _inside(start, spans) else IGNORE_INDEX for token, start in zip(tokens, starts)
                ]
            ids.append(tokens[: self.max_length])
            labels.append(list(counted)[: self.max_length])
        return {"input_ids": ids, "labels": labels}


def _message(message: dict[str, Any]) -> dict[str, str]:
    """The role and content of a message: an Arrow table gives every message every key any message had."""
    return {"role": message["role"], "content": message["content"]}


def assistant_spans(
    render: Callable[[list, bool], str], messages: list[dict[str, str]], text: str
) -> list[tuple[int, int]]:
    """The character ranges of the assistant's turns in `text`, the whole conversation rendered: each turn begins
    where rendering before it with the generation prompt ends, and ends where rendering through it stops agreeing
    with the whole text (a template may close the conversation after its last message); where the whole text does
    not begin with the rendering before the turn (a template that renders earlier turns otherwise), the turn as
    rendered is looked for after the turn before."""
    spans: list[tuple[int, int]] = []
    searched = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:index], True)
        through = render(messages[: index + 1], False)
        if not through.startswith(before) or len(through) == len(before):
            continue  # the template renders this turn apart from its prompt: no span to find
        if text.startswith(before):
            start = len(before)
            stop = start + _common_prefix(through[start:], text[start:])
        else:
            turn = through[len(before) :]
            start = text.find(turn, searched)
            stop = start + len(turn)
        if start >= searched and stop > start:
            spans.append((start, stop))
            searched = stop
    return spans


def _inside(start: int, spans: list[tuple[int, int]]) -> bool:
    return any(begin <= start < end for begin, end in spans)


# ------------------------------------------------------------------ what the labels count
def counted_targets(labels: list[int]) -> int:
    """The targets of one text's labels that count: the model shifts them, so its first label is no target."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def check_first_rows(config: TrainConfig, tokenize: Callable, rows: dict[str, list]) -> None:
    """UsageError where no token of the first rows (up to CHECKED_ROWS) counts: a chat template that makes no
    assistant token countable, or completions that are all empty and have no end-of-text token."""
    if config.loss_target == "all":
        return
    labels = tokenize(rows)["labels"]
    if any(counted_targets(row) for row in labels):
        return
    count = len(labels)
    if config.messages_column is not None:
        which = (
            f"--chat-template {config.chat_template}"
            if config.chat_template
            else "the tokenizer's chat template"
        )
        raise UsageError(
            f"--messages-column {config.messages_column}: {which} makes no assistant token countable in the "
            f"first {count} conversation(s): rendering a conversation through each assistant message adds "
            f"nothing to rendering it up to that message, so nothing would train; give a --chat-template that "
            f"renders the assistant's messages (or --loss-on all)"
        )
    raise UsageError(
        f"--completion-column {config.completion_column}: no completion token counts in the first {count} "
        f"row(s) (empty completions, and the tokenizer has no end-of-text token); give completions, or "
        f"--loss-on all"
    )


def uncounted_rows(columns: TokenColumns) -> int:
    """How many rows of a tokenized table have no target that counts (their labels -100 but the first)."""
    if columns.labels is None:
        return 0
    counts = []
    for chunk in columns.labels:
        counts.append(chunk != IGNORE_INDEX)
    counting = np.concatenate(counts) if counts else np.zeros(0, dtype=bool)
    counting[columns.starts[columns.lengths > 0]] = False  # each text's first label is no target
    starts = np.minimum(columns.starts, max(0, len(counting) - 1))  # an empty last row: read, then dropped
    per_row = np.add.reduceat(counting, starts) if len(counting) else np.zeros(len(starts), dtype=np.int64)
    per_row = np.where(columns.lengths > 0, per_row, 0)
    return int((per_row == 0).sum())


def uncounted_warning(config: TrainConfig, flag: str, rows: int, uncounted: int) -> list[str]:
    """The one warning of a data set where more than a small share of rows have no token that counts."""
    if rows == 0 or uncounted / rows <= UNCOUNTED_SHARE:
        return []
    what = "assistant turn" if config.loss_target == "assistant" else "completion token"
    return [
        f"warning: {flag}: {uncounted} of {rows} rows ({100 * uncounted / rows:.0f}%) have no {what} that counts "
        f"(--loss-on {config.loss_target}): they train nothing"
    ]


def describe(config: TrainConfig) -> str:
    """The plan's words for the columns, the template and what counts."""
    if config.messages_column is not None:
        template = (
            f"--chat-template {config.chat_template}"
            if config.chat_template
            else "the tokenizer's chat template"
        )
        return f"column {config.messages_column} rendered with {template}; loss on {config.loss_target}"
    if config.prompt_column is not None:
        return (
            f"columns {config.prompt_column} then {config.completion_column} then the end-of-text token; loss on "
            f"{config.loss_target}"
        )
    return f"column {config.text_column}; loss on {config.loss_target}"


def _window_pad(tokenizer: Any) -> int:
    """What fills a packed window's padding: any id does (no label there, and no text attends to it)."""
    for found in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if found is not None:
            return found
    return 0


class TextWords:
    """How the texts become samples (`packing`: documents, stream, or None for padded samples), and the plan's
    lines on it: the columns, what counts in the loss and how much of the first batch, the windows, and a warning
    where many rows count nothing."""

    def __init__(self, config: TrainConfig, packing: str | None, tokenizer: Any):
        self.config, self.packing, self.pad_id = config, packing, _window_pad(tokenizer)
        self.warnings: list[str] = []

    def lines(self, train: Dataset, collate_fn: Callable | None) -> list[str]:
        config = self.config
        if config.text_classification:
            return []
        line = f"text: {describe(config)}"
        if not config.streaming:
            labels = sample_batch(
                train, config.batch_size if isinstance(config.batch_size, int) else 8, collate_fn
            )
            counted = int((labels["labels"][:, 1:] != IGNORE_INDEX).sum())
            positions = labels["labels"].numel()
            line += f": {counted} of the first batch's {positions} positions count ({100 * counted / positions:.0f}%)"
        return [line, *self._packing_lines(train), *self.warnings]

    def _packing_lines(self, train: Dataset) -> list[str]:
        auto = " (auto: the model's attention takes it)" if self.config.packing == "auto" else ""
        block = self.config.block_size
        if self.packing is None:
            return [
                f"padding: each text a sample of at most {block} tokens, each batch padded to its longest"
            ]
        if self.packing == "stream":
            auto = (
                " (auto: the model's attention cannot keep documents apart)"
                if self.config.packing == "auto"
                else ""
            )
            return [
                f"packing stream{auto}: the texts joined in file order and cut into windows of {block} tokens, as "
                f"run_clm groups them; a token attends to the texts before it in its window"
            ]
        windows = (
            f": {len(train)} windows of {block} tokens, {100 * train.filled():.0f}% filled"
            if isinstance(train, PackedWindows)
            else f": windows of {block} tokens"
        )
        return [
            f"packing documents{auto}{windows}; each text attends only to itself (position_ids restart at each "
            f"text, its first label -100)"
        ]
