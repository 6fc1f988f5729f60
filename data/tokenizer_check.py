"""Whether --model hf's tokenizer reads the text it is given, before a run trains on what it made of it.

A tokenizer that is not the text's own makes (almost) nothing of it: a model folder without tokenizer files gets
a placeholder from transformers (GPT-2's has one token and encodes every text to no token at all), and a
tokenizer of another script maps the text to its unknown token. The run would then train on end-of-text tokens
alone, and report a validation accuracy of 1.0. Two checks (docs/troubleshooting.md, "A tokenizer that makes
nothing of the text"):

- `check_first_rows`, before anything is tokenized: the first FIRST_ROWS texts' characters against the tokens
  they encode to, special and unknown tokens not counted; fewer than one token per CHARACTERS_PER_TOKEN
  characters is (almost) nothing, one line with the counts;
- `check_rows_kept`, once a table is tokenized (a stream is read as it trains: its first rows only): the texts
  tokenized to no token, of those with any text; more than half of them is one line with the counts.
"""

from __future__ import annotations

from typing import Any

from multigpu.errors import UsageError

FIRST_ROWS = 32
# A real tokenizer gives a token per 1 to 10 characters (a byte-level one at most one per byte); a text's
# characters over a hundred times its tokens is a tokenizer that reads none of it.
CHARACTERS_PER_TOKEN = 100


def check_first_rows(tokenizer: Any, texts: list[str], tokenizer_flag: str, files_flag: str) -> None:
    """UsageError where `texts` (a flag's first rows) encode to fewer than one token per CHARACTERS_PER_TOKEN
    characters, or most of them to none: `tokenizer_flag` names the tokenizer as the user gave it."""
    characters = sum(len(text.strip()) for text in texts)
    if characters == 0:
        return  # empty texts: nothing to read, and nothing to judge by
    special = set(tokenizer.all_special_ids)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    known = [[token for token in ids if token not in special] for ids in encoded]
    tokens = sum(len(ids) for ids in known)
    with_text = sum(1 for text in texts if text.strip())
    to_nothing = sum(1 for text, ids in zip(texts, known) if text.strip() and not ids)
    if tokens * CHARACTERS_PER_TOKEN >= characters and to_nothing * 2 <= with_text:
        return
    unknown = sum(len(ids) for ids in encoded) - tokens
    also = f" ({unknown:,} unknown or special)" if unknown else ""
    raise UsageError(
        f"{tokenizer_flag}: its tokenizer encodes the first {len(texts)} rows of {files_flag} ({characters:,} "
        f"characters) to {tokens:,} tokens{also}, {to_nothing} of {with_text} rows to none: it does not read "
        f"this text (a model folder without tokenizer files gets a placeholder from transformers); give "
        f"--tokenizer FOLDER, the model's own tokenizer"
    )


def check_rows_kept(texts: Any, tokens: Any, end_token: bool, tokenizer_flag: str, files_flag: str) -> None:
    """UsageError where more than half of a tokenized table's rows with text became no token: `texts` the
    column as read, `tokens` its input_ids as tokenized (Arrow columns), `end_token` whether each text's ids end
    with an end-of-text token that the tokenizer did not make."""
    import pyarrow.compute as compute

    with_text = compute.greater(compute.utf8_length(compute.utf8_trim_whitespace(texts)), 0)
    empty = compute.less_equal(compute.list_value_length(tokens), 1 if end_token else 0)
    rows = int(compute.sum(with_text).as_py() or 0)
    to_nothing = int(compute.sum(compute.and_(with_text, empty)).as_py() or 0)
    if to_nothing * 2 <= rows:
        return
    raise UsageError(
        f"{tokenizer_flag}: its tokenizer encodes {to_nothing:,} of the {rows:,} rows with text in {files_flag} "
        f"to no token, and training would drop them: it does not read this text; give --tokenizer FOLDER, the "
        f"model's own tokenizer"
    )
