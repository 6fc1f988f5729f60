"""Benchmark: this project's trainer against Hugging Face's Trainer, side by side, on one tiny causal LM
(docs/measured.md, "Against Hugging Face's Trainer").

    python benchmarks/vs_hf_trainer.py                   # 1 process and DDP over 2; 9 rounds; 60 steps
    python benchmarks/vs_hf_trainer.py --nproc 2 --rounds 5 --steps 100
    python benchmarks/vs_hf_trainer.py --tiny            # CI: 1 process (or --nproc), 1 layer, 6 steps, one round
    python benchmarks/vs_hf_trainer.py --lora-r 8        # LoRA: both train the same peft adapters, the base frozen

The workload: a GPT-2 (transformers.GPT2LMHeadModel) built from a config, no download: --layers blocks of width
--embd, --heads heads, a vocabulary of --vocab and a context of --block, dropout off (the two frameworks draw
their dropout masks from different generators). The driver builds it once with seed 0 and saves it with
save_pretrained; every contender loads that folder. The data: a deterministic token stream (a Markov chain with
a few likely successors per token, so there is something to learn) cut into windows of --block tokens, as
run_clm's grouping packs text: samples {input_ids, labels (= input_ids; the model shifts them), attention_mask}
with no padding, so per-sample and per-token weighting agree. The validation set is another walk of the
same chain.

What is matched, so that after the same steps both have the same weights:
- the optimizer: one function builds torch.optim.AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01
  on every parameter) for both: Hugging Face's Trainer gets it through `optimizers=`, the project's through
  `optimizer=`; a constant LR, no warm-up;
- no gradient clipping on either: Hugging Face's default max_grad_norm 1.0 is set to 0 (it still computes the
  gradient norm every step, for its logs: that is its cost), the project's clip_grad_norm is 0 by default;
- the order: shuffled, the same permutation on both. The project's sampler (data/sampler.py) draws
  torch.randperm(n) from a generator seeded with seed * 1_000_003 + epoch; Hugging Face's (Accelerate's
  SeedableRandomSampler) the same from data_seed + epoch. Seed 0 makes both torch.randperm(n) from seed 0. Under
  DDP each optimizer step holds the same samples on both (Accelerate gives rank r batches r, r+W, ... of that
  order, the project positions r, r+W, ... of it), split over the ranks differently, so only the
  summation order of the gradient's average differs. Should either library change its seeding, the validation
  losses part by far more than 1e-4 and the exit status says so;
- the loss: the model's own (mean cross-entropy over the shifted tokens). Hugging Face divides the sum by the
  tokens of the step over all ranks (num_items_in_batch), the project takes each rank's mean and DDP averages:
  with equal windows that is the same number;
- fp32, batch --batch per process, one epoch of exactly --steps steps, loader workers 0, no evaluation or
  checkpoint during training (the project saves last.pt after its last step, outside the timed span), logging
  every --log-every steps on both (the project to TensorBoard, its default; Hugging Face to its log history,
  its default report_to "none"), --threads intra-op threads per process (default 1: the two threads of one
  process on this shared 2-core machine waited on each other whenever it got less than its two cores, and runs
  were 2-13x slower at random; 0: the cores over the processes).

With --lora-r R both train LoRA adapters of rank R (alpha 2R) on every linear layer but the head, the base
frozen: the same PeftModel, made by one function for both (multigpu/parallel/lora.py's add_adapters: peft's
get_peft_model, the adapters' random start seeded alike); the project's run gets --lora-r, Hugging Face's Trainer
the PeftModel (as TRL's SFTTrainer gets one from peft_config), AdamW over the adapters on both.

Measured alike on rank 0: a timestamp at each optimizer step's end (a TrainerCallback's on_step_end; the project's
callback on_step_end); tokens/s = the tokens of the steps after the first --warmup / the time from the end of
step --warmup to the end of the last. After training rank 0 computes the per-token validation loss of the trained
weights with one function for both: the sum of the token cross-entropies (labels shifted) over the count of
tokens, over the whole validation set.

Every contender runs in fresh processes (torchrun for 2 or more, gloo on the CPU), the two in an order reversed
every other round. Nine rounds by default: on the shared 2-core machine a process got 55-100% of a core, at random
and for a whole run (a plain spinning loop shows it too), which halved a DDP run's speed at times, either
contender's. The table: tokens/s, median (range) over the rounds; ours/HF the median of the rounds' ratios;
the validation losses and the largest difference over the rounds. Exit status: 0 when at every process count
ours/HF >= 1.05 and |difference| <= 1e-4, 1 when not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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

CONTENDERS = ("ours", "hf")
NAMES = {"ours": "this project", "hf": "Hugging Face Trainer"}
SEED = 0  # both samplers draw torch.randperm(n) from a generator seeded 0 at seed 0 (the docstring)
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
MIN_RATIO, MAX_LOSS_GAP = 1.05, 1e-4  # the target: at least 5% ahead, the same validation loss
VAL_BATCH = 16  # windows per forward of the validation loss


# ------------------------------------------------------------------ the workload, alike for both
def token_stream(length: int, vocab: int, seed: int) -> list[int]:
    """`length` tokens of one Markov chain, the same for every `seed`: each token is followed by one of its 4
    successors, or 1 time in 10 by any token. The walk is drawn from `seed`: deterministic in all three."""
    import torch

    successors = torch.randint(vocab, (vocab, 4), generator=torch.Generator().manual_seed(SEED)).tolist()
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(4, (length,), generator=generator).tolist()
    anywhere = torch.randint(vocab, (length,), generator=generator).tolist()
    jumps = (torch.rand(length, generator=generator) < 0.1).tolist()
    tokens, token = [], 0
    for pick, other, jump in zip(picks, anywhere, jumps):
        token = other if jump else successors[token][pick]
        tokens.append(token)
    return tokens


class PackedWindows:
    """Windows of `block` tokens cut from one stream, as run_clm's group_texts packs text: labels are the inputs
    (the model shifts them), the attention mask all ones (no padding)."""

    def __init__(self, windows: int, block: int, vocab: int, seed: int):
        import torch

        self.ids = torch.tensor(token_stream(windows * block, vocab, seed)).view(windows, block)
        self.mask = torch.ones_like(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index], "attention_mask": self.mask[index]}


def training_set(args, world: int) -> PackedWindows:
    """Exactly one epoch of --steps steps at `world` processes."""
    return PackedWindows(args.steps * args.batch * world, args.block, args.vocab, seed=1)


def validation_set(args) -> PackedWindows:
    return PackedWindows(args.val_windows, args.block, args.vocab, seed=2)


def build_model(args, folder: str) -> None:
    """The GPT-2 both contenders start from, saved to `folder` (seed 0, dropout off)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.block,
        n_embd=args.embd,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=args.vocab - 1,
        eos_token_id=args.vocab - 1,
    )  # GPT-2's 50256 is no token here
    GPT2LMHeadModel(config).save_pretrained(folder)


