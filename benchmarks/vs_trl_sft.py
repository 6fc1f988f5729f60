"""Benchmark: this project's instruction tuning against TRL's SFTTrainer, side by side, on one tiny causal LM and
prompt/completion JSONL with packing (docs/measured.md, "Against TRL's SFTTrainer").

    python benchmarks/vs_trl_sft.py                      # 1 process and DDP over 2; 5 rounds; --json FILE too
    python benchmarks/vs_trl_sft.py --nproc 2 --rounds 3 --rows 4000
    python benchmarks/vs_trl_sft.py --tiny               # CI: 1 process, 1 layer, 240 rows, one round

The workload: --rows prompt/completion rows made of examples/tiny_language_model.py's sentences (the prompt a
text's first sentence, the completion the rest, " the end ." where there is none), a BPE tokenizer the
`tokenizers` library trains on them, and a GPT-2 built from a config (--layers, --embd, --heads, a context of
--block, dropout off), saved once with seed 0; both contenders load that folder. Each trains one epoch of the
rows, packed into windows of --block tokens, with the loss on the completion tokens (and the end-of-text token)
only:
- this project: `--dataset hf --prompt-column prompt --completion-column completion --packing documents`
  (the defaults: --loss-on completion; whole texts packed best-fit decreasing, each attending to itself), as the
  command line builds it (build_datasets, build_model, MultiGPUTrainer);
- TRL: SFTTrainer with packing=True (its default strategy, bfd: best-fit decreasing, padding-free with
  position_ids restarting at each text) and completion_only_loss (its default for prompt/completion data).

What is matched: fp32 on both (SFTConfig's bf16 defaults to True, on the CPU too, and its gradient_checkpointing to
True: both set False, so that both do the same work); torch.optim.AdamW (lr 1e-3, weight decay 0) built by one
function for both; a constant LR, no warm-up, no clipping (SFTConfig's max_grad_norm 1.0 set to 0); --batch
windows per process and step, loader workers 0, logging every --log-every steps, no evaluation or checkpoint
during training; --threads intra-op threads per process.

The tokens that count per epoch are counted in the driver, from each contender's own prepared training set: ours
the targets of our windows (labels != -100, the model's shift: each window's first label is none, and each text's
first label is -100), TRL's the same of its packed rows (its collator sets the label of each text's first token
to -100). Equal counts mean the same tokens train; the table says so, or by how much and why they differ.

Measured on rank 0: a timestamp at each optimizer step's end (a callback of each); tokens/s = the counted tokens
of an epoch times (steps - --warmup) / steps, over the time from the end of step --warmup to the end of the last
(the windows are shuffled, so a step's count varies: the epoch's mean is taken). After training, one function
computes each contender's validation loss: the mean over the completion tokens of each validation row alone.

Every contender runs in fresh processes (torchrun for 2, gloo on the CPU), in an order reversed every other round;
the table gives medians (ranges) over the rounds and the load average. Exit status: 0 when the counted tokens are
equal and ours/TRL >= 1.0 at every process count, 1 when not, 2 on bad arguments. Where the rows are at most
1000 (--tiny's 240), TRL's best-fit-decreasing windows are ours, in the same order: both train the same weights,
and the validation losses agree (the tests hold them to 1e-4); above, TRL packs each of datasets.map's batches of
1000 rows alone, and its windows differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import (  # noqa: E402
    RESULT,
    StepEnds,
    alternating_rounds,
    benchmark_parser,
    machine_line,
    run_worker,
    write_markdown,
)

CONTENDERS = ("ours", "trl")
NAMES = {"ours": "this project", "trl": "TRL SFTTrainer"}
SEED = 0
LR, WEIGHT_DECAY = 1e-3, 0.0
MIN_RATIO = 1.0  # the target: ours/TRL at least this at every process count


# ------------------------------------------------------------------ the workload, alike for both
def write_workload(args, folder: Path) -> None:
    """folder/train.jsonl, folder/val.jsonl ({"prompt", "completion"} a line) and folder/model (the GPT-2 and its
    tokenizer), all made here, offline."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from examples.tiny_language_model import prompt_completion, texts, train_tokenizer

    rows = {"train": texts(args.rows, seed=1), "val": texts(args.val_rows, seed=2)}
    for name, chosen in rows.items():
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps(prompt_completion(text)) + "\n" for text in chosen)
        )
    tokenizer = train_tokenizer(rows["train"])
    torch.manual_seed(SEED)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")


