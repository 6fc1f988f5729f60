"""What a sweep runs: the grid, the experiment list, its shards, and the fingerprint a resume must match.

Every grid value goes through TrainConfig's own parser and checks (`parse_config`): a value that
main_multi_gpu.py would refuse is refused here, before anything runs, with the same words.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from multigpu.checkpoints.run_folders import folder_numbers
from multigpu.config import DEFAULT_SAVE_ROOT, FIELDS, TrainConfig, flag, given_fields, parse_config
from multigpu.errors import UsageError
from multigpu.sweep.options import SweepOptions
from multigpu.sweep.study import TrialLink

DEFAULT_SWEEP_ROOT, SWEEP_PREFIX = DEFAULT_SAVE_ROOT, "sweep-"  # without --sweep-dir: checkpoints/sweep-N
SWEEP_FILE = "sweep.json"  # the fingerprint a rerun must match

# Set by the sweep for each run, so neither a training flag nor a grid key may set them.
PER_EXPERIMENT = {
    "seed": "--num-seeds/--seeds",
    "save_dir": "--sweep-dir",
    "resume": "the sweep itself (resume is automatic)",
    "log_dir": "the sweep (each run logs to <its dir>/tb)",
}
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class Axis:
    """One --grid KEY: a TrainConfig field and its values (as TrainConfig prints them, so 1e-3 == 0.001)."""

    field: str
    values: tuple[Any, ...]
    flags: tuple[tuple[str, ...], ...]  # the training flags that set each value


@dataclass(frozen=True)
class Experiment:
    """One full training run: a grid point and a seed, with its own save dir."""

    point: str  # "lr=0.001,batch_size=32"; "" without a grid
    seed: int
    save_dir: str
    argv: tuple[str, ...]  # main_multi_gpu.py's flags for this run
    report_to: TrialLink | None = None  # a search's run: the trial it reports its epochs to (--search)

    @property
    def name(self) -> str:
        """Its path inside the sweep dir, which is also its name in results and messages."""
        return f"{self.point}/seed-{self.seed}" if self.point else f"seed-{self.seed}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.save_dir, "train.log")

    @property
    def sweep_dir(self) -> str:
        """The sweep dir that holds save_dir: the folders between (grid point, seed) are the sweep's names."""
        return os.path.normpath(os.path.join(self.save_dir, *[os.pardir] * len(self.name.split("/"))))


@dataclass
class Plan:
    """The whole sweep: every experiment in a fixed order (grid points in --grid order, then seeds)."""

    sweep_dir: str
    base: TrainConfig
    axes: list[Axis]
    points: list[tuple[str, dict[str, Any]]]  # (name, {field: value}) per grid point
    experiments: list[Experiment]
    fingerprint: dict[str, Any]

    def shard(self, index: int, count: int) -> list[Experiment]:
        """The experiments of shard `index` of `count`: every count-th one, so each shard gets every grid point."""
        return self.experiments[index::count]


def build_plan(options: SweepOptions, train_argv: Sequence[str]) -> Plan:
    """Check the training flags and the grid, and list the experiments."""
    train_argv = list(train_argv)
    refuse_per_experiment_flags(train_argv)
    base = parse_config(train_argv)
    axes = [_axis(token, train_argv) for token in options.grid]
    repeated = {axis.field for axis in axes if [a.field for a in axes].count(axis.field) > 1}
    if repeated:
        raise UsageError(
            f"--grid names {', '.join(sorted(repeated))} twice: give all values of a key in one KEY=V1,V2"
        )
    points = []  # (name, {field: value}, flags)
    for combination in itertools.product(*[range(len(axis.values)) for axis in axes]):
        values = {axis.field: axis.values[i] for axis, i in zip(axes, combination)}
        point = ",".join(f"{name}={quote(str(value), safe=',:+@')}" for name, value in values.items())
        point_flags = [text for axis, i in zip(axes, combination) for text in axis.flags[i]]
        parse_config(train_argv + point_flags)  # each value was checked alone; check them together too
        points.append((point, values, point_flags))
    fingerprint = fingerprint_of(base, options, {axis.field: list(axis.values) for axis in axes})
    sweep_dir = os.path.abspath(options.sweep_dir or default_sweep_dir(fingerprint))
    experiments = [
        experiment
        for point, _, point_flags in points
        for experiment in experiments_of(sweep_dir, point, [*train_argv, *point_flags], options.seeds)
    ]
    return Plan(
        sweep_dir, base, axes, [(point, values) for point, values, _ in points], experiments, fingerprint
    )


