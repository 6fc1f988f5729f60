"""--dataset text: a plain text file as next-character prediction, in fixed-length windows (character level).

The vocabulary is the sorted set of the file's characters, so a character's id is the same on every rank
and every rerun. The last 10 percent of the text is the validation set. Each split is cut into windows
of `block_size` characters side by side (stride `block_size`, no overlap), so an epoch sees every
character once: sample i is x = text[iT : iT+T] and y = text[iT+1 : iT+T+1], the same window shifted by one.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from multigpu.errors import UsageError

VAL_PARTS = 10  # the text's last 1/10 is the validation set (integer arithmetic: the cut is exact)
BINARY_SIGNS = "\x00"  # a NUL character: no text file has one, every binary format does


class CharWindows(Dataset):
    """Windows of `block_size` character ids and the same windows shifted by one (the targets)."""

    fixed_samples = (
        True  # sample i never changes: --data-on-device may read the set once (data/device_data.py)
    )

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        # Each window needs one character more than it holds: its last target.
        return max(0, (len(self.ids) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.block_size
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def read_text(path: str) -> str:
    """The file's text, or UsageError naming the file when it is missing, empty, not UTF-8 or binary."""
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except FileNotFoundError:
        raise UsageError(f"--data-file {path}: no such file; give a UTF-8 plain text file") from None
    except IsADirectoryError:
        raise UsageError(f"--data-file {path} is a folder; give a UTF-8 plain text file") from None
    except OSError as error:
        raise UsageError(
            f"--data-file {path} cannot be read ({error.strerror}); give a readable text file"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(
            f"--data-file {path} is not UTF-8 text (byte {error.start} is not); give a plain text file"
        ) from None
    if not text:
        raise UsageError(f"--data-file {path} is empty; give a file with some text")
    if any(sign in text for sign in BINARY_SIGNS):
        raise UsageError(
            f"--data-file {path} holds NUL bytes, so it is binary, not text; give a plain text file"
        )
    return text


def text_datasets(path: str, block_size: int) -> tuple[CharWindows, CharWindows, int]:
    """(training windows, validation windows, vocabulary size) of the text file at `path`; UsageError when
    either split is shorter than two windows."""
    text = read_text(path)
    vocabulary = {char: index for index, char in enumerate(sorted(set(text)))}
    ids = torch.tensor([vocabulary[char] for char in text], dtype=torch.long)
    cut = len(ids) - len(ids) // VAL_PARTS
    train, val = CharWindows(ids[:cut], block_size), CharWindows(ids[cut:], block_size)
    if min(len(train), len(val)) < 2:
        # Two windows and the last one's final target, 2T + 1 characters, in the validation tail (the smaller split).
        needed = (2 * block_size + 1) * VAL_PARTS
        raise UsageError(
            f"--data-file {path} has {len(text):,} characters, too few for two windows of "
            f"--block-size {block_size} in each split ({len(train)} train, {len(val)} val); give "
            f"at least {needed:,} characters or a smaller --block-size"
        )
    return train, val, len(vocabulary)