def adamw(params) -> Any:
    """The optimizer of both contenders."""
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def our_config(args, folder: Path, world: int, scratch: str) -> Any:
    from multigpu.config import parse_config

    return parse_config(
        [
            "--dataset",
            "hf",
            "--data-files",
            str(folder / "train.jsonl"),
            "--prompt-column",
            "prompt",
            "--completion-column",
            "completion",
            "--model-path",
            str(folder / "model"),
            "--block-size",
            str(args.block),
            "--packing",
            "documents",
            "--batch-size",
            str(args.batch),
            "--epochs",
            "1",
            "--lr",
            str(LR),
            "--weight-decay",
            str(WEIGHT_DECAY),
            "--lr-schedule",
            "constant",
            "--log-every",
            str(args.log_every),
            "--no-progress",
            "--multi-gpu",
            "ddp" if world > 1 else "none",
            "--save-dir",
            scratch,
        ]
    )


def trl_trainer(args, folder: Path, scratch: str, model: Any, callbacks: list) -> Any:
    """TRL's SFTTrainer with its defaults but the workload's (the module docstring)."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        output_dir=scratch,
        per_device_train_batch_size=args.batch,
        num_train_epochs=1,
        max_length=args.block,
        packing=True,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=0.0,
        bf16=False,
        gradient_checkpointing=False,
        seed=SEED,
        data_seed=SEED,
        dataloader_num_workers=0,
        logging_steps=args.log_every,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    return SFTTrainer(
        model=model,
        args=config,
        train_dataset=load_dataset("json", data_files=str(folder / "train.jsonl"), split="train"),
        processing_class=AutoTokenizer.from_pretrained(folder / "model"),
        optimizers=(adamw(model.parameters()), None),
        callbacks=callbacks,
    )


# ------------------------------------------------------------------ the tokens that count, per contender
def our_counts(args, folder: Path, scratch: str) -> tuple[int, int]:
    """(counted targets, windows) of our training set."""
    from multigpu.data import build_datasets

    train = build_datasets(our_config(args, folder, 1, scratch)).train
    counted = sum(int((train[index]["labels"][1:] != -100).sum()) for index in range(len(train)))
    return counted, len(train)


def trl_counts(args, folder: Path, scratch: str) -> tuple[int, int]:
    """(counted targets, packed rows) of TRL's prepared training set: per text of each row, its labels but the
    first (the collator's -100 at each position_ids 0) that are not -100."""
    from transformers import AutoModelForCausalLM

    trainer = trl_trainer(args, folder, scratch, AutoModelForCausalLM.from_pretrained(folder / "model"), [])
    counted = 0
    for row in trainer.train_dataset:
        start = 0
        for length in row["seq_lengths"]:
            counted += sum(1 for label in row["labels"][start + 1 : start + length] if label != -100)
            start += length
    return counted, len(trainer.train_dataset)


def validation_loss(model, folder: Path) -> float:
    """The mean cross-entropy over the completion tokens (and end-of-text) of each validation row alone."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for line in (folder / "val.jsonl").read_text().splitlines():
            row = json.loads(line)
            prompt = len(tokenizer(row["prompt"])["input_ids"])
            ids = torch.tensor(
                tokenizer(row["prompt"] + row["completion"])["input_ids"] + [tokenizer.eos_token_id]
            )
            logits = model(input_ids=ids[None]).logits[0]
            total += F.cross_entropy(logits[prompt - 1 : -1].double(), ids[prompt:], reduction="sum")
            count += len(ids) - prompt
    return total.item() / count


# ------------------------------------------------------------------ the contenders (in the worker processes)
def run_ours(args, folder: Path, world: int, ends: StepEnds, scratch: str) -> Any:
    """The command line's path: its data set, its model, MultiGPUTrainer; returns the trained module."""
    import torch

    from multigpu.data import build_datasets
    from multigpu.models import build_model
    from train_multi_gpu import MultiGPUTrainer

    config = our_config(args, folder, world, scratch)
    data = build_datasets(config)
    torch.manual_seed(config.seed)
    model = build_model("hf", data.input_shape, data.num_classes, config)
    trainer = MultiGPUTrainer(model, data.train, None, config, collate_fn=data.collate_fn, callbacks=[ends])
    trainer.fit()
    return trainer.model


def run_trl(args, folder: Path, world: int, ends: StepEnds, scratch: str) -> Any:
    from transformers import AutoModelForCausalLM, TrainerCallback

    class Ends(TrainerCallback):
        on_step_end = ends.on_step_end  # the same bound method the project's run calls: one way of timing

    trainer = trl_trainer(
        args, folder, scratch, AutoModelForCausalLM.from_pretrained(folder / "model"), [Ends()]
    )
    trainer.train()
    return trainer.model


RUNS: dict[str, Callable[..., Any]] = {"ours": run_ours, "trl": run_trl}


def worker(args) -> None:
    """One contender's run; rank 0 prints its RESULT line."""
    import torch

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    folder = Path(args.workload)
    ends = StepEnds()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
        trained = RUNS[args.worker](args, folder, world, ends, scratch)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    steps = len(ends.at)
    if steps <= args.warmup:
        sys.exit(f"{NAMES[args.worker]} took {steps} optimizer steps, not more than --warmup {args.warmup}")
    seconds = ends.at[-1] - ends.at[args.warmup - 1]
    counted = args.counted[args.worker]
    figures = {
        "tokens_per_sec": counted * (steps - args.warmup) / steps / seconds,
        "seconds": seconds,
        "steps": steps,
        "val_loss": validation_loss(trained, folder),
    }
    print(RESULT + json.dumps(figures), flush=True)


# ------------------------------------------------------------------ rounds and the table (the driver)
def launch(args, contender: str, nproc: int, counted: dict[str, int]) -> dict[str, float]:
    threads = args.threads or max(1, (os.cpu_count() or 1) // nproc)
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        contender,
        "--workload",
        args.workload,
        "--counted",
        json.dumps(counted),
        "--threads",
        str(threads),
        *workload_flags(args),
    ]
    return run_worker(script, nproc, NAMES[contender], {"OMP_NUM_THREADS": str(threads)}, timeout=1800)


def workload_flags(args) -> list[str]:
    names = ("steps", "warmup", "batch", "log_every", "layers", "embd", "heads", "block", "rows", "val_rows")
    return [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def rows_for(nproc: int, per_round: dict[str, list[dict]], counted: dict[str, int]) -> tuple[list, list[str]]:
    """The table's two rows at one process count, and what missed the target there (empty: met)."""
    ratios = [
        ours["tokens_per_sec"] / trl["tokens_per_sec"]
        for ours, trl in zip(per_round["ours"], per_round["trl"])
    ]
    ratio = statistics.median(ratios)
    gaps = [ours["val_loss"] - trl["val_loss"] for ours, trl in zip(per_round["ours"], per_round["trl"])]
    gap = max(gaps, key=abs)
    rows = []
    for name in CONTENDERS:
        rates = [figures["tokens_per_sec"] for figures in per_round[name]]
        rows.append(
            [
                str(nproc),
                NAMES[name],
                f"{counted[name]:,}",
                str(per_round[name][0]["steps"]),
                f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f})",
                f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if name == "ours" else "",
                f"{statistics.median(figures['val_loss'] for figures in per_round[name]):.6f}",
                f"{gap:+.1e}" if name == "ours" else "",
            ]
        )
    missed = [f"{nproc} process(es): ours/TRL {ratio:.2f} < {MIN_RATIO}"] if ratio < MIN_RATIO else []
    return rows, missed