def fingerprint_of(
    base: TrainConfig, options: SweepOptions, grid: dict[str, list[Any]], **more: Any
) -> dict[str, Any]:
    """What a rerun must match to continue a sweep (sweep.json): the runs' settings but those set for each run,
    the grid, the slots' shape, and `more` (a search's settings)."""
    return {
        "base": {
            name: value
            for name, value in base.to_dict().items()
            if name not in PER_EXPERIMENT and name != "progress"
        },
        "grid": grid,
        "gpus_per_run": options.gpus_per_run,
        "threads_per_run": options.threads_per_run,
        **more,
    }


def experiments_of(
    sweep_dir: str,
    point: str,
    point_argv: Sequence[str],
    seeds: Sequence[int],
    report_to: TrialLink | None = None,
) -> list[Experiment]:
    """A point's runs, one per seed, each in its own DIR/<point>/seed-<k>/ (DIR/seed-<k>/ without a point) and
    continuing from its own newest checkpoint; `point_argv`: the training flags of the point."""
    experiments = []
    for seed in seeds:
        save_dir = (
            os.path.join(sweep_dir, point, f"seed-{seed}")
            if point
            else os.path.join(sweep_dir, f"seed-{seed}")
        )
        argv = [
            *point_argv,
            "--seed",
            str(seed),
            "--save-dir",
            save_dir,
            "--resume",
            "auto",
            "--no-progress",
        ]  # the sweep's one bar replaces each run's own
        experiments.append(Experiment(point, seed, save_dir, tuple(argv), report_to))
    return experiments


def default_sweep_dir(fingerprint: dict[str, Any]) -> str:
    """Without --sweep-dir: the `checkpoints/sweep-N` that holds this sweep (rerunning the command continues
    it), else the next free N, so a sweep with other settings starts beside it instead of being refused: the
    rule of training runs' `checkpoints/run-N`. Nothing is created here (records.check_fingerprint claims it)."""
    numbers = folder_numbers(DEFAULT_SWEEP_ROOT, SWEEP_PREFIX)
    current = json.loads(json.dumps(fingerprint))  # compared as it reads back
    for number in numbers:
        path = os.path.join(DEFAULT_SWEEP_ROOT, f"{SWEEP_PREFIX}{number}")
        try:
            with open(os.path.join(path, SWEEP_FILE), encoding="utf-8") as file:
                saved = json.load(file)
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and fingerprint_difference(saved, current) is None:
            return path
    return os.path.join(DEFAULT_SWEEP_ROOT, f"{SWEEP_PREFIX}{(numbers or [0])[-1] + 1}")


def refuse_per_experiment_flags(train_argv: list[str]) -> None:
    """--seed, --save-dir, --resume and --log-dir are the sweep's to set for each run: refused as training flags."""
    given = given_fields(train_argv)  # given, even when given the default
    for name, setter in PER_EXPERIMENT.items():
        if name in given:
            raise UsageError(
                f"--{flag(name)} is set for each run by {setter}; leave it out of the training flags"
            )


def _axis(token: str, train_argv: list[str]) -> Axis:
    key, sep, text = token.partition("=")
    where = f"--grid {token}"
    if not sep or not key.strip():
        raise UsageError(f"{where}: expected KEY=V1,V2, e.g. lr=1e-3,3e-3")
    name = setting_name(key, where)
    texts = [part.strip() for part in text.split(";" if ";" in text else ",")]
    if not all(texts):
        raise UsageError(f"{where}: empty value; give KEY=V1,V2")
    return Axis(name, *setting_values(name, texts, where, train_argv))


