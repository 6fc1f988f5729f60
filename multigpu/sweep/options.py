"""The sweep's own flags, and how a command line is split into sweep flags and training flags.

Two spellings of one sweep: `sweep_multi_gpu.py [sweep flags] -- [training flags]`, and the design
notes' `main_multi_gpu.py --num-seeds N --max-gpus G [training flags]`, where the two kinds are mixed.
Every sweep flag is also accepted with underscores (`--num_seeds`). See docs/sweeps.md, "Sweeps".
"""

from __future__ import annotations

import argparse
import os
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from multigpu.config import OneLineParser
from multigpu.errors import UsageError

DEFAULT_CPU_WORKERS = 2
SAMPLERS, PRUNERS = (
    ("tpe", "random"),
    ("none", "median", "asha", "hyperband"),
)  # --sampler's, --prune's (study.py)
MAX_ARRAY_TASKS = 1000  # SLURM's default MaxArraySize is 1001


@dataclass
class SweepOptions:
    """Everything a sweep is told besides the training flags of its runs."""

    sweep_dir: str | None = None  # None: checkpoints/sweep-N, chosen by the plan (plan.default_sweep_dir)
    seeds: list[int] = field(default_factory=lambda: [0])
    grid: list[str] = field(default_factory=list)  # KEY=V1,V2 tokens as given
    max_gpus: int | None = None  # None: every visible GPU
    workers: int | None = None  # CPU slots; None: DEFAULT_CPU_WORKERS
    gpus_per_run: int = 1
    threads_per_run: int = 1
    checkpoint_interval: float = 60.0
    retries: int = 0
    retry_failed: bool = False
    shard: tuple[int, int] = (0, 1)  # (index, count)
    slurm: bool = False
    submit: bool = False
    shards: int | None = None  # array tasks of --slurm; None: one per experiment
    sbatch_args: list[str] = field(default_factory=list)
    search: str | None = None  # "optuna": sample the points (multigpu/sweep/search.py); None: the grid
    trials: int = 0  # --search: the study's trials, every shard's together
    space: list[str] = field(default_factory=list)  # --search: KEY=DIST tokens as given
    sampler: str = SAMPLERS[0]
    prune: str = PRUNERS[0]
    search_seed: int = 0

    @property
    def sharded(self) -> bool:
        return self.shard[1] > 1


def _spellings(flag: str) -> list[str]:
    underscored = "--" + flag[2:].replace("-", "_")
    return [flag] if underscored == flag else [flag, underscored]


