"""--space: where a search samples each training setting, with the grid's names and value rules (plan.py).

    --space 'lr=log(1e-4,1e-1)' 'weight_decay=uniform(0,0.1)' 'grad_accum_steps=int(1,4)' 'batch_size=choice(32,64)'

log and uniform draw floats (log: evenly in the logarithm; an integer setting drawn by log gets integers), int draws
whole numbers, both ends included, and choice one of its values. A range is checked at both ends by the training
flags' own rules before anything runs, and every sampled value again before its run starts (`flags`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from multigpu.config import FIELDS, field_kind, flag
from multigpu.errors import UsageError
from multigpu.sweep.plan import setting_name, setting_value, setting_values

KINDS = ("log", "uniform", "int", "choice")
ENTRY = re.compile(r"(?P<key>[^=()]+)=(?P<kind>\w+)\((?P<args>.*)\)")
SYNTAX = "expected KEY=log(LO,HI), uniform(LO,HI), int(LO,HI) or choice(A,B,...), e.g. lr=log(1e-4,1e-1)"


@dataclass(frozen=True)
class Dimension:
    """One --space entry: a TrainConfig field and how to sample it."""

    name: str  # the field
    kind: str  # one of KINDS
    values: tuple[Any, ...]  # (LO, HI) of a range; the values of a choice
    choice_flags: tuple[tuple[str, ...], ...] = ()  # the training flags that set each value of a choice

    @property
    def text(self) -> str:
        """The entry as the sweep writes it back (its fingerprint, the summary): lr=log(0.0001,0.1)."""
        return f"{self.name}={self.kind}({','.join(map(str, self.values))})"

    @property
    def whole(self) -> bool:
        """Whether the drawn values are integers (int, or log over an integer setting)."""
        return self.kind == "int" or (self.kind == "log" and field_kind(FIELDS[self.name]) == "int")

    def suggest(self, trial: Any) -> Any:
        """Draw this setting's value for an Optuna trial (the stored one, when the trial has it already)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.values))
        low, high = self.values
        if self.whole:
            return trial.suggest_int(self.name, low, high, log=self.kind == "log")
        return trial.suggest_float(self.name, low, high, log=self.kind == "log")

    def flags(self, value: Any, train_argv: Sequence[str]) -> list[str]:
        """The training flags that set the drawn `value`, checked by the training flags' rules (UsageError)."""
        if self.kind == "choice":
            return list(self.choice_flags[self.values.index(value)])
        return setting_value(self.name, repr(value), f"--space {self.text}", train_argv)[1]


def parse_space(tokens: Sequence[str], train_argv: Sequence[str]) -> list[Dimension]:
    """Every --space entry, checked; a setting named twice is refused."""
    space = [parse(token, train_argv) for token in tokens]
    names = [dimension.name for dimension in space]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"--space names {', '.join(repeated)} twice: give each setting one entry")
    return space


def parse(token: str, train_argv: Sequence[str]) -> Dimension:
    """One KEY=KIND(...) entry."""
    where = f"--space {token}"
    match = ENTRY.fullmatch(token.strip())
    if match is None:
        raise UsageError(f"{where}: {SYNTAX}")
    name, kind = setting_name(match["key"], where), match["kind"]
    if kind not in KINDS:
        raise UsageError(f"{where}: {kind} is not a way to sample; give log, uniform, int or choice")
    texts = [part.strip() for part in match["args"].split(";" if ";" in match["args"] else ",")]
    if not all(texts):
        raise UsageError(f"{where}: an empty value; {SYNTAX}")
    if kind == "choice":
        return Dimension(name, kind, *setting_values(name, texts, where, train_argv))
    return _range(name, kind, texts, where, train_argv)


def _range(name: str, kind: str, texts: list[str], where: str, train_argv: Sequence[str]) -> Dimension:
    setting = field_kind(FIELDS[name])
    if len(texts) != 2:
        raise UsageError(f"{where}: {kind}() takes two numbers, LO and HI")
    if setting not in ("int", "float"):
        raise UsageError(
            f"{where}: --{flag(name)} takes {'true or false' if setting == 'bool' else 'words'}, not "
            f"numbers from a range; give its values as choice(A,B,...)"
        )
    if kind == "uniform" and setting == "int":
        raise UsageError(f"{where}: --{flag(name)} takes whole numbers; give int(LO,HI) or log(LO,HI)")
    whole = kind == "int" or setting == "int"
    low, high = (_number(text, whole, where) for text in texts)
    if not low < high:
        raise UsageError(f"{where}: the range is empty; LO must be below HI")
    if kind == "log" and low <= 0:
        raise UsageError(f"{where}: log() draws evenly in the logarithm, so LO must be above 0, got {low}")
    for end in (low, high):  # the values between are allowed where both ends are (the rules are ranges)
        setting_value(name, repr(end), where, train_argv)
    return Dimension(name, kind, (low, high))


def _number(text: str, whole: bool, where: str) -> Any:
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not {'a whole number' if whole else 'a number'}") from None
    if not math.isfinite(value):
        raise UsageError(f"{where}: the ends of a range must be finite numbers, got {text}")
    return value