def setting_name(key: str, where: str) -> str:
    """The TrainConfig field that a --grid or --space KEY names (lr, batch_size or batch-size); `where` is the
    entry as given, for the error."""
    name = key.strip().lstrip("-").replace("-", "_")
    if name not in FIELDS:
        close = difflib.get_close_matches(name, FIELDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(
            f"{where}: {key} is not a training setting{hint}; the keys are the flags of "
            f"main_multi_gpu.py --help, e.g. lr or batch_size"
        )
    if name in PER_EXPERIMENT:
        raise UsageError(f"{where}: --{flag(name)} is set for each run by {PER_EXPERIMENT[name]}")
    return name


def setting_value(name: str, text: str, where: str, train_argv: Sequence[str]) -> tuple[Any, list[str]]:
    """Field `name` set to `text` by the training flags' own rules (a value main_multi_gpu.py would refuse is
    refused in the same words), as (the value as TrainConfig holds it, the training flags that set it)."""
    value_flags = _value_flags(name, text, where)
    try:
        return getattr(parse_config([*train_argv, *value_flags]), name), value_flags
    except UsageError as error:
        hint = " (values holding commas: separate them with ';')" if name == "image_shape" else ""
        raise UsageError(f"{where}: {error}{hint}") from None


def setting_values(
    name: str, texts: Sequence[str], where: str, train_argv: Sequence[str]
) -> tuple[tuple[Any, ...], tuple[tuple[str, ...], ...]]:
    """Several values of field `name` (setting_value), none given twice: (the values, the flags of each)."""
    values, flags = [], []
    for text in texts:
        value, value_flags = setting_value(name, text, where, train_argv)
        if value in values:
            raise UsageError(f"{where}: the value {value} is given twice")
        values.append(value)
        flags.append(tuple(value_flags))
    return tuple(values), tuple(flags)


def _value_flags(name: str, text: str, where: str) -> list[str]:
    """The training flags that set field `name` to `text` (a bool field is --x or --no-x)."""
    if FIELDS[name].type not in ("bool", bool):
        return [f"--{flag(name)}", text]
    if text.lower() in TRUE_WORDS:
        return [f"--{flag(name)}"]
    if text.lower() in FALSE_WORDS:
        return [f"--no-{flag(name)}"]
    raise UsageError(f"{where}: --{flag(name)} is on or off; give true or false, not {text!r}")


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The first setting in which two fingerprints differ, as 'FLAG THERE (sweep) vs HERE (command)'; None if equal."""
    for name in sorted(set(saved.get("base", {})) | set(current["base"])):
        there, here = saved.get("base", {}).get(name), current["base"].get(name)
        if there != here:
            return f"--{flag(name)} {_shown(there)} (the sweep's) vs {_shown(here)} (this command's)"
    if saved.get("search") != current.get("search"):
        return _search_difference(saved.get("search"), current.get("search"))
    if saved.get("grid") != current["grid"]:
        return (
            f"--grid {_grid_text(saved.get('grid', {}))} (the sweep's) vs {_grid_text(current['grid'])} "
            f"(this command's)"
        )
    for name in ("gpus_per_run", "threads_per_run"):
        if saved.get(name) != current[name]:
            return f"--{flag(name)} {saved.get(name)} (the sweep's) vs {current[name]} (this command's)"
    return None


def _search_difference(there: dict[str, Any] | None, here: dict[str, Any] | None) -> str:
    """The first --search setting (--space, --sampler, ...) in which a sweep and a command differ."""
    if there is None or here is None:
        kinds = ["a grid" if side is None else "--search optuna" for side in (there, here)]
        return f"{kinds[0]} (the sweep's) vs {kinds[1]} (this command's)"
    name = next(name for name in sorted({*there, *here}) if there.get(name) != here.get(name))
    return (
        f"--{flag(name)} {_shown(there.get(name))} (the sweep's) vs {_shown(here.get(name))} (this command's)"
    )


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "unset" if value is None else str(value)


def _grid_text(grid: dict[str, list[Any]]) -> str:
    return " ".join(f"{name}={','.join(map(str, values))}" for name, values in grid.items()) or "(none)"