def main() -> int:
    args = parse_args()
    if args.worker:
        args.counted = json.loads(args.counted)
        worker(args)
        return 0
    missing = [name for name in ("transformers", "datasets", "trl") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: {' and '.join(missing)} not installed: pip install -e '.[trl]'", file=sys.stderr)
        return 2
    import transformers

    transformers.utils.logging.disable_progress_bar()  # saving the model: no bars in the driver's output
    counts = [int(count) for count in args.nproc.split(",")]
    with tempfile.TemporaryDirectory(prefix="vs-trl-workload-") as workload:
        args.workload = workload
        write_workload(args, Path(workload))
        counted, windows = {}, {}
        with tempfile.TemporaryDirectory(prefix="vs-trl-count-") as scratch:
            counted["ours"], windows["ours"] = our_counts(args, Path(workload), scratch)
            counted["trl"], windows["trl"] = trl_counts(args, Path(workload), scratch)
        print(
            f"tokens that count per epoch: ours {counted['ours']:,} in {windows['ours']} windows, TRL "
            f"{counted['trl']:,} in {windows['trl']} packed rows",
            flush=True,
        )
        results, load = alternating_rounds(
            args.rounds,
            [str(count) for count in counts],
            list(CONTENDERS),
            lambda nproc, name: launch(args, name, int(nproc), counted),
            lambda figures: f"{figures['tokens_per_sec']:.0f} tokens/s, val loss {figures['val_loss']:.4f}",
        )
    rows, missed = [], []
    for count in counts:
        made, miss = rows_for(count, {name: results[(str(count), name)] for name in CONTENDERS}, counted)
        rows += made
        missed += miss
    if counted["ours"] != counted["trl"]:
        missed.append(f"counted tokens differ: ours {counted['ours']:,}, TRL {counted['trl']:,}")
    header = [
        "processes",
        "contender",
        "tokens that count per epoch",
        "steps",
        "tokens/s",
        "ours/TRL",
        "val loss",
        "val loss difference (ours - TRL)",
    ]
    write_markdown(
        Path(args.output) if args.output else default_output(),
        "This project against TRL's SFTTrainer (benchmarks/vs_trl_sft.py)",
        header,
        rows,
        notes(args, counts, load, windows),
    )
    if args.json:
        raw = {f"{nproc} {name}": figures for (nproc, name), figures in results.items()}
        Path(args.json).write_text(
            json.dumps({"counted": counted, "windows": windows, "rounds": raw}, indent=1)
        )
    print(
        "target met: equal counted tokens, and ours/TRL >= 1.0 at every process count"
        if not missed
        else "target missed: " + "; ".join(missed),
        flush=True,
    )
    return 1 if missed else 0


def notes(args, counts: list[int], load: tuple[float, float], windows: dict[str, int]) -> list[str]:
    import importlib.metadata

    threads = ", ".join(
        f"{args.threads or max(1, (os.cpu_count() or 1) // c)} thread(s) per process at {c}" for c in counts
    )
    return [
        machine_line() + f"; transformers {importlib.metadata.version('transformers')}, TRL "
        f"{importlib.metadata.version('trl')}; load average {load[0]:.2f} before, {load[1]:.2f} after",
        f"GPT-2 of {args.layers} layer(s), width {args.embd}, {args.heads} heads, context {args.block}; {args.rows} "
        f"prompt/completion rows packed into windows of {args.block} tokens (ours {windows['ours']} windows, TRL "
        f"{windows['trl']} packed rows), loss on the completions; batch {args.batch} per process, one epoch, "
        f"AdamW lr {LR:g}, constant LR, no clipping, fp32, no gradient checkpointing, {threads}",
        f"tokens/s: rank 0's, the epoch's counted tokens over the steps after the first {args.warmup}, median "
        f"(range) of {args.rounds} interleaved round(s); ours/TRL: the median of the rounds' ratios",
        f"val loss: per completion token over {args.val_rows} held-out rows, each alone, after the epoch; the "
        f"difference: the largest over the rounds. The same windows in the same order train the same weights "
        f"(up to 1000 rows); above, TRL packs each of datasets.map's batches of 1000 rows alone, and its windows "
        f"differ from ours, which are packed over the whole set",
        f"command: python benchmarks/vs_trl_sft.py {' '.join(sys.argv[1:])}".rstrip(),
    ]


def default_output() -> Path:
    import torch

    return REPO / "benchmarks" / "results" / f"vs_trl_sft_{'gpu' if torch.cuda.is_available() else 'cpu'}.md"


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=5,
        steps=0,
        batch=8,
        log_every=10,
        steps_help="unused: one epoch of --rows",
        output_help="Markdown file (default benchmarks/results/vs_trl_sft_<cpu|gpu>.md)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="the first steps, left out of tokens/s")
    parser.add_argument(
        "--nproc", help="process counts, comma-separated (2 or more: DDP; default 1,2, --tiny 1)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per process (0: cores / processes)"
    )
    parser.add_argument("--rows", type=int, default=3000, help="prompt/completion rows of the training set")
    parser.add_argument("--val-rows", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=128, help="the model's width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=128, help="tokens per window, the model's context")
    parser.add_argument(
        "--tiny", action="store_true", help="1 layer, 240 rows, one round, 1 process unless --nproc"
    )
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--counted", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.nproc = args.nproc or ("1" if args.tiny else "1,2")
    if args.tiny:
        args.rounds, args.warmup, args.log_every, args.rows, args.val_rows = 1, 2, 3, 240, 20
        args.layers, args.embd, args.heads, args.block, args.batch = 1, 64, 2, 64, 4
    for problem in argument_problems(args):
        parser.error(problem)  # exit status 2
    return args


def argument_problems(args) -> list[str]:
    """What makes the arguments unusable, one line each."""
    names = ("rounds", "batch", "log_every", "layers", "embd", "heads", "block", "rows", "val_rows", "warmup")
    problems = [f"--{name.replace('_', '-')} must be at least 1" for name in names if getattr(args, name) < 1]
    if args.embd % max(args.heads, 1):
        problems.append(f"--heads {args.heads} must divide --embd {args.embd}")
    if not all(count.isdigit() and int(count) >= 1 for count in args.nproc.split(",")):
        problems.append(f"--nproc {args.nproc}: process counts of 1 or more, comma-separated")
    if args.threads < 0:
        problems.append("--threads must be 0 (cores / processes) or more")
    return problems


if __name__ == "__main__":
    sys.exit(main())
