"""Benchmark: the peak memory per rank of fine-tuning a language model with every weight, with LoRA adapters, with
LoRA and activation checkpointing, and with QLoRA (a 4-bit base), in one process and under fsdp x 2, with each
run's checkpoint size (docs/measured.md, "LoRA and QLoRA").

    python benchmarks/lora_memory.py                   # GPT-2 small (124M) from its config, block 256, batch 4
    python benchmarks/lora_memory.py --tiny            # a tiny GPT-2, one process only: a quick look
    python benchmarks/lora_memory.py --model-config FOLDER --batch 8 --amp bf16   # on a GPU machine: its memory

Every run is the trainer's own command line (main_multi_gpu.py, under torchrun for fsdp) on a model folder the
benchmark writes once from the config (random weights: memory does not depend on their values) with
examples/tiny_language_model.py's tokenizer, and a JSONL of that example's sentences, packed into --block-size
windows: `--lora-r 8` (alpha 16, every linear layer but the head), `--activation-checkpointing`, `--qlora`
(bitsandbytes NF4; not under fsdp, which refuses it in one line), AdamW, fp32 (--amp as given), --steps
optimizer steps. Peak memory per rank: on the CPU the process's peak resident set (VmHWM, torch and its
libraries included: the row "imports only" shows what a process holds before it builds anything; malloc made to
give freed blocks back, so that it is the peak of live memory), on a GPU
torch.cuda.max_memory_allocated; each rank reports its own at the end of training. Checkpoint: the bytes of
last.pt (under fsdp the sharded folder last/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import free_port, machine_line, write_markdown  # noqa: E402

GIB = 2**30
# name -> the trainer flags that make it
RUNS = {
    "every weight": [],
    "LoRA r 8": ["--lora-r", "8"],
    "LoRA r 8 + activation checkpointing": ["--lora-r", "8", "--activation-checkpointing"],
    "QLoRA r 8 (4-bit NF4 base)": ["--lora-r", "8", "--qlora"],
}
LAYOUTS = {"1 process": 1, "fsdp x 2": 2}


class PeakMemory:
    """A trainer callback: at the end of training each rank writes its peak memory to `folder`/rank<r>.json."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_fit_end(self, trainer: Any) -> None:
        import torch

        cuda = trainer.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(trainer.device) if cuda else resident_peak()
        record = {"peak_bytes": peak, "what": "max_memory_allocated" if cuda else "VmHWM"}
        Path(self.folder, f"rank{trainer.runtime.rank}.json").write_text(json.dumps(record))


def resident_peak() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def worker(out: str, argv: list[str]) -> int:
    """One run of the trainer's command line, each rank writing its peak to `out`."""
    from multigpu.launch.runner import train_from_argv

    return train_from_argv(argv, callbacks=[PeakMemory(out)])


def write_model(args: argparse.Namespace, folder: Path) -> tuple[Path, Path, Path]:
    """(model folder, train.jsonl, val.jsonl): a GPT-2 from --model-config (default GPT-2 small), the example's
    tokenizer beside it, --texts sentences of the example's grammar."""
    import random

    import torch
    import transformers

    from examples.tiny_language_model import sentence, write_tiny_language_model

    transformers.utils.logging.disable_progress_bar()
    example = write_tiny_language_model(folder / "example")
    model_folder = folder / "model"
    torch.manual_seed(0)
    config = (
        transformers.AutoConfig.from_pretrained(args.model_config)
        if args.model_config
        else transformers.GPT2Config(**({"n_layer": 2, "n_embd": 64, "n_head": 2} if args.tiny else {}))
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_folder)
    transformers.AutoTokenizer.from_pretrained(example / "model").save_pretrained(model_folder)
    draw = random.Random(0)
    files = []
    for name, count in (("train.jsonl", args.texts), ("val.jsonl", 200)):
        lines = (json.dumps({"text": " ".join(sentence(draw) for _ in range(4))}) for _ in range(count))
        (folder / name).write_text("\n".join(lines) + "\n")
        files.append(folder / name)
    return model_folder, files[0], files[1]


