"""Measurement: the validation loss after training with packing that keeps documents apart (--packing documents)
against packing that lets them attend to each other (--packing stream), on the same data and steps
(docs/measured.md, "Packing with document boundaries").

    python benchmarks/packing_loss.py                    # 3 seeds, 150 steps each, --json FILE too
    python benchmarks/packing_loss.py --seeds 1 --steps 30    # a quick look

The data and model: examples/tiny_language_model.py's folder (400 training texts of 1 to 4 sentences, 80 held
out; an untrained GPT-2 of 1 layer, width 32, 64 positions). Each seed trains the model twice through the command
line, `--packing documents` and `--packing stream`, at --block-size 32, batch 16, lr 3e-3 with the cosine
schedule over --steps optimizer steps (--max-steps), and then evaluates the last weights of each with --eval-only
twice: on the held-out texts each alone (`--packing documents`: the loss a text has when nothing precedes it, the
one a model meets when it is prompted) and on the stream windows (`--packing stream`: each text after the ones
before it). The table: the losses of each training, medians and ranges over the seeds, and the difference of the
two trainings on each evaluation. Exit status 0 (a measurement, no target), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import machine_line, write_markdown  # noqa: E402

PACKINGS = ("documents", "stream")


def cli(args: list[str]) -> None:
    """main_multi_gpu.py with `args`, in this process, its output kept out of the table's; exit on a failure."""
    import main_multi_gpu

    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = main_multi_gpu.main(args)
    if code:
        sys.exit(f"main_multi_gpu.py {' '.join(args)} failed (exit {code}):\n{said.getvalue()[-3000:]}")


def measure(folder: Path, seed: int, steps: int) -> dict[str, dict[str, float]]:
    """For each packing of the training: its last weights' validation loss on texts alone and on the stream."""
    data = [
        "--dataset",
        "hf",
        "--data-files",
        str(folder / "train.jsonl"),
        "--val-files",
        str(folder / "val.jsonl"),
    ]
    data += [
        "--text-column",
        "text",
        "--model-path",
        str(folder / "model"),
        "--block-size",
        "32",
        "--no-progress",
    ]
    losses: dict[str, dict[str, float]] = {}
    for trained in PACKINGS:
        run = folder / "runs" / f"{trained}-{seed}"
        schedule = ["--epochs", "1000", "--max-steps", str(steps), "--batch-size", "16", "--lr", "3e-3"]
        cli([*data, "--packing", trained, "--seed", str(seed), *schedule, "--save-dir", str(run)])
        losses[trained] = {}
        for evaluated in PACKINGS:
            into = folder / "evals" / f"{trained}-{seed}-on-{evaluated}"
            cli(
                [
                    *data,
                    "--packing",
                    evaluated,
                    "--eval-only",
                    "--resume",
                    str(run / "last.pt"),
                    "--save-dir",
                    str(into),
                ]
            )
            losses[trained][evaluated] = json.loads((into / "eval.json").read_text())["val_loss"]
    return losses


def main() -> int:
    args = parse_args()
    from examples.tiny_language_model import write_tiny_language_model

    with tempfile.TemporaryDirectory(prefix="packing-loss-") as scratch:
        folder = write_tiny_language_model(Path(scratch))
        per_seed = {}
        for seed in range(args.seeds):
            per_seed[seed] = measure(folder, seed, args.steps)
            print(f"seed {seed}: {json.dumps(per_seed[seed])}", flush=True)
    rows = []
    for trained in PACKINGS:
        cells = [trained]
        for evaluated in PACKINGS:
            values = [losses[trained][evaluated] for losses in per_seed.values()]
            cells.append(f"{statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f})")
        rows.append(cells)
    gaps = {
        evaluated: [
            losses["stream"][evaluated] - losses["documents"][evaluated] for losses in per_seed.values()
        ]
        for evaluated in PACKINGS
    }
    rows.append(
        ["stream - documents"]
        + [
            f"{statistics.median(gaps[e]):+.4f} ({min(gaps[e]):+.4f} to {max(gaps[e]):+.4f})"
            for e in PACKINGS
        ]
    )
    write_markdown(
        Path(args.output) if args.output else REPO / "benchmarks" / "results" / "packing_loss_cpu.md",
        "Validation loss after packing with and without document boundaries (benchmarks/packing_loss.py)",
        ["trained with --packing", "val loss, each text alone", "val loss, stream windows"],
        rows,
        [
            machine_line(),
            f"examples/tiny_language_model.py's folder: 400 training texts, 80 held out, a GPT-2 of 1 layer; "
            f"--block-size 32, batch 16, AdamW lr 3e-3, cosine over {args.steps} steps; {args.seeds} seed(s): "
            f"median (range)",
            f"command: python benchmarks/packing_loss.py {' '.join(sys.argv[1:])}".rstrip(),
        ],
    )
    if args.json:
        Path(args.json).write_text(json.dumps(per_seed, indent=1))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--seeds", type=int, default=3, help="trainings of each packing, seeds 0 to N-1")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of each training")
    parser.add_argument("--output", help="Markdown file (default benchmarks/results/packing_loss_cpu.md)")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    for name in ("seeds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")  # exit status 2
    return args


if __name__ == "__main__":
    sys.exit(main())