def adamw(params) -> Any:
    """The optimizer of both contenders."""
    import torch

    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def validation_loss(model, data: PackedWindows) -> float:
    """Per-token cross-entropy over the whole set: the sum over every shifted token over their count."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ids, mask in zip(data.ids.split(VAL_BATCH), data.mask.split(VAL_BATCH)):
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            count += ids[:, 1:].numel()
    return total.item() / count


# ------------------------------------------------------------------ the contenders (in the worker processes)
def run_ours(model, data, args, world: int, ends: StepEnds, scratch: str) -> Any:
    """MultiGPUTrainer with its defaults but the workload's, writing under `scratch`; returns the trained
    module."""
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    config = TrainConfig(
        multi_gpu="ddp" if world > 1 else "none",
        epochs=1,
        batch_size=args.batch,
        lr_schedule="constant",
        log_every=args.log_every,
        progress=False,
        seed=SEED,
        save_dir=scratch,
        lora_r=args.lora_r,
    )
    trainer = MultiGPUTrainer(model, data, None, config, optimizer=adamw, callbacks=[ends])
    trainer.fit()
    return trainer.model


def run_hf(model, data, args, world: int, ends: StepEnds, scratch: str) -> Any:
    """transformers.Trainer with its defaults but the workload's, writing under `scratch`; returns the trained
    module."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Ends(TrainerCallback):
        on_step_end = ends.on_step_end  # the same bound method the project's run calls: one way of timing

    # max_grad_norm 0: no clipping, as the project's default; data_seed: the project's order (the docstring)
    training = TrainingArguments(
        output_dir=scratch,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,
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
    if args.lora_r:  # the project's own run adds the same adapters itself (run_ours)
        from multigpu.config import TrainConfig
        from multigpu.parallel.lora import add_adapters

        model = add_adapters(model, TrainConfig(lora_r=args.lora_r, seed=SEED))
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=data,
        optimizers=(adamw([p for p in model.parameters() if p.requires_grad]), None),
        callbacks=[Ends()],
    )
    trainer.train()
    return trainer.model


RUNS: dict[str, Callable[..., Any]] = {"ours": run_ours, "hf": run_hf}


