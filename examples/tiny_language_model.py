"""A tiny language model folder and JSONL text to fine-tune it on, made offline (no download):

    python examples/tiny_language_model.py lm-data

writes lm-data/model/, a transformers GPT-2 of 1 layer, width 32 and 64 positions built from GPT2Config
(untrained) with a BPE tokenizer of about 150 tokens that the `tokenizers` library trains on the text, saved
beside it as a PreTrainedTokenizerFast; and lm-data/train.jsonl and lm-data/val.jsonl, one {"text": ...,
"label": ...} a line: sentences of a small grammar, whose next word is easy to learn, and 1 where the text
tells of a fox, else 0 (a class for --num-classes 2). The same texts as instruction data: lm-data/sft.jsonl and
lm-data/sft-val.jsonl, {"prompt": a text's first sentence, "completion": " " + the rest} a line; lm-data/chat.jsonl
and lm-data/chat-val.jsonl, {"messages": the sentences as user and assistant turns} a line; and
lm-data/chat_template.jinja, a chat template of plain words without {% generation %} markers (the tokenizer has
none of its own). A folder that is there already is kept.
Then (docs/language-models.md):

    python main_multi_gpu.py --dataset hf --data-files lm-data/train.jsonl --val-files lm-data/val.jsonl \\
        --text-column text --model hf --model-path lm-data/model --export-on-end hf

Needs the [hf] extra: pip install -e '.[hf]'.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ADJECTIVES = "quick lazy small brown warm cold happy sleepy clever quiet bright old young".split()
NOUNS = "fox dog cat bird horse mouse owl frog rabbit bear wolf duck".split()
VERBS = "jumps runs sleeps sits looks walks hides waits plays sings".split()
PLACES = "over under near behind beside past".split()
END = "<|endoftext|>"  # the end of each text: GPT-2's name for it
TOKENS = 150  # the tokenizer's vocabulary: letters, their merges up to whole words, and the special tokens


def sentence(draw: random.Random) -> str:
    """`the ADJ NOUN VERB PLACE the ADJ NOUN .`: a grammar whose next word narrows to one of a few."""
    return (
        f"the {draw.choice(ADJECTIVES)} {draw.choice(NOUNS)} {draw.choice(VERBS)} {draw.choice(PLACES)} "
        f"the {draw.choice(ADJECTIVES)} {draw.choice(NOUNS)} ."
    )


def texts(count: int, seed: int) -> list[str]:
    """`count` texts of one to four sentences each."""
    draw = random.Random(seed)
    return [" ".join(sentence(draw) for _ in range(draw.randint(1, 4))) for _ in range(count)]


def write_jsonl(path: Path, rows: list[str]) -> None:
    """One {"text": ..., "label": 1 if it tells of a fox else 0} per line."""
    path.write_text(
        "".join(json.dumps({"text": text, "label": int(" fox " in text)}) + "\n" for text in rows),
        encoding="utf-8",
    )


def train_tokenizer(corpus: list[str]):
    """A BPE tokenizer trained on `corpus` by the tokenizers library, as transformers' PreTrainedTokenizerFast
    (words split at spaces and punctuation; `##` marks a piece that continues a word, so decoding joins it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=TOKENS, special_tokens=[END, "[UNK]"], continuing_subword_prefix="##"),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END, unk_token="[UNK]")


def write_model(folder: Path, tokenizer) -> None:
    """An untrained GPT-2 for `tokenizer`'s vocabulary, saved with the tokenizer as one model folder."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar for one small file says nothing
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# A chat template of plain words: each message as "ROLE says CONTENT" and the end-of-text token, no {% generation %}
# markers (the assistant's turns are found by rendering; docs/language-models.md, "Instruction data").
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} says {{ message['content'] }} "
    + END
    + " {% endfor %}"
    "{% if add_generation_prompt %}assistant says {% endif %}"
)


def sentences_of(text: str) -> list[str]:
    """A text's sentences, each ending in its full stop."""
    return [sentence.strip() + " ." for sentence in text.split(" .") if sentence.strip()]


def prompt_completion(text: str) -> dict[str, str]:
    """The text's first sentence as the prompt, the rest as the completion (" the end ." where there is none)."""
    sentences = sentences_of(text)
    return {"prompt": sentences[0], "completion": " " + (" ".join(sentences[1:]) or "the end .")}


def conversation(text: str) -> dict[str, list[dict[str, str]]]:
    """The text's sentences as turns of a user and an assistant, the assistant's last."""
    turns = sentences_of(text)
    turns += ["the end ."] if len(turns) % 2 else []
    roles = ["user", "assistant"] * (len(turns) // 2)
    return {"messages": [{"role": role, "content": turn} for role, turn in zip(roles, turns)]}


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def write_tiny_language_model(folder: Path) -> Path:
    """`folder`/model/ (the model and its tokenizer), `folder`/train.jsonl (400 texts) and `folder`/val.jsonl
    (80), the same texts as instruction data (sft*.jsonl, chat*.jsonl and chat_template.jinja); `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    train, val = texts(400, seed=0), texts(80, seed=1)
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "val.jsonl", val)
    for suffix, rows in (("", train), ("-val", val)):
        write_rows(folder / f"sft{suffix}.jsonl", [prompt_completion(text) for text in rows])
        write_rows(folder / f"chat{suffix}.jsonl", [conversation(text) for text in rows])
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    write_model(folder / "model", train_tokenizer(train))
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "lm-data")
    if not (out / "model" / "config.json").exists():
        write_tiny_language_model(out)
    print(f"{out}/model: a tiny GPT-2 and its tokenizer; {out}/train.jsonl and {out}/val.jsonl: its text")