def run(
    args: argparse.Namespace, layout: int, flags: list[str], paths: tuple[Path, Path, Path], scratch: Path
) -> dict:
    """One row's run: its peak per rank, its checkpoint's bytes, and its plan's LoRA line."""
    model, train, val = paths
    out = Path(tempfile.mkdtemp(dir=scratch))
    save_dir = out / "run"
    trainer_args = [
        "--dataset", "hf", "--data-files", str(train), "--val-files", str(val), "--text-column", "text",
        "--model", "hf", "--model-path", str(model), "--block-size", str(args.block), "--batch-size", str(args.batch),
        "--max-steps", str(args.steps), "--epochs", "100", "--amp", args.amp, "--no-progress", "--log-every", "1",
        "--save-dir", str(save_dir), "--multi-gpu", "fsdp" if layout > 1 else "none", *flags,
    ]  # fmt: skip
    script = [str(Path(__file__).resolve()), "--worker", str(out), "--", *trainer_args]
    launcher = (
        [sys.executable]
        if layout == 1
        else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={layout}", "--master_port",
              str(free_port())]
    )  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // layout)),
        "PYTHONPATH": str(REPO),
        # The peak of live memory, not of what malloc keeps: the trainer keeps freed CPU memory for the next
        # step (multigpu/tuning/cpu_memory.py), and the heap's layout then sets the resident peak (activation
        # checkpointing measured higher than without it that way). A fixed mmap threshold hands every block
        # above 128 KiB back when freed, and a malloc tuned by the environment is left alone by the trainer.
        "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
    }
    done = subprocess.run([*launcher, *script], capture_output=True, text=True, env=env, timeout=args.timeout)
    refusal = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    # Refused (QLoRA under fsdp): exit 2 from one process, torchrun's own failure (1) around a rank's exit 2.
    if refusal and (done.returncode == 2 or "exitcode  : 2" in done.stderr):
        return {"refused": refusal[0]}
    if done.returncode != 0:
        sys.exit(f"the run {' '.join(flags)} at {layout} process(es) failed:\n{done.stdout}\n{done.stderr}")
    peaks = [json.loads((out / f"rank{rank}.json").read_text())["peak_bytes"] for rank in range(layout)]
    last = next(path for path in (save_dir / "last.pt", save_dir / "last") if path.exists())
    size = (
        last.stat().st_size
        if last.is_file()
        else sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    )
    lora = next(
        (line for line in done.stdout.splitlines() if line.startswith("LoRA r ")), "every weight trains"
    )
    return {"peaks": peaks, "checkpoint_bytes": size, "trains": lora}


def imports_only() -> int:
    """The peak resident set of a process that imports what a run imports and builds nothing."""
    probe = (
        "import torch, transformers, peft, datasets, multigpu.launch.runner\n"
        f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "from lora_memory import resident_peak\nprint(resident_peak())"
    )
    done = subprocess.run([sys.executable, "-c", "import sys\n" + probe], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    return int(done.stdout.split()[-1])


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker(args.worker, args.trainer_args)
    layouts = {"1 process": 1} if args.tiny else LAYOUTS
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as folder:
        scratch = Path(folder)
        paths = write_model(args, scratch)
        baseline = imports_only()
        rows.append(["imports only", "", f"{baseline / GIB:.2f}", "", ""])
        for name, flags in RUNS.items():
            for layout_name, layout in layouts.items():
                result = run(args, layout, flags, paths, scratch)
                raw[f"{name}, {layout_name}"] = result
                print(f"{name}, {layout_name}: {result}", flush=True)
                if "refused" in result:
                    rows.append(
                        [name, layout_name, "refused: " + result["refused"].removeprefix("error: "), "", ""]
                    )
                    continue
                peaks = " / ".join(f"{peak / GIB:.2f}" for peak in result["peaks"])
                size = f"{result['checkpoint_bytes'] / 2**20:.1f}"
                rows.append([name, layout_name, peaks, size, result["trains"]])
    header = [
        "fine-tune",
        "layout",
        "peak memory per rank (GiB)",
        "checkpoint (MiB)",
        "what trains (the plan line)",
    ]
    output = Path(args.output) if args.output else REPO / "benchmarks" / "results" / "lora_memory_cpu.md"
    write_markdown(output, "Fine-tuning memory: every weight, LoRA, activation checkpointing, QLoRA", header, rows,
                   notes(args))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"imports_only": baseline, **raw}, indent=1))
    return 0


def notes(args: argparse.Namespace) -> list[str]:
    model = args.model_config or (
        "a tiny GPT-2 (2 layers, width 64)" if args.tiny else "GPT-2 small (GPT2Config())"
    )
    return [
        machine_line(),
        f"{model} from its config, random weights; block {args.block}, batch {args.batch} per process, "
        f"{args.steps} optimizer steps, AdamW, --amp {args.amp}; LoRA r 8, alpha 16, every linear layer but the head",
        "peak memory: each rank's peak resident set (VmHWM) at the end of training, the whole process (torch and "
        "its libraries too: see 'imports only'), with MALLOC_MMAP_THRESHOLD_=131072 so that freed blocks go back "
        "to the kernel and the peak is that of live memory; checkpoint: last.pt, or under fsdp the sharded "
        "folder last/",
        f"command: python benchmarks/lora_memory.py {' '.join(sys.argv[1:])}".rstrip(),
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=4, help="samples (windows) per process per step")
    parser.add_argument("--block", type=int, default=256, help="tokens per window")
    parser.add_argument("--texts", type=int, default=3000, help="training texts (4 sentences each)")
    parser.add_argument("--amp", default="off", choices=["off", "bf16", "fp16", "auto"])
    parser.add_argument("--model-config", help="a transformers config (folder or JSON); default GPT-2 small")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2, one process, 2 steps")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    parser.add_argument("--output", help="Markdown file (default benchmarks/results/lora_memory_cpu.md)")
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("trainer_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.block, args.texts = 2, 64, 200
    return args


if __name__ == "__main__":
    sys.exit(main())