def worker(args) -> None:
    """One contender's run; rank 0 prints its RESULT line."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = GPT2LMHeadModel.from_pretrained(args.model_dir)
    ends = StepEnds()
    with tempfile.TemporaryDirectory(prefix="vs-hf-") as scratch:  # the project's last.pt, HF's output folder
        trained = RUNS[args.worker](model, training_set(args, world), args, world, ends, scratch)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if len(ends.at) != args.steps:
        sys.exit(f"{NAMES[args.worker]} took {len(ends.at)} optimizer steps, not {args.steps}")
    seconds = ends.at[-1] - ends.at[args.warmup - 1]
    tokens = (args.steps - args.warmup) * args.batch * args.block * world
    print(
        RESULT
        + json.dumps(
            {
                "tokens_per_sec": tokens / seconds,
                "seconds": seconds,
                "val_loss": validation_loss(trained, validation_set(args)),
            }
        ),
        flush=True,
    )


# ------------------------------------------------------------------ rounds and the table (the driver)
def launch(args, contender: str, nproc: int, threads: int) -> dict[str, float]:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        contender,
        "--model-dir",
        args.model_dir,
        "--threads",
        str(threads),
        *workload_flags(args),
    ]
    return run_worker(script, nproc, NAMES[contender], {"OMP_NUM_THREADS": str(threads)})


def workload_flags(args) -> list[str]:
    """The flags that make the workload, passed on to every worker."""
    names = (
        "steps",
        "warmup",
        "batch",
        "log_every",
        "layers",
        "embd",
        "heads",
        "vocab",
        "block",
        "val_windows",
        "lora_r",
    )
    return [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def threads_for(args, nproc: int) -> int:
    return args.threads or max(1, (os.cpu_count() or 1) // nproc)


def rows_for(nproc: int, per_round: dict[str, list[dict]]) -> tuple[list[list[str]], list[str]]:
    """The table's two rows at one process count, and what missed the target there (empty: met)."""
    ratios = [
        ours["tokens_per_sec"] / hf["tokens_per_sec"] for ours, hf in zip(per_round["ours"], per_round["hf"])
    ]
    gaps = [ours["val_loss"] - hf["val_loss"] for ours, hf in zip(per_round["ours"], per_round["hf"])]
    ratio, gap = statistics.median(ratios), max(gaps, key=abs)
    rows = []
    for name in CONTENDERS:
        rates = [figures["tokens_per_sec"] for figures in per_round[name]]
        loss = statistics.median(figures["val_loss"] for figures in per_round[name])
        ours = name == "ours"
        rows.append(
            [
                str(nproc),
                NAMES[name],
                f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f})",
                f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ours else "",
                f"{loss:.6f}",
                f"{gap:+.1e}" if ours else "",
            ]
        )
    missed = [f"{nproc} process(es): ours/HF {ratio:.2f} < {MIN_RATIO}"] if ratio < MIN_RATIO else []
    missed += (
        [f"{nproc} process(es): |val loss difference| {abs(gap):.1e} > {MAX_LOSS_GAP}"]
        if abs(gap) > MAX_LOSS_GAP
        else []
    )
    return rows, missed


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    missing = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers' Trainer needs accelerate: without either there is no contender
        print(
            f"error: {' and '.join(missing)} not installed: pip install -e '.[hf-trainer]'", file=sys.stderr
        )
        return 2
    import transformers

    transformers.utils.logging.disable_progress_bar()  # saving and loading the model: no bars in the driver's output
    counts = [int(count) for count in args.nproc.split(",")]
    with tempfile.TemporaryDirectory(prefix="vs-hf-model-") as model_dir:
        args.model_dir = model_dir  # the workers' --model-dir
        build_model(args, model_dir)
        from transformers import GPT2LMHeadModel  # the untrained loss, to show how far training moved it

        untrained = validation_loss(GPT2LMHeadModel.from_pretrained(model_dir), validation_set(args))
        results, load = alternating_rounds(
            args.rounds,
            [str(count) for count in counts],
            list(CONTENDERS),
            lambda nproc, name: launch(args, name, int(nproc), threads_for(args, int(nproc))),
            lambda figures: f"{figures['tokens_per_sec']:.0f} tokens/s, val loss {figures['val_loss']:.6f}",
        )
    rows, missed = [], []
    for count in counts:
        made, miss = rows_for(count, {name: results[(str(count), name)] for name in CONTENDERS})
        rows += made
        missed += miss
    header = ["processes", "contender", "tokens/s", "ours/HF", "val loss", "val loss difference (ours - HF)"]
    write_markdown(
        Path(args.output) if args.output else default_output(args.lora_r),
        "This project against Hugging Face's Trainer (benchmarks/vs_hf_trainer.py)",
        header,
        rows,
        notes(args, counts, untrained, load),
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({f"{nproc} {name}": figures for (nproc, name), figures in results.items()}, indent=1)
        )
    print(
        f"target met: ours/HF >= {MIN_RATIO} and |val loss difference| <= 1e-4 at every process count"
        if not missed
        else "target missed: " + "; ".join(missed),
        flush=True,
    )
    return 1 if missed else 0