# flag -> (argparse keyword arguments). The table is the one list of sweep flags: the parser and
# `requested` (which tells main_multi_gpu.py that it is asked for a sweep) are both built from it.
FLAGS: dict[str, dict] = {
    "--num-seeds": dict(type=int, metavar="N", help="run seeds 0..N-1 of every grid point (default 1)"),
    "--seeds": dict(metavar="S1,S2", help="run exactly these seeds, e.g. 3,7,11"),
    "--grid": dict(
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=V1,V2",
        help="TrainConfig fields and their values; the sweep runs the cross product, e.g. "
        "--grid lr=1e-3,3e-3 batch_size=32,64 (values holding commas: separate them with ';')",
    ),
    "--sweep-dir": dict(
        metavar="DIR",
        help="the sweep's directory: DIR/<grid point>/seed-<k>/ per run, results, summary "
        "(default: checkpoints/sweep-N, the one of a sweep with the same settings, else a new "
        "N)",
    ),
    "--max-gpus": dict(
        type=int,
        metavar="G",
        help="GPUs to use (default: every visible GPU); with --slurm: at most G GPUs busy at once",
    ),
    "--workers": dict(
        type=int,
        metavar="N",
        help=f"CPU slots on a machine without GPUs (default {DEFAULT_CPU_WORKERS}); with --slurm: CPU tasks",
    ),
    "--gpus-per-run": dict(
        type=int,
        default=1,
        metavar="K",
        help="devices per run: K > 1 runs each experiment as a K-process DDP job under torchrun",
    ),
    "--threads-per-run": dict(
        type=int,
        default=1,
        metavar="T",
        help="CPU threads of each run's processes (fixed, so a result does not depend on "
        "how many workers ran the sweep)",
    ),
    "--checkpoint-interval": dict(
        type=float,
        default=60.0,
        metavar="S",
        help="rewrite DIR/progress.json every S seconds (and at every finished run)",
    ),
    "--retries": dict(type=int, default=0, metavar="R", help="run a failed experiment up to R more times"),
    "--retry-failed": dict(
        action="store_true", help="run again the experiments that failed in earlier sweeps"
    ),
    "--shard": dict(
        metavar="I/N",
        help="run only the I-th of N shards of the experiment list, 0 <= I < N "
        "(default from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT)",
    ),
    "--slurm": dict(
        action="store_true", help="write DIR/sweep.sbatch, a SLURM job array that runs the shards"
    ),
    "--submit": dict(action="store_true", help="with --slurm: also submit it with sbatch"),
    "--shards": dict(
        type=int, metavar="N", help="with --slurm: array tasks (default: one per experiment, or per trial)"
    ),
    "--sbatch-arg": dict(
        action="append",
        default=[],
        dest="sbatch_args",
        metavar="ARG",
        help="with --slurm: an extra #SBATCH line, e.g. --sbatch-arg=--time=04:00:00",
    ),
    "--search": dict(
        choices=["optuna"],
        help="sample the settings instead of running a grid: an Optuna study "
        "kept in DIR/study.journal (pip install '.[search]')",
    ),
    "--trials": dict(
        type=int,
        metavar="N",
        help="with --search: trials of the study, every shard's together; "
        "a rerun with a larger N adds trials",
    ),
    "--space": dict(
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=DIST",
        help="with --search: a training setting and how to sample it: log(LO,HI), uniform(LO,HI), "
        "int(LO,HI) or choice(A,B,...), e.g. --space lr=log(1e-4,1e-1) batch_size=choice(32,64)",
    ),
    "--sampler": dict(choices=SAMPLERS, help=f"with --search: Optuna's sampler (default {SAMPLERS[0]})"),
    "--prune": dict(
        choices=PRUNERS,
        help=f"with --search: stop trials early by Optuna's median, successive "
        f"halving (asha) or hyperband pruner, asked at every epoch end "
        f"(default {PRUNERS[0]})",
    ),
    "--search-seed": dict(
        type=int,
        metavar="S",
        help="with --search: the sampler's seed (default 0); trial n "
        "is drawn from S and n, so a rerun draws the same",
    ),
}
SPELLINGS = {spelling for flag in FLAGS for spelling in _spellings(flag)}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the sweep flags (abbreviations off: --seeds must never be read as --seed)."""
    parser = OneLineParser(
        prog="sweep_multi_gpu.py",
        allow_abbrev=False,
        usage="%(prog)s [sweep flags] -- [training flags of main_multi_gpu.py]",
        description="Run many independent training runs (seeds x a grid) over the devices, "
        "one run per device slot; resumable. See docs/sweeps.md.",
    )
    for flag, kwargs in FLAGS.items():
        parser.add_argument(*_spellings(flag), **kwargs)
    return parser


def requested(argv: Sequence[str]) -> bool:
    """Whether a main_multi_gpu.py command line holds a sweep flag (the design notes' form)."""
    return any(arg.split("=", 1)[0] in SPELLINGS for arg in argv)


# The training flag the sweep's own progress bar follows (cli.py: the runs show none of their own): welcome on
# either side of `--`, as docs/sweeps.md presents it with the sweep's bar.
BOTH_SIDES = ("--progress", "--no-progress")


def split_separated(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """`[sweep flags] -- [training flags]` -> (sweep flags, training flags); --progress/--no-progress given
    before `--` are training flags too."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    before, after = argv[:cut], argv[cut + 1 :]
    shared = [arg for arg in before if arg.split("=", 1)[0] in BOTH_SIDES]
    return [arg for arg in before if arg not in shared], shared + after


def parse(
    sweep_argv: Sequence[str], mixed: bool = False, environ: dict[str, str] | None = None
) -> tuple[SweepOptions, list[str]]:
    """The sweep options and the leftover training flags.

    `mixed`: the training flags are interleaved (main_multi_gpu.py's form); otherwise an unknown
    flag is an error that points at `--`.
    """
    args, rest = build_parser().parse_known_args(list(sweep_argv))
    if rest and not mixed:
        raise UsageError(
            f"unrecognized sweep flags: {' '.join(rest)} (training flags go after --, "
            f"e.g. sweep_multi_gpu.py --num-seeds 3 -- --epochs 5)"
        )
    return _options(args, os.environ if environ is None else environ), rest


def _options(args: argparse.Namespace, environ: Mapping[str, str]) -> SweepOptions:
    if args.num_seeds is not None and args.seeds is not None:
        raise UsageError("give --num-seeds N or --seeds S1,S2, not both")
    positive = {
        "--num-seeds": args.num_seeds,
        "--max-gpus": args.max_gpus,
        "--workers": args.workers,
        "--gpus-per-run": args.gpus_per_run,
        "--threads-per-run": args.threads_per_run,
        "--shards": args.shards,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.retries < 0:
        raise UsageError(f"--retries must not be negative, got {args.retries}")
    if not args.checkpoint_interval > 0:
        raise UsageError(f"--checkpoint-interval must be positive (seconds), got {args.checkpoint_interval}")
    if (args.submit or args.shards is not None or args.sbatch_args) and not args.slurm:
        raise UsageError("--submit, --shards and --sbatch-arg belong to --slurm; add --slurm")
    if args.slurm and args.shard is not None:
        raise UsageError(
            "--shard runs one shard; --slurm writes the script that runs them all: give one of them"
        )
    _check_search(args)
    if args.sweep_dir is not None:
        check_sweep_dir(args.sweep_dir)
    if args.slurm:
        # These land in the job script's comments and #SBATCH lines, where a newline would start a shell line
        # (quoting cannot help there); every other value is shell-quoted (multigpu/sweep/slurm.py).
        # Without --sweep-dir the sweep dir is under the working directory: its path is what reaches the script.
        for flag, value in [
            ("--sweep-dir", os.path.abspath(args.sweep_dir or os.curdir)),
            *[("--sbatch-arg", arg) for arg in args.sbatch_args],
        ]:
            if any(unicodedata.category(char) == "Cc" for char in value):
                raise UsageError(
                    f"{flag} {value!r} holds a newline or another control character, which the "
                    f"--slurm job script cannot carry; remove it"
                )
    return SweepOptions(
        sweep_dir=args.sweep_dir,
        seeds=_seeds(args.seeds, args.num_seeds),
        grid=list(args.grid),
        max_gpus=args.max_gpus,
        workers=args.workers,
        gpus_per_run=args.gpus_per_run,
        threads_per_run=args.threads_per_run,
        checkpoint_interval=args.checkpoint_interval,
        retries=args.retries,
        retry_failed=args.retry_failed,
        shard=_shard(args.shard, environ) if not args.slurm else (0, 1),
        slurm=args.slurm,
        submit=args.submit,
        shards=args.shards,
        sbatch_args=list(args.sbatch_args),
        search=args.search,
        trials=args.trials or 0,
        space=list(args.space),
        sampler=args.sampler or SAMPLERS[0],
        prune=args.prune or PRUNERS[0],
        search_seed=args.search_seed or 0,
    )


def _check_search(args: argparse.Namespace) -> None:
    """--search's flags go together, and a search is not a grid."""
    own = {
        "--trials": args.trials,
        "--space": args.space or None,
        "--sampler": args.sampler,
        "--prune": args.prune,
        "--search-seed": args.search_seed,
    }
    if args.search is None:
        given = [flag for flag, value in own.items() if value is not None]
        if given:
            raise UsageError(
                f"{', '.join(given)} {'belongs' if len(given) == 1 else 'belong'} to --search; add "
                f"--search optuna"
            )
        return
    if args.grid:
        raise UsageError(
            "give --grid (every point of a grid) or --search optuna (points sampled from --space), not both"
        )
    if args.trials is None:
        raise UsageError("--search needs --trials N: how many trials the study runs")
    if args.trials < 1:
        raise UsageError(f"--trials must be at least 1, got {args.trials}")
    if not args.space:
        raise UsageError("--search needs --space KEY=DIST, e.g. --space lr=log(1e-4,1e-1)")
    if args.search_seed is not None and args.search_seed < 0:
        raise UsageError(f"--search-seed must not be negative, got {args.search_seed}")
    if args.retry_failed:
        raise UsageError(
            "--retry-failed with --search: a failed trial is final in the study; give a larger "
            "--trials to sample more, or --retries R to retry a failed run before its trial ends"
        )


def check_sweep_dir(path: str) -> None:
    """The sweep dir is a folder, or a path that can become one: no file stands in its way."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = path if probe == os.path.abspath(path) else f"{path}: {probe}"
        raise UsageError(f"--sweep-dir {what} is a file, not a folder; choose another path")


def _seeds(text: str | None, count: int | None) -> list[int]:
    if text is None:
        return list(range(count or 1))
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds must be distinct non-negative integers like 3,7,11; got {text!r}")
    return seeds


def _shard(text: str | None, environ: Mapping[str, str]) -> tuple[int, int]:
    """--shard I/N, else SLURM's array task (its id counted from the array's first id), else 0/1."""
    if text is None and "SLURM_ARRAY_TASK_ID" in environ:
        if "SLURM_ARRAY_TASK_COUNT" not in environ:
            raise UsageError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not: give --shard I/N")
        first = int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        text = f"{int(environ['SLURM_ARRAY_TASK_ID']) - first}/{environ['SLURM_ARRAY_TASK_COUNT']}"
        source = " (from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT)"
    elif text is None:
        return 0, 1
    else:
        source = ""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise UsageError(f"--shard must be I/N with 0 <= I < N, e.g. 0/4; got {text!r}{source}")
    return index, count


def to_argv(options: SweepOptions, *, for_task: bool) -> list[str]:
    """Sweep flags that reproduce `options`; `for_task`: those an array task of --slurm needs."""
    argv = ["--sweep-dir", options.sweep_dir] if options.sweep_dir is not None else []
    argv += ["--seeds", ",".join(map(str, options.seeds))]
    if options.grid:
        argv += ["--grid", *options.grid]
    argv += [
        "--gpus-per-run",
        str(options.gpus_per_run),
        "--threads-per-run",
        str(options.threads_per_run),
        "--checkpoint-interval",
        f"{options.checkpoint_interval:g}",
        "--retries",
        str(options.retries),
    ]
    if options.retry_failed:
        argv.append("--retry-failed")
    if options.search:
        argv += [
            "--search",
            options.search,
            "--trials",
            str(options.trials),
            "--space",
            *options.space,
            "--sampler",
            options.sampler,
            "--prune",
            options.prune,
            "--search-seed",
            str(options.search_seed),
        ]
    if options.workers is not None:
        argv += ["--workers", str(options.workers)]
    if options.max_gpus is not None and not for_task:
        argv += ["--max-gpus", str(options.max_gpus)]
    return argv
