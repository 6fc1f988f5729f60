"""--eval-only: a saved model's validation loss, perplexity (a loss over tokens) and metrics, with the run's flags,
under any mode (one process, torchrun's ddp, fsdp): nothing trains and no checkpoint is written.

The weights: --init-from PATH (a checkpoint, a .safetensors file or a Hugging Face folder, read as --init-from
reads it), --resume PATH (a checkpoint, or a folder's newest good one; auto: --save-dir's), or else --model hf's
--model-path folder itself. The model is wrapped for its mode as for training (fsdp: sharded, each rank reading
the parts it holds) and evaluated exactly as an epoch's end evaluates it (multigpu/loop/evaluation.py). One line
says the results, and rank 0 writes them to <save-dir>/eval.json (docs/language-models.md, "Evaluating saved
weights").
"""

from __future__ import annotations

import json
import os
from typing import Any

from multigpu import safe_files
from multigpu.checkpoints import checkpoint
from multigpu.checkpoints.weights import load_initial
from multigpu.errors import CheckpointError, UsageError
from multigpu.loop.metrics import COUNTS
from multigpu.parallel.distributed import barrier

EVAL_FILE = "eval.json"


def evaluate_saved(run: Any) -> dict[str, Any]:
    """Load the saved weights into the run's model (the trainer), evaluate its validation set, say the results in
    one line and write <save-dir>/eval.json; every rank calls it. The results: val_<name> of every figure, the
    samples and tokens counted, and where the weights came from."""
    if run.val_dataset is None:
        raise UsageError("--eval-only evaluates the validation set, and this run has none: give one")
    weights = load_weights(run)
    result = run.evaluate()
    figures = {f"val_{name}": value for name, value in result.items() if name not in COUNTS}
    shown = ", ".join(f"{name.replace('_', ' ', 1)} {value:.6g}" for name, value in figures.items())
    tokens = f", {result['tokens']:,} tokens" if "tokens" in result else ""
    path = os.path.join(run.checkpointer.save_dir, EVAL_FILE)
    run.report.line(f"eval of {weights}: {shown} ({result['count']} samples{tokens}); written to {path}")
    written = {
        **figures,
        "samples": result["count"],
        **({"tokens": result["tokens"]} if "tokens" in result else {}),
        "weights": weights,
        "processes": run.runtime.world_size,
        "multi_gpu": run.runtime.mode,
    }
    if run.runtime.is_main:
        safe_files.write_atomically(path, json.dumps(written, indent=1) + "\n")
    barrier()
    return written


def load_weights(run: Any) -> str:
    """The saved weights into `run.model` (every rank alike; a sharded model's ranks read their parts); what they
    are, in words."""
    config = run.config
    if config.resume:
        path, state = _checkpoint(config.resume, run.checkpointer.save_dir, run.report.line)
        run.checkpointer.load_into({"model": run.stateful()["model"]}, state, path)
        return f"checkpoint {path} (step {state.get('global_step', 0)})"
    if config.init_from:
        load_initial(run.model, config.init_from, config.init_strict, run.report.line)
        return config.init_from
    return f"--model-path {config.model_path}"


def _checkpoint(resume: str, save_dir: str, say: Any) -> tuple[str, dict[str, Any]]:
    """--resume's checkpoint: the file or sharded folder named, or the newest good one of a folder (auto: the
    save-dir), read; CheckpointError where there is none."""
    folder = save_dir if resume == "auto" else resume
    if os.path.isdir(folder) and not checkpoint.is_sharded(folder):
        reasons: list[str] = []
        found = checkpoint.load_newest(folder, reasons.append)
        for reason in reasons:
            say(f"{reason}; trying an older one")
        if found is None:
            raise CheckpointError(
                f"--eval-only --resume {resume}: {folder} holds no checkpoint that loads (last.pt, step-*.pt, "
                f"or sharded ones); name a checkpoint, or give --init-from PATH"
            )
        return found
    if not os.path.exists(folder):
        raise CheckpointError(f"--resume {resume}: no such file or folder; name a checkpoint of this run")
    return folder, checkpoint.load(folder)