def notes(args, counts: list[int], untrained: float, load: tuple[float, float]) -> list[str]:
    """What the table's figures are, and where and how they were measured."""
    import transformers

    threads = ", ".join(f"{threads_for(args, count)} thread(s) per process at {count}" for count in counts)
    return [
        machine_line() + f"; transformers {transformers.__version__}, Accelerate "
        f"{importlib.metadata.version('accelerate')}; load average {load[0]:.2f} before, {load[1]:.2f} after",
        f"GPT-2 of {args.layers} layer(s), width {args.embd}, {args.heads} heads, vocabulary {args.vocab}, "
        f"context {args.block} (from a config, seed 0, dropout off); packed windows of {args.block} tokens, "
        f"batch {args.batch} per process, {args.steps} steps, AdamW lr {LR:g} weight decay {WEIGHT_DECAY:g}, "
        f"constant LR, no clipping, fp32, {threads}"
        + (
            f"; LoRA r {args.lora_r} (alpha {2 * args.lora_r}) on every linear layer but the head"
            if args.lora_r
            else ""
        ),
        f"tokens/s: rank 0's, steps {args.warmup + 1}-{args.steps} (the first {args.warmup} are warm-up), "
        f"median (range) of {args.rounds} interleaved round(s); ours/HF: the median of the rounds' ratios",
        f"val loss: per token over {args.val_windows} held-out windows after the last step (before "
        f"training: {untrained:.6f}); the difference: the largest over the rounds",
        f"command: python benchmarks/vs_hf_trainer.py {' '.join(sys.argv[1:])}".rstrip(),
    ]


def default_output(lora_r: int) -> Path:
    import torch

    kind = f"{'_lora' if lora_r else ''}_{'gpu' if torch.cuda.is_available() else 'cpu'}"
    return REPO / "benchmarks" / "results" / f"vs_hf_trainer{kind}.md"


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=9,
        steps=60,
        batch=8,
        log_every=10,
        output_help="Markdown file (default benchmarks/results/vs_hf_trainer[_lora]_<cpu|gpu>.md)",
    )
    parser.add_argument("--warmup", type=int, default=10, help="the first steps, left out of tokens/s")
    parser.add_argument(
        "--nproc", help="process counts, comma-separated (2 or more: DDP; default 1,2, --tiny 1)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per process (0: cores / processes)"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=128, help="the model's width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block", type=int, default=128, help="tokens per window, the model's context")
    parser.add_argument("--val-windows", type=int, default=64)
    parser.add_argument(
        "--lora-r",
        type=int,
        default=0,
        help="train LoRA adapters of this rank on both sides (0: every weight)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="1 layer, 6 steps, one round, 1 process unless --nproc (CI)"
    )
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.nproc = args.nproc or ("1" if args.tiny else "1,2")
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.log_every = 1, 6, 2, 3
        args.layers, args.embd, args.heads, args.block, args.batch, args.val_windows = 1, 64, 2, 64, 4, 16
    for problem in argument_problems(args):
        parser.error(problem)  # exit status 2
    return args


def argument_problems(args) -> list[str]:
    """What makes the arguments unusable, one line each."""
    problems = [
        f"--{name.replace('_', '-')} must be at least 1"
        for name in (
            "rounds",
            "steps",
            "batch",
            "log_every",
            "layers",
            "embd",
            "heads",
            "vocab",
            "block",
            "val_windows",
        )
        if getattr(args, name) < 1
    ]
    if not 1 <= args.warmup < args.steps:
        problems.append(
            f"--warmup {args.warmup}: from 1 to --steps - 1 ({args.steps - 1}), so some steps are timed"
        )
    if args.embd % max(args.heads, 1):
        problems.append(f"--heads {args.heads} must divide --embd {args.embd}")
    counts = args.nproc.split(",")
    if not all(count.isdigit() and int(count) >= 1 for count in counts):
        problems.append(f"--nproc {args.nproc}: process counts of 1 or more, comma-separated")
    if args.threads < 0:
        problems.append("--threads must be 0 (cores / processes) or more")
    return problems


if __name__ == "__main__":
    sys.exit(main())
