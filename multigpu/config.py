"""TrainConfig: the one typed description of a training run.

The command line (`main_multi_gpu.py --help`), the launcher's printed command,
the checkpoint's `config` entry and TensorBoard's hparams are all generated
from this dataclass, so they cannot drift apart. A field `batch_size` is the
flag `--batch-size`; a bool field `download` is `--download/--no-download`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NoReturn

from multigpu.errors import UsageError


def _opt(
    default: Any, help: str, choices: Sequence[str] | None = None, *, group: str, words: Sequence[str] = ()
) -> Any:
    """A field; `words` are what a numeric field also accepts instead of a number (--batch-size auto)."""
    return field(
        default=default, metadata={"help": help, "choices": choices, "group": group, "words": tuple(words)}
    )


AUTO = (
    "auto"  # --batch-size auto: the largest batch that fits, found at start (multigpu/tuning/batch_size.py)
)


LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")  # --logger's names (multigpu/monitoring/trackers.py)

DEFAULT_SAVE_ROOT = "checkpoints"  # without --save-dir, each run gets its own run-N folder here


@dataclass
class TrainConfig:
    """Every setting of a run. Field names are the long CLI flags with '-' as '_'."""

    # --- devices -------------------------------------------------------
    multi_gpu: str = _opt(
        "auto",
        "ddp: one process per device under torchrun; fsdp: the same, with parameters, "
        "gradients and optimizer state sharded over the processes (FSDP2); dp: nn.DataParallel in "
        "one process; none: one device; auto: ddp under torchrun, else dp with several GPUs, else none",
        ["auto", "ddp", "fsdp", "dp", "none"],
        group="devices",
    )
    fsdp_blocks: str | None = _opt(
        None,
        "fsdp: comma-separated class names of the blocks sharded as units of their "
        "own, e.g. TransformerBlock,Bottleneck (default: the children of ModuleList/"
        "Sequential containers that hold at least 1 percent of the parameters)",
        group="devices",
    )
    fsdp_reshard_after_forward: bool = _opt(
        True,
        "fsdp: free each block's gathered parameters after its forward and "
        "gather them again for backward (ZeRO-3); --no-fsdp-reshard-after-forward "
        "keeps them (ZeRO-2-like: more memory, fewer collectives)",
        group="devices",
    )
    dp_replicate: int | None = _opt(
        None,
        "fsdp: hybrid sharding (HSDP): the model is sharded within groups of "
        "--dp-shard processes and replicated over this many such groups (a 2-D device "
        "mesh, replicate x shard = the processes); default: the number of nodes, so "
        "shards stay within a node; 1: shard over every process",
        group="devices",
    )
    dp_shard: int | None = _opt(
        None,
        "fsdp: the processes each shard group spans (-1: the processes left after "
        "--dp-replicate); default: the processes per node",
        group="devices",
    )
    fsdp_accumulate: str = _opt(
        "whole",
        "fsdp with --grad-accum-steps: how the inner micro-steps keep their "
        "gradients. whole: no collective until the last micro-step, each rank sums the whole "
        "model's gradients meanwhile (fewest collectives); sharded: each micro-step "
        "reduce-scatters within its shard group, each rank keeps 1/S of them (less memory). "
        "Either way nothing crosses the replica groups before the last micro-step",
        ["whole", "sharded"],
        group="devices",
    )
    gpu_ids: str | None = _opt(
        None, "comma-separated GPU ids for dp, e.g. 0,1,3 (default: all visible GPUs)", group="devices"
    )
    dist_timeout: float = _opt(
        1800.0, "seconds a collective may wait for the other ranks before the job fails", group="devices"
    )
    hang_timeout: float | None = _opt(
        None,
        "seconds no rank may go without advancing before the watchdog writes "
        "<save-dir>/hang_report.txt, saves the last completed step and stops the "
        "run with exit status 3 (0: off; default: 300, or half of --dist-timeout "
        "when that is shorter; must be below --dist-timeout)",
        group="devices",
    )
    cache_cpu_memory: bool = _opt(
        True,
        "training on the CPU: keep the memory a step frees for the next step "
        "instead of handing it back to the kernel, which faults it in afresh (glibc "
        "malloc's trim and mmap thresholds; the CPU's counterpart of CUDA's caching "
        "allocator: the process holds its peak memory until training ends)",
        group="devices",
    )
    debug_collectives: bool = _opt(
        False,
        "check before each of the trainer's collectives and each DDP gradient "
        "all-reduce that all ranks call the same operation with the same shapes "
        "(slower: a store round trip each)",
        group="devices",
    )
    fault_tolerance: bool = _opt(
        False,
        "train as one of --ft-replica-groups replica groups that outlive each other's loss (torchft), each "
        "one process or a torchrun job of --multi-gpu ddp or fsdp: each step commits with the groups alive, "
        "a lost group's share of the data is skipped until it rejoins and heals from a live peer, without a "
        "checkpoint read (docs/fault-tolerance.md; needs torchft: "
        "pip install '.[ft]', and its Lighthouse)",
        group="devices",
    )
    ft_replica_groups: int | None = _opt(
        None,
        "--fault-tolerance: how many replica groups train the model, each on its own 1/N of every step's "
        "data (the effective batch and the LR are set for all of them)",
        group="devices",
    )
    ft_replica_id: int | None = _opt(
        None, "--fault-tolerance: this process's replica group, 0 to --ft-replica-groups - 1", group="devices"
    )
    ft_min_replicas: int = _opt(
        1, "--fault-tolerance: the fewest live replica groups a step may commit with", group="devices"
    )
    ft_lighthouse: str | None = _opt(
        None,
        "--fault-tolerance: the address of torchft's Lighthouse, which keeps the quorum of live groups, "
        "e.g. http://node0:29510 (default: $TORCHFT_LIGHTHOUSE)",
        group="devices",
    )
    semi_sync: str | None = _opt(
        None,
        "--fault-tolerance: each replica group trains --sync-every steps on its own between syncs (torchft): "
        "diloco averages the groups' weight changes into an outer Nesterov SGD step, local-sgd averages "
        "their weights; --sync-every times fewer bytes between the groups, for slow links "
        '(docs/fault-tolerance.md, "Training across slow links")',
        ["diloco", "local-sgd"],
        group="devices",
    )
    sync_every: int | None = _opt(
        None, "--semi-sync: the steps each replica group trains on its own between two syncs", group="devices"
    )
    outer_lr: float = _opt(0.7, "--semi-sync diloco: the outer SGD's learning rate", group="devices")
    outer_momentum: float = _opt(
        0.9, "--semi-sync diloco: the outer SGD's Nesterov momentum (0: plain SGD)", group="devices"
    )
    fragments: int = _opt(
        1,
        "--semi-sync diloco: sync the model in this many fragments of its blocks, one every --sync-every/K "
        "steps in turn, each once per --sync-every steps (Streaming DiLoCo)",
        group="devices",
    )
    quantize_outer: bool = _opt(
        False,
        "--semi-sync diloco: all-reduce the outer gradients in 8 bits (torchft's quantized all-reduce: CUDA "
        "GPUs with Triton)",
        group="devices",
    )
    # --- data ----------------------------------------------------------
    dataset: str = _opt(
        "synthetic",
        "data set",
        ["synthetic", "mnist", "fashion-mnist", "cifar10", "cifar100", "imagefolder", "fake", "text", "hf"],
        group="data",
    )
    data_dir: str = _opt(
        "datasets",
        "where torchvision data sets live (imagefolder: a folder with train/ and val/)",
        group="data",
    )
    data_file: str | None = _opt(
        None,
        "--dataset text: a UTF-8 plain text file; its characters are the tokens, "
        "its last 10 percent the validation set",
        group="data",
    )
    data_files: str | None = _opt(
        None,
        "--dataset hf: local .parquet, .jsonl/.json, .csv or .txt files of the "
        "training set (globs, comma-separated), read with Hugging Face datasets "
        "(pip install -e '.[hf]')",
        group="data",
    )
    val_files: str | None = _opt(
        None, "--dataset hf: the validation set's files, as --data-files (none: no validation)", group="data"
    )
    streaming: bool = _opt(
        False,
        "--dataset hf: read the files as a stream (split over ranks by "
        "split_dataset_by_node, over workers by the files) instead of as one table",
        group="data",
    )
    input_column: str | None = _opt(
        None,
        "--dataset hf: the column of each sample's input, numbers or an image "
        "(default: the first of image, pixels, x, features, input)",
        group="data",
    )
    label_column: str = _opt(
        "label",
        "--dataset hf: the column of each sample's class id (with --text-column: "
        "naming it makes --model hf a sequence classifier)",
        group="data",
    )
    text_column: str | None = _opt(
        None,
        "--dataset hf: the column of each sample's text (e.g. text), tokenized for --model hf",
        group="data",
    )
    tokenizer: str | None = _opt(
        None,
        "--text-column: the tokenizer's folder (save_pretrained's; default: --model-path's own)",
        group="data",
    )
    pad_to_batch: bool = _opt(
        False,
        "--text-column with a causal language model: pad each batch to its longest "
        "sample (attention mask 0 and labels -100 there) instead of packing the token stream "
        "into --block-size windows; a classifier's samples are always padded",
        group="data",
    )
    prompt_column: str | None = _opt(
        None,
        "--dataset hf: the column of each sample's prompt, with --completion-column: one text, prompt then "
        "completion then the end-of-text token, tokenized for --model hf (docs/language-models.md)",
        group="data",
    )
    completion_column: str | None = _opt(
        None, "--dataset hf with --prompt-column: the column of each sample's completion", group="data"
    )
    messages_column: str | None = _opt(
        None,
        "--dataset hf: the column of each sample's conversation, a list of {role, content} messages "
        "rendered with the tokenizer's chat template (or --chat-template) and tokenized for --model hf",
        group="data",
    )
    chat_template: str | None = _opt(
        None,
        "--messages-column: a file holding the Jinja chat template to render the conversations with "
        "(default: the tokenizer's own)",
        group="data",
    )
    loss_on: str = _opt(
        "auto",
        "the tokens whose prediction counts in the loss, the others' labels -100: completion (the "
        "completions of --prompt-column data), assistant (the assistant turns of --messages-column data), "
        "all; auto: completion for prompt/completion data, assistant for messages, all for plain text",
        ["auto", "completion", "assistant", "all"],
        group="data",
    )
    packing: str = _opt(
        "auto",
        "a causal language model's texts in --block-size windows: documents (whole texts packed together, "
        "each attending only to itself: position_ids restart at each text; a text longer than the "
        "window is cut into pieces), stream (the texts joined and cut, as run_clm packs); auto: "
        "documents where the model's attention takes it, else stream",
        ["auto", "documents", "stream"],
        group="data",
    )
    download: bool = _opt(
        False, "download torchvision data sets that are missing from --data-dir", group="data"
    )
    train_size: int = _opt(8192, "samples in the synthetic/fake training set", group="data")
    val_size: int = _opt(1000, "samples in the synthetic/fake validation set", group="data")
    image_shape: str = _opt(
        "1,28,28",
        "C,H,W of synthetic/fake images (and the resize target of imagefolder, and "
        "the shape of --dataset hf's numeric inputs)",
        group="data",
    )
    num_classes: int = _opt(
        10,
        "classes of the synthetic/fake data sets (and of --dataset hf's label column when it "
        "has no class names; with --text-column, naming it makes --model hf a sequence "
        "classifier)",
        group="data",
    )
    num_workers: int | None = _opt(
        None, "data-loader worker processes per rank (default: 0 on CPU, 4 on CUDA)", group="data"
    )
    data_on_device: str = _opt(
        "auto",
        "keep the training set on the device and gather each batch there (no loader, "
        "no host copy per step; CIFAR's crop and flip run there on whole batches): on, off, or "
        "auto: where it is tensors (a TensorDataset, or a set whose samples never change: "
        "synthetic, fake, the MNIST family, CIFAR, text) that fit in a quarter of the device's "
        "memory, the first steps measure it against the loader and the faster way stays",
        ["auto", "on", "off"],
        group="data",
    )
    steps_per_epoch: int = _opt(
        0,
        "optimizer steps per epoch of a streaming training set (an IterableDataset), "
        "passes following one another; 0: an epoch is one pass (without __len__ its steps "
        "are unknown, and a schedule that needs them is refused)",
        group="data",
    )
    eval_batch_size: int | None = _opt(
        None, "samples per device per evaluation batch (default: --batch-size)", group="data"
    )
    # --- model ---------------------------------------------------------
    mode: str = _opt(
        "image", "image: samples are CxHxW; flatten: samples are vectors", ["image", "flatten"], group="model"
    )
    model: str | None = _opt(
        None,
        "model (default: cnn for --mode image, mlp for --mode flatten, gpt for "
        "--dataset text, hf for --dataset hf --text-column)",
        ["mlp", "cnn", "resnet18", "resnet50", "gpt", "hf"],
        group="model",
    )
    model_path: str | None = _opt(
        None,
        "--model hf: a local transformers model folder (save_pretrained's) to "
        "fine-tune: AutoModelForCausalLM, or AutoModelForSequenceClassification with "
        "--num-classes or --label-column",
        group="model",
    )
    model_config: str | None = _opt(
        None,
        "--model hf: a transformers config (a folder holding config.json, or a "
        ".json file) to build an untrained model from, instead of --model-path",
        group="model",
    )
    block_size: int = _opt(
        64,
        "--model gpt: context length, the characters in each window of --dataset text; "
        "--model hf: the tokens in each packed window, the most a padded sample keeps",
        group="model",
    )
    n_layer: int = _opt(2, "--model gpt: transformer blocks", group="model")
    n_head: int = _opt(2, "--model gpt: attention heads per block (a divisor of --n-embd)", group="model")
    n_embd: int = _opt(64, "--model gpt: embedding width", group="model")
    sync_bn: bool = _opt(
        False, "convert BatchNorm to SyncBatchNorm before the DDP wrap (CUDA only)", group="model"
    )
    compile: bool = _opt(
        False,
        "torch.compile the model (before the DDP wrap; the first steps take longer while it "
        "compiles; checkpoints stay loadable without it)",
        group="model",
    )
    float8: str | None = _opt(
        None,
        "train the Linear layers large enough to gain in float8 (torchao's "
        "convert_to_float8_training; pip install '.[float8]'), with float8 all-gather under "
        "fsdp: tensorwise or rowwise scaling; GPUs of compute capability 8.9 or above only",
        ["tensorwise", "rowwise"],
        group="model",
    )
    channels_last: bool = _opt(
        False,
        "keep conv weights and image batches channels-last (NHWC): faster convolutions "
        "on tensor-core GPUs, above all with --amp",
        group="model",
    )
    init_from: str | None = _opt(
        None,
        "start training from these weights (a .safetensors file or its index, a "
        "Hugging Face folder, a .pt weights file or a checkpoint): fine-tuning, not a "
        "resume (optimizer, schedule and progress start afresh; a run that resumes keeps "
        "its checkpoint's weights)",
        group="model",
    )
    init_strict: bool = _opt(
        True,
        "--init-from: every key of the model and of the file must match in name and shape; "
        "--no-init-strict loads what matches and says what did not",
        group="model",
    )
    autotune: bool = _opt(
        False,
        "measure, in the first optimizer steps (which train as usual), the settings that "
        "change speed but not the numbers: channels-last for convolution nets, intra-op threads on the "
        "CPU, torch.compile on runs long enough to repay it; keep the fastest, say so in one line "
        "and save the choice in the checkpoint (a resume reuses it)",
        group="model",
    )
    lora_r: int = _opt(
        0,
        "fine-tune LoRA adapters of this rank instead of every weight (peft; pip install '.[lora]'): the "
        "base stays frozen and bit-identical, only the adapters train and are checkpointed (0: off)",
        group="model",
    )
    lora_alpha: float | None = _opt(
        None, "--lora-r: the adapters' scale numerator (scale alpha/r; default: 2 x --lora-r)", group="model"
    )
    lora_dropout: float = _opt(0.0, "--lora-r: dropout on the adapters' input", group="model")
    lora_targets: str = _opt(
        "all-linear",
        "--lora-r: the layers that get adapters: all-linear (every linear layer but the output head), or "
        "comma-separated module names as peft matches them, e.g. q_proj,v_proj",
        group="model",
    )
    qlora: bool = _opt(
        False,
        "--lora-r on a 4-bit base: --model hf loads its linear layers in NF4 (bitsandbytes through "
        "transformers), computing in --amp's dtype; one device or ddp, not fsdp",
        group="model",
    )
    activation_checkpointing: bool = _opt(
        False,
        "recompute each block's activations in backward instead of keeping them: less memory for a "
        "third more compute, the same numbers (transformers models: their gradient checkpointing; others: "
        "torch's checkpoint wrapper around each block, as --fsdp-blocks finds them)",
        group="model",
    )
    # --- optimisation ----------------------------------------------------
    epochs: int = _opt(3, "training epochs", group="optimisation")
    max_steps: int = _opt(
        0,
        "end training after this many optimizer steps in all (counting those before a resume), "
        "evaluating and saving as at an epoch's end; the LR schedule and warm-up then span "
        "them. 0: --epochs alone decides; with both, whichever comes first ends the run. Alone "
        "it bounds an endless stream",
        group="optimisation",
    )
    batch_size: int | str = _opt(
        64,
        "samples per GPU/process per micro-batch (effective batch = batch_size x "
        "devices x grad_accum_steps); auto: the largest that fits in GPU memory with a "
        "10 percent margin (CUDA only)",
        group="optimisation",
        words=(AUTO,),
    )
    grad_accum_steps: int = _opt(1, "micro-batches per optimizer step", group="optimisation")
    optimizer: str = _opt("adamw", "optimizer", ["sgd", "adamw"], group="optimisation")
    lr: float = _opt(
        1e-3, "learning rate, used as given unless --lr-scaling says otherwise", group="optimisation"
    )
    lr_scaling: str = _opt(
        "none",
        "scale --lr from --lr-base-batch to the effective batch",
        ["none", "linear", "sqrt"],
        group="optimisation",
    )
    lr_base_batch: int = _opt(32, "the batch size --lr was tuned for", group="optimisation")
    lr_schedule: str = _opt(
        "cosine",
        "schedule after warm-up, stepped per optimizer step",
        ["cosine", "step", "constant"],
        group="optimisation",
    )
    warmup_epochs: float = _opt(
        0.0, "linear LR warm-up length in epochs (may be fractional)", group="optimisation"
    )
    warmup_steps: int = _opt(
        0, "linear LR warm-up length in optimizer steps, instead of --warmup-epochs", group="optimisation"
    )
    lr_step_epochs: float = _opt(30.0, "--lr-schedule step: epochs between LR decays", group="optimisation")
    lr_gamma: float = _opt(0.1, "--lr-schedule step: factor applied at each decay", group="optimisation")
    weight_decay: float = _opt(0.01, "weight decay", group="optimisation")
    momentum: float = _opt(0.9, "SGD momentum", group="optimisation")
    loss_weighting: str = _opt(
        "auto",
        "how a step's loss averages: samples (each sample's loss weighs alike, "
        "right for images), tokens (the mean over every counted target token of the step, "
        "all micro-batches and ranks: -100 targets ignored, as language models need), or "
        "auto: tokens for token-id targets (integer targets with a sequence dimension, or "
        "holding -100), samples otherwise; evaluation averages the same way",
        ["auto", "samples", "tokens"],
        group="optimisation",
    )
    clip_grad_norm: float = _opt(
        0.0, "clip the global gradient norm to this value after unscaling (0: off)", group="optimisation"
    )
    amp: str = _opt(
        "off",
        "mixed precision: fp16 (with GradScaler) or bf16 autocast; auto: bf16 on GPUs that have "
        "it, else fp16 on GPUs, fp32 on the CPU",
        ["off", "fp16", "bf16", "auto"],
        group="optimisation",
    )
    seed: int = _opt(0, "seed of model init, data order and augmentation", group="optimisation")
    ema_decay: float = _opt(
        0.0,
        "keep an exponential moving average of the weights, updated after each optimizer "
        "step with this decay, e.g. 0.999; evaluation, best.pt and predict use it (0: off)",
        group="optimisation",
    )
    # --- output --------------------------------------------------------
    save_dir: str | None = _opt(
        None,
        "where last.pt, best.pt, step checkpoints and TensorBoard logs are written "
        "(default: a new checkpoints/run-N per run; with --resume auto the newest one)",
        group="output",
    )
    overwrite: bool = _opt(
        False,
        "start afresh in a --save-dir that holds another run's checkpoints (they are kept "
        "aside until this run's first checkpoint is written, and put back if it ends before)",
        group="output",
    )
    allow_low_disk: bool = _opt(
        False,
        "start even when the save-dir's free space is below what this run's checkpoints "
        "need (estimated at start); a save that does not fit then stops the run",
        group="output",
    )
    log_dir: str | None = _opt(None, "TensorBoard directory (default: <save-dir>/tb)", group="output")
    log_every: int = _opt(
        50, "optimizer steps between loss/throughput logs (the only host syncs)", group="output"
    )
    progress: bool = _opt(
        True,
        "show the rank-0 progress bar (on a terminal; a redirected log gets a line per --log-every steps)",
        group="output",
    )
    resume: str | None = _opt(
        None,
        "checkpoint to continue from (a file, or a folder: its newest good one), or "
        "'auto' for the newest good one in --save-dir",
        group="output",
    )
    save_every_steps: int = _opt(
        0, "also save a step checkpoint every N optimizer steps (0: only at epoch ends)", group="output"
    )
    eval_every_steps: int = _opt(
        0,
        "also evaluate every N optimizer steps (validation, best.pt and early stopping, as at an "
        "epoch's end; 0: only at epoch ends)",
        group="output",
    )
    eval_only: bool = _opt(
        False,
        "evaluate the validation set with saved weights (--init-from PATH, --resume PATH, or --model-path's "
        "own) and write <save-dir>/eval.json: no training, no checkpoint",
        group="output",
    )
    keep_last: int = _opt(3, "step checkpoints to keep", group="output")
    checkpoint_format: str = _opt(
        "auto",
        "file: rank 0 writes one file (last.pt); safetensors: the same as "
        "last.safetensors, without pickle (the trainer state as JSON in its header); "
        "sharded: a folder (last/) where every process writes its own shards in parallel, "
        "which resumes at any number of processes; auto: sharded under --multi-gpu fsdp "
        "(file under --fault-tolerance), else file",
        ["auto", "file", "safetensors", "sharded"],
        group="output",
    )
    export_on_end: str | None = _opt(
        None,
        "when training ends, write best's weights (last's without validation) "
        "beside the checkpoints: safetensors (best-weights.safetensors), hf (a "
        "transformers model's own folder, best-hf/; a LoRA run's adapters merged into its base) or "
        "adapter (a LoRA run's PEFT adapter folder, best-adapter/)",
        ["safetensors", "hf", "adapter"],
        group="output",
    )
    logger: str = _opt(
        "tensorboard",
        "where the scalars go, a comma list of tensorboard, csv (metrics.csv in the "
        "save-dir), mlflow (pip install '.[mlflow]'; the database <save-dir>/mlflow.db unless "
        "MLFLOW_TRACKING_URI), wandb (pip install '.[wandb]'; WANDB_MODE=offline and the other "
        "WANDB_ variables apply): the same scalars at the same steps, from rank 0",
        group="output",
    )
    async_checkpoint: bool = _opt(
        False,
        "write sharded checkpoints in the background while training goes on (a CPU "
        "copy is taken first; the next save waits for the previous one)",
        group="output",
    )
    monitor: str | None = _opt(
        None,
        "validation metric that picks best.pt, e.g. val_loss, val_acc, val_mse "
        "(default: val_acc when accuracy is computed, else val_loss; val_loss for a loss "
        "over tokens); --monitor, its old name, works where torchrun does not read the command",
        group="output",
    )
    monitor_mode: str = _opt(
        "auto",
        "whether a lower (min) or higher (max) --monitor-metric is better; auto: lower for "
        "losses and errors (loss, mse, mae), higher otherwise",
        ["auto", "min", "max"],
        group="output",
    )
    early_stop_patience: int = _opt(
        0,
        "stop after this many evaluations in a row (epochs, and --eval-every-steps' ones) without a better "
        "--monitor-metric value (0: off); best.pt keeps the best one",
        group="output",
    )
    early_stop_min_delta: float = _opt(
        0.0,
        "--early-stop-patience: the least change of --monitor-metric that counts as better",
        group="output",
    )

    # Not a field (no flag, not saved): the fields the command line named, whatever their values, as parse_config
    # found them. None (a config built in Python, or a copy from dataclasses.replace): a field then counts as given
    # when it differs from its default (multigpu/config_checks.py, which warns about flags that do nothing).
    given: ClassVar[frozenset[str] | None] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked_type(f, getattr(self, f.name)))
        if self.dp_shard is not None and self.dp_shard < 1 and self.dp_shard != -1:
            raise UsageError(
                f"--dp-shard must be at least 1, or -1 for the processes left after --dp-replicate; "
                f"got {self.dp_shard}"
            )
        for name, allowed in RANGES.items():
            if getattr(self, name) not in FIELDS[name].metadata["words"]:
                allowed.check(name, getattr(self, name))
        if self.resume == "auto" and self.overwrite:
            raise UsageError(
                "--resume auto continues the run in --save-dir and --overwrite starts afresh over it: "
                "give one of them"
            )
        if self.monitor is not None and not self.monitor.startswith("val_"):
            raise UsageError(
                f"--{flag('monitor')} names a validation metric such as val_loss or val_acc; got {self.monitor!r}"
            )
        if self.ema_decay == 1:
            raise UsageError(
                "--ema-decay 1 would keep the starting weights forever: give a value below 1, e.g. "
                "0.999 (or 0 for no average)"
            )
        if self.hang_timeout and self.hang_timeout >= self.dist_timeout:
            raise UsageError(
                f"--hang-timeout {_number(self.hang_timeout)} must be below --dist-timeout "
                f"{_number(self.dist_timeout)} (the watchdog must act before the collectives fail): "
                f"lower it, raise --dist-timeout, or pass --hang-timeout 0 to turn the watchdog off"
            )
        self.image_dims()  # validates --image-shape
        for name in [
            "multi_gpu",
            "dataset",
            "mode",
            "model",
            "optimizer",
            "lr_scaling",
            "lr_schedule",
            "amp",
            "monitor_mode",
            "checkpoint_format",
            "fsdp_accumulate",
            "export_on_end",
            "data_on_device",
            "float8",
            "loss_weighting",
            "loss_on",
            "packing",
        ]:
            choices = FIELDS[name].metadata["choices"]
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise UsageError(f"--{flag(name)} must be one of {', '.join(choices)}; got {value!r}")
        self._check_text_pairing()
        self._check_instructions()
        self._check_run_kind()
        self._check_fault_tolerance()
        self._check_lora()
        self._check_semi_sync()
        unknown = [name for name in self.loggers if name not in LOGGERS] or ([""] if not self.loggers else [])
        if unknown:
            raise UsageError(
                f"--logger takes a comma list of {', '.join(LOGGERS)}; got {unknown[0]!r} in {self.logger!r}"
            )

    def _check_lora(self) -> None:
        """UsageError where a setting that needs LoRA adapters comes without --lora-r."""
        if self.lora_r:
            if not self.lora_targets.strip(" ,"):
                raise UsageError(
                    "--lora-targets names no layer: give all-linear, or module names such as q_proj,v_proj"
                )
            if self.float8:
                raise UsageError(
                    "--float8 trains the base's linear layers in float8, and --lora-r freezes them (its adapters "
                    "are too small to gain): drop one of them"
                )
            if self.ema_decay:
                raise UsageError(
                    "--ema-decay keeps an average of every weight, a second copy of the frozen base of --lora-r: "
                    "drop one of them"
                )
            if self.qlora and self.multi_gpu == "fsdp":
                raise UsageError(
                    "--qlora's 4-bit base (bitsandbytes) cannot be sharded by FSDP2: use --multi-gpu ddp, or "
                    "--lora-r without --qlora under --multi-gpu fsdp"
                )
            return
        if self.qlora:
            raise UsageError(
                "--qlora trains LoRA adapters on a 4-bit base: give --lora-r R too (e.g. --lora-r 8)"
            )

    @property
    def lora_scale_alpha(self) -> float:
        """--lora-alpha, or its default: twice --lora-r."""
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_r

    def _check_text_pairing(self) -> None:
        """UsageError where --dataset text, --data-file and --model gpt are not given together: character windows
        only gpt reads, and gpt reads nothing else."""
        if self.data_file is not None and self.dataset != "text":
            raise UsageError(
                f"--data-file is the text of --dataset text, and this run's data set is {self.dataset}; "
                f"add --dataset text (or drop --data-file)"
            )
        hf_only = [
            name
            for name in (
                "data_files",
                "val_files",
                "streaming",
                "input_column",
                "text_column",
                "prompt_column",
                "completion_column",
                "messages_column",
            )
            if getattr(self, name)
        ]
        if self.dataset != "hf" and hf_only:
            raise UsageError(
                f"--{flag(hf_only[0])} is for --dataset hf, and this run's data set is {self.dataset}; "
                f"add --dataset hf (or drop --{flag(hf_only[0])})"
            )
        if self.dataset == "hf" and not self.data_files:
            raise UsageError(
                "--dataset hf needs --data-files GLOB: the local files of the training set (.parquet, "
                ".jsonl/.json, .csv or .txt)"
            )
        if self.dataset == "text" and not self.data_file:
            raise UsageError("--dataset text needs --data-file FILE, a UTF-8 plain text file")
        if (self.dataset == "text") != (self.model_name == "gpt"):
            raise UsageError(
                f"--model {self.model_name} and --dataset {self.dataset} do not fit: --model gpt reads "
                f"windows of characters, --dataset text --data-file FILE gives them and no other model "
                f"reads them"
            )
        self._check_hf_model()

        if self.async_checkpoint and not self.sharded_checkpoints():
            raise UsageError(
                "--async-checkpoint writes sharded checkpoints in the background, and this run writes "
                "one file from rank 0: add --checkpoint-format sharded, or drop --async-checkpoint"
            )

    def _check_instructions(self) -> None:
        """UsageError where the columns of --model hf's text do not go together, or --loss-on, --chat-template or
        --packing asks for what this data has not (docs/language-models.md, "Instruction data")."""
        if (self.prompt_column is None) != (self.completion_column is None):
            given, missing = (
                ("--prompt-column", "--completion-column")
                if self.prompt_column
                else ("--completion-column", "--prompt-column")
            )
            raise UsageError(
                f"{given} needs {missing}: prompt/completion data is one text of the two columns, the "
                f"prompt then the completion"
            )
        kinds = [
            name
            for name, given in (
                ("--text-column", self.text_column),
                ("--prompt-column", self.prompt_column),
                ("--messages-column", self.messages_column),
            )
            if given
        ]
        if len(kinds) > 1:
            raise UsageError(
                f"{' and '.join(kinds)} name two kinds of text: give one of --text-column, --prompt-column "
                f"with --completion-column, and --messages-column"
            )
        if self.chat_template and not self.messages_column:
            raise UsageError(
                "--chat-template renders the conversations of --messages-column: add --messages-column "
                "COLUMN (or drop --chat-template)"
            )
        if self.text_kind is not None and self.text_classification and self.text_kind != "text":
            raise UsageError(
                f"--num-classes and --label-column make a classifier of --text-column's texts, and "
                f"{kinds[0]} is a language model's data: drop them, or classify a --text-column"
            )
        fits = {"completion": "prompt", "assistant": "messages"}
        if self.loss_on in fits and self.text_kind != fits[self.loss_on]:
            data = {"prompt": "--prompt-column/--completion-column", "messages": "--messages-column"}
            raise UsageError(
                f"--loss-on {self.loss_on} counts the {self.loss_on} tokens of {data[fits[self.loss_on]]} "
                f"data, and this run's data is {self._text_words()}: give --loss-on all (or leave it out)"
            )
        if self.pad_to_batch and self.packing != "auto":
            raise UsageError(
                f"--pad-to-batch pads each text instead of packing, and --packing {self.packing} packs: "
                f"give one of them"
            )

    def _text_words(self) -> str:
        """This run's data in words, for --loss-on's refusal."""
        return {
            "text": f"plain text (--text-column {self.text_column})",
            "prompt": "prompt/completion",
            "messages": "messages",
        }.get(self.text_kind or "", f"--dataset {self.dataset}'s samples")

    def _check_run_kind(self) -> None:
        """UsageError where --eval-only has no weights to evaluate or no validation set, or both warm-ups are
        given."""
        if self.warmup_steps and self.warmup_epochs:
            raise UsageError(
                f"--warmup-steps {self.warmup_steps} and --warmup-epochs {_number(self.warmup_epochs)} both set "
                f"the warm-up: give one of them"
            )
        if not self.eval_only:
            return
        pretrained = self.model_name == "hf" and self.model_path is not None
        if not (self.init_from or self.resume or pretrained):
            raise UsageError(
                "--eval-only evaluates saved weights, and this run names none: give --init-from PATH (a "
                "checkpoint, a .safetensors file or a Hugging Face folder) or --resume PATH (a checkpoint "
                "of this run)"
            )
        if self.dataset == "hf" and not self.val_files:
            raise UsageError("--eval-only evaluates the validation set: give --val-files GLOB")

    def _check_fault_tolerance(self) -> None:
        """UsageError where the --ft-* flags come without --fault-tolerance, or it lacks what every replica group
        needs: how many groups, which one this is, and one --save-dir they share (docs/fault-tolerance.md)."""
        ft_flags = [name for name in FT_FLAGS if getattr(self, name) != FIELDS[name].default]
        if not self.fault_tolerance:
            if ft_flags:
                raise UsageError(
                    f"--{flag(ft_flags[0])} is for --fault-tolerance; add --fault-tolerance "
                    f"(or drop --{flag(ft_flags[0])})"
                )
            return
        if self.ft_replica_groups is None or self.ft_replica_id is None:
            raise UsageError(
                "--fault-tolerance needs --ft-replica-groups N (how many replica groups train) and "
                "--ft-replica-id I (which of them this is, 0 to N-1); bash launch_multi_gpu.sh "
                "--fault-tolerance --replica-groups N starts them all"
            )
        if self.ft_replica_id >= self.ft_replica_groups:
            raise UsageError(
                f"--ft-replica-id {self.ft_replica_id} must be below --ft-replica-groups "
                f"{self.ft_replica_groups} (the groups are numbered from 0)"
            )
        if self.ft_min_replicas > self.ft_replica_groups:
            raise UsageError(
                f"--ft-min-replicas {self.ft_min_replicas} can never be met by --ft-replica-groups "
                f"{self.ft_replica_groups}: give at most {self.ft_replica_groups}"
            )
        refused = {
            "save_dir": self.save_dir is None,
            "overwrite": self.overwrite,
            "streaming": self.streaming,
            "autotune": self.autotune,
            "batch_size": self.batch_size == AUTO,
            "checkpoint_format": self.sharded_checkpoints(),
        }
        why = {
            "save_dir": "needs --save-dir: every replica group resumes and saves there (storage every node "
            "shares)",
            "overwrite": "continues the run in --save-dir (a restarted group must find it), which --overwrite "
            "would set aside: start a new run in an empty --save-dir instead",
            "streaming": "splits a map-style data set over the replica groups; a stream (--streaming) is not "
            "split over them",
            "autotune": "needs every replica group to train alike, and --autotune tries settings in each group "
            "on its own: leave it out",
            "batch_size": "needs the same --batch-size in every replica group, and --batch-size auto measures "
            "each group's own: give a number",
            "checkpoint_format": "writes one-file checkpoints from the leading replica group: drop "
            "--checkpoint-format sharded (and --async-checkpoint)",
        }
        for name, is_refused in refused.items():
            if is_refused:
                raise UsageError(f"--fault-tolerance {why[name]}")

    def _check_semi_sync(self) -> None:
        """UsageError where --semi-sync's flags come without it, or it comes without the replica groups it
        syncs or the steps between syncs, or with a flag of the other method, or with fsdp
        (docs/fault-tolerance.md, "Training across slow links")."""
        given = [name for name in SEMI_SYNC_FLAGS if getattr(self, name) != FIELDS[name].default]
        if self.semi_sync is None:
            if given:
                raise UsageError(
                    f"--{flag(given[0])} is for --semi-sync; add --semi-sync diloco (or local-sgd), or drop "
                    f"--{flag(given[0])}"
                )
            return
        if not self.fault_tolerance:
            raise UsageError(
                f"--semi-sync {self.semi_sync} syncs the replica groups of --fault-tolerance: add "
                f"--fault-tolerance --ft-replica-groups N --ft-replica-id I (bash launch_multi_gpu.sh "
                f"--fault-tolerance --sync-every H starts them all), or drop --semi-sync"
            )
        if self.sync_every is None:
            raise UsageError(
                f"--semi-sync {self.semi_sync} needs --sync-every H: the steps each replica group trains on "
                f"its own between two syncs (the bytes between groups fall H times)"
            )
        if self.multi_gpu == "fsdp":
            raise UsageError(
                "--semi-sync with --multi-gpu fsdp: the outer state would be per shard, which the run's "
                "one-file checkpoint does not hold; train each replica group with --multi-gpu ddp (or one "
                "process)"
            )
        diloco_only = [name for name in given if name not in ("sync_every",)]
        if self.semi_sync == "local-sgd" and diloco_only:
            raise UsageError(
                f"--{flag(diloco_only[0])} is for --semi-sync diloco (its outer optimizer and fragments); "
                f"local-sgd averages the groups' weights: drop --{flag(diloco_only[0])}"
            )
        if self.sync_every % self.fragments:
            raise UsageError(
                f"--fragments {self.fragments} syncs one fragment every --sync-every/{self.fragments} steps: "
                f"give a --sync-every that {self.fragments} divides (got {self.sync_every})"
            )

    def _check_hf_model(self) -> None:
        """UsageError where --model hf and what it reads are not given together: a transformers model, from
        --model-path or --model-config (one of them), reads the tokens of --dataset hf --text-column, which its
        tokenizer makes, and no other model reads them."""
        hf_model_only = [
            name
            for name in ("model_path", "model_config", "tokenizer", "pad_to_batch")
            if getattr(self, name)
        ]
        if self.model_name != "hf":
            if hf_model_only:
                raise UsageError(
                    f"--{flag(hf_model_only[0])} is for --model hf, and this run's model is "
                    f"{self.model_name}; add --model hf (or drop --{flag(hf_model_only[0])})"
                )
            if self.text_kind is not None:
                column = {"text": "text", "prompt": "prompt", "messages": "messages"}[self.text_kind]
                raise UsageError(
                    f"--{column}-column gives tokens, which only --model hf reads, and this run's model is "
                    f"{self.model_name}: use --model hf --model-path FOLDER (or drop --{column}-column)"
                )
            return
        if self.dataset != "hf":
            raise UsageError(
                f"--model hf reads text files through --dataset hf --text-column COLUMN, and this run's "
                f"data set is {self.dataset}; add --dataset hf --data-files GLOB --text-column text"
            )
        if self.text_kind is None:
            raise UsageError(
                "--model hf needs --text-column COLUMN (the files' column of text it trains on), or "
                "--prompt-column P --completion-column C, or --messages-column M"
            )
        if (self.model_path is None) == (self.model_config is None):
            given = "both" if self.model_path else "neither"
            raise UsageError(
                f"--model hf needs one of --model-path FOLDER (a model to fine-tune) and --model-config "
                f"FOLDER_OR_JSON (an untrained model built from a config); {given} given"
            )
        if self.tokenizer_path is None:
            raise UsageError(
                "--model-config builds an untrained model, which has no tokenizer: add --tokenizer FOLDER"
            )

    # --- derived values: computed, never stored, so they cannot go stale ---
    @property
    def fields_given(self) -> frozenset[str]:
        """The fields the user set: the flags the command line named, else (Python) those not at their default.
        Read it before copying the config: a copy from dataclasses.replace forgets `given`."""
        if self.given is not None:
            return self.given
        return frozenset(name for name, f in FIELDS.items() if getattr(self, name) != f.default)

    @property
    def watchdog_seconds(self) -> float:
        """--hang-timeout, or its default: 300 s, or half of --dist-timeout when that is shorter (0: off)."""
        return self.hang_timeout if self.hang_timeout is not None else min(300.0, self.dist_timeout / 2)

    def planned_steps(self, steps_per_epoch: int, steps_offset: int = 0) -> int:
        """The optimizer steps of the whole run: --epochs of `steps_per_epoch`, or --max-steps when it is fewer.
        The one rule the LR schedule, the warm-up, the plan and the end of training share.

        `steps_offset`: for the LR schedule of a resumed run, how far its place (the samples seen, in this run's
        steps) is ahead of the optimizer steps taken, which differ where the run had another world size or batch
        before: --max-steps counts optimizer steps, so the schedule then ends that far after it, where the steps
        asked for end (a schedule already past its end would train them at LR 0)."""
        whole = self.epochs * steps_per_epoch
        return min(whole, self.max_steps + steps_offset) if self.max_steps else whole

    def mesh_shape(self, world_size: int, nodes: int = 1) -> tuple[int, int]:
        """fsdp's device mesh (replicate, shard) for `world_size` processes on `nodes` nodes: --dp-replicate and
        --dp-shard, the one given deciding the other; neither: shard within each node and replicate across the
        nodes (one node: shard over all). A shape the processes cannot fill is a UsageError (docs/sharding.md,
        "Hybrid sharding")."""
        replicate, shard = self.dp_replicate, None if self.dp_shard == -1 else self.dp_shard
        if replicate is None and shard is None:
            return (nodes, world_size // nodes) if nodes > 1 and world_size % nodes == 0 else (1, world_size)
        needs = (replicate or 1) * (shard or 1)
        if world_size == 1 and needs > 1:
            flags = " ".join(
                f"--{flag(name)} {getattr(self, name)}"
                for name in ("dp_replicate", "dp_shard")
                if getattr(self, name) is not None
            )
            raise UsageError(
                f"{flags} needs {'' if replicate and shard else 'at least '}{needs} processes, and this "
                f"run is one process: start it with torchrun --nproc_per_node={needs}"
            )
        processes = f"{world_size} process{'es' if world_size > 1 else ''}"
        if replicate is None or shard is None:
            given, name = (replicate, "replicate") if shard is None else (shard, "shard")
            assert given is not None  # neither given returned above
            if world_size % given:
                divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
                raise UsageError(
                    f"--dp-{name} {given} does not divide this run's {processes} into equal groups: give "
                    f"one of {divisors}"
                )
            other = world_size // given
            replicate, shard = (given, other) if shard is None else (other, given)
        assert replicate is not None and shard is not None  # both given, or one filled in above
        if replicate * shard != world_size:
            raise UsageError(
                f"--dp-replicate {replicate} x --dp-shard {shard} = {replicate * shard} processes, but "
                f"this run has {processes}: make replicate x shard = {world_size}, or give --dp-shard "
                f"-1 for the processes left"
            )
        return replicate, shard

    @property
    def loggers(self) -> list[str]:
        """--logger's names, in order, once each."""
        return list(dict.fromkeys(name.strip() for name in self.logger.split(",") if name.strip()))

    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are folders of every rank's shards (--checkpoint-format; auto: under fsdp, but
        for --fault-tolerance's replica groups, whose leading group writes one file)."""
        return self.checkpoint_format == "sharded" or (
            self.checkpoint_format == "auto" and self.multi_gpu == "fsdp" and not self.fault_tolerance
        )

    def image_dims(self) -> tuple[int, int, int]:
        """--image-shape as (C, H, W)."""
        try:
            dims = tuple(int(part) for part in self.image_shape.split(","))
        except ValueError:
            dims = ()
        if len(dims) != 3 or min(dims) < 1:
            raise UsageError(
                f"--image-shape must be C,H,W with positive integers, e.g. 3,32,32; got {self.image_shape!r}"
            )
        return dims[0], dims[1], dims[2]

    @property
    def model_name(self) -> str:
        """The model to build: --model, or the default for --dataset text, --text-column or --mode."""
        if self.model is not None:
            return self.model
        if self.dataset == "hf" and self.text_kind is not None:
            return "hf"
        return "gpt" if self.dataset == "text" else "mlp" if self.mode == "flatten" else "cnn"

    @property
    def text_kind(self) -> str | None:
        """What --dataset hf's rows hold for --model hf: "text" (--text-column), "prompt" (--prompt-column and
        --completion-column), "messages" (--messages-column), or None (numbers or images)."""
        if self.text_column is not None:
            return "text"
        if self.prompt_column is not None or self.completion_column is not None:
            return "prompt"
        return "messages" if self.messages_column is not None else None

    @property
    def loss_target(self) -> str:
        """--loss-on, auto resolved: completion for prompt/completion data, assistant for messages, else all."""
        if self.loss_on != "auto":
            return self.loss_on
        return {"prompt": "completion", "messages": "assistant"}.get(self.text_kind or "", "all")

    def warmup_length(self, steps_per_epoch: int) -> int:
        """The warm-up's optimizer steps: --warmup-steps, else --warmup-epochs of `steps_per_epoch`."""
        return self.warmup_steps or round(self.warmup_epochs * steps_per_epoch)

    @property
    def tokenizer_path(self) -> str | None:
        """The folder of --model hf's tokenizer: --tokenizer, else --model-path's own (None: neither given)."""
        return self.tokenizer or self.model_path

    @property
    def text_classification(self) -> bool:
        """Whether --model hf classifies each text (AutoModelForSequenceClassification): --num-classes or
        --label-column given; else it is a causal language model."""
        return bool({"num_classes", "label_column"} & self.fields_given)

    @property
    def tensorboard_dir(self) -> str:
        """--log-dir, or <save-dir>/tb (the save-dir is chosen before anything is logged)."""
        return self.log_dir or os.path.join(self.save_dir or DEFAULT_SAVE_ROOT, "tb")

    @property
    def tensorboard_root(self) -> str:
        """The folder the user named that holds tensorboard_dir: --log-dir itself, or the save-dir. Below it
        the names are the project's (tb/), so a symbolic link there was planted and is refused."""
        return self.log_dir or self.save_dir or DEFAULT_SAVE_ROOT

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (str/int/float/bool/None only): safe for weights_only checkpoints and hparams."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Inverse of to_dict; unknown keys (from a newer version) are ignored."""
        return cls(**{name: value for name, value in values.items() if name in FIELDS})


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# --fault-tolerance's own settings: given without it, they would do nothing.
FT_FLAGS = ("ft_replica_groups", "ft_replica_id", "ft_min_replicas", "ft_lighthouse")
# --semi-sync's own settings (the same rule).
SEMI_SYNC_FLAGS = ("sync_every", "outer_lr", "outer_momentum", "fragments", "quantize_outer")


@dataclass(frozen=True)
class Range:
    """The values a numeric field allows; NaN and infinities are never allowed."""

    low: float
    high: float | None = None
    low_allowed: bool = True  # False: strictly above `low`

    def check(self, name: str, value: float | None) -> None:
        if value is None:
            return
        rule = self.describe()
        if not math.isfinite(value):
            raise UsageError(f"--{flag(name)} must be a finite number ({rule}), got {value}")
        if not (
            (value >= self.low if self.low_allowed else value > self.low)
            and (self.high is None or value <= self.high)
        ):
            must = "must not be" if rule.startswith("not ") else "must be"
            raise UsageError(f"--{flag(name)} {must} {rule.removeprefix('not ')}, got {value}")

    def describe(self) -> str:
        """The rule in words: "at least 1", "positive", "not negative", "between 0 and 1"."""
        low, high = _number(self.low), None if self.high is None else _number(self.high)
        if high is not None and self.low_allowed:
            return f"between {low} and {high}"
        if not self.low_allowed:
            text = "positive" if self.low == 0 else f"above {low}"
        else:
            text = "not negative" if self.low == 0 else f"at least {low}"
        return text + ("" if high is None else f" and at most {high}")


def _number(value: float) -> str:
    """A bound as people write it: 1, 0.5, 1000000000 (not 1.0 or 1e+09)."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


# Every numeric field and what it allows, so no flag can take a value that makes the run mean nothing.
RANGES = {
    **{
        name: Range(1)
        for name in (
            "epochs",
            "batch_size",
            "grad_accum_steps",
            "lr_base_batch",
            "log_every",
            "train_size",
            "val_size",
            "num_classes",
            "keep_last",
            "eval_batch_size",
            "block_size",
            "n_layer",
            "n_head",
            "n_embd",
        )
    },
    **{
        name: Range(0)
        for name in (
            "num_workers",
            "save_every_steps",
            "eval_every_steps",
            "warmup_steps",
            "warmup_epochs",
            "weight_decay",
            "steps_per_epoch",
            "max_steps",
            "clip_grad_norm",
            "lora_r",
            "early_stop_patience",
            "early_stop_min_delta",
            "hang_timeout",
        )
    },
    **{name: Range(0, low_allowed=False) for name in ("lr_gamma", "lr_step_epochs")},
    "lr": Range(
        0
    ),  # 0: a frozen run, to measure throughput or evaluate (the plan says the weights will not change)
    "dp_replicate": Range(1),
    "ft_replica_groups": Range(1),
    "ft_replica_id": Range(0),
    "ft_min_replicas": Range(1),
    "sync_every": Range(1),
    "outer_lr": Range(0, low_allowed=False),
    "outer_momentum": Range(0, 1),
    "fragments": Range(1),
    "dp_shard": Range(-1),  # -1: the processes left (0 is refused before, in __post_init__)
    "momentum": Range(0, 1),
    "lora_alpha": Range(0, low_allowed=False),
    "lora_dropout": Range(0, 0.99),
    "ema_decay": Range(0, 1),
    # Below a second, a process group cannot even form (torch fails with pages of C++ frames); longer than 1e9 s
    # overflows torch's store timeout (milliseconds).
    "dist_timeout": Range(1, 1e9),
    # The data order and the synthetic set derive 64-bit generator seeds from it (seed x 7919 x 1000003).
    "seed": Range(0, 2**31 - 1),
}

_KINDS = {"int": numbers.Integral, "float": numbers.Real, "bool": bool, "str": str}


def _annotation_parts(f: dataclasses.Field) -> list[str]:
    """The names a field's annotation joins: `int | None` and `Optional[int]` both give ['int', 'None']."""
    text = str(f.type)
    if text.startswith("Optional["):
        return [text.removeprefix("Optional[").removesuffix("]"), "None"]
    if text.startswith("Union["):
        return [part.strip() for part in text.removeprefix("Union[").removesuffix("]").split(",")]
    return [part.strip() for part in text.split("|")]


def field_kind(f: dataclasses.Field) -> str:
    """A field's kind: int, float, bool or str (None and the words of `int | str` aside)."""
    return _annotation_parts(f)[0]


def field_is_optional(f: dataclasses.Field) -> bool:
    """Whether the field also takes None."""
    return "None" in _annotation_parts(f)


def _checked_type(f: dataclasses.Field, value: Any) -> Any:
    """`value` as the field's type (an int is accepted for a float, a word where the field has words; None is
    "not set", the field's default where None is not a value of its own), or UsageError naming the field."""
    optional = field_is_optional(f)
    kind = field_kind(f)
    words = f.metadata["words"]
    if value is None and not optional:
        return f.default  # TrainConfig(max_steps=None) as a caller writes "not set": the flag's default
    if (value is None and optional) or (isinstance(value, str) and value in words):
        return value
    if isinstance(value, _KINDS[kind]) and (kind == "bool" or not isinstance(value, bool)):
        return {"int": int, "float": float}.get(kind, lambda same: same)(value)  # plain types for checkpoints
    alternatives = "".join(f" or {word!r}" for word in words) + (" or None" if optional else "")
    raise UsageError(
        f"TrainConfig {f.name} (--{flag(f.name)}) must be {'an' if kind == 'int' else 'a'} {kind}"
        f"{alternatives}, got {value!r} ({type(value).__name__})"
    )


def _number_or_word(kind: Callable[[str], Any], words: Sequence[str]) -> Callable[[str], Any]:
    """The command-line parser of a numeric field that also takes words: --batch-size 64 or --batch-size auto."""

    def parse(text: str) -> Any:
        if text in words:
            return text
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a whole number or {' or '.join(words)}, got {text!r}"
            ) from None

    return parse


# Flags spelt otherwise than their field. torchrun's parser reads every word of its command line, the script's
# flags too, and takes a prefix of two of its options for an ambiguous abbreviation and refuses the run: --monitor
# (of --monitor-interval and --monitor_interval). So the metric's flag is --monitor-metric, a name no torchrun option
# starts with; --monitor, its old name, still works where torchrun does not read the command (python, the launcher,
# which writes --monitor-metric in the command it runs).
FLAG_NAMES = {"monitor": "monitor-metric"}
FLAG_ALIASES = {"monitor": ("--monitor",)}


def flag(name: str) -> str:
    """The CLI flag (without dashes) of a config field: batch_size -> batch-size, monitor -> monitor-metric."""
    return FLAG_NAMES.get(name, name.replace("_", "-"))


def canonical_flags(argv: Sequence[str]) -> list[str]:
    """`argv` with each flag's old name (--monitor, --monitor=X) as its own name: what torchrun can pass on."""
    old_names = {alias: f"--{flag(name)}" for name, aliases in FLAG_ALIASES.items() for alias in aliases}
    canonical = []
    for word in argv:
        name, equals, value = word.partition("=")
        canonical.append(old_names[name] + equals + value if name in old_names else word)
    return canonical


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input in one line (no usage block), exit 2, and takes flags only as spelt.

    argparse would read an abbreviation (--ep 2) as the flag it starts (--epochs): a typo would then be
    accepted, and a flag added later could change what an old command means.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


GROUPS = ("devices", "data", "model", "optimisation", "output")
_BOOLEAN_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


class _BooleanAction(argparse.BooleanOptionalAction):
    """--flag, --no-flag, and also --flag true / --flag false (how a value is written in a config or a sweep)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.nargs, self.metavar = "?", "true|false"

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values is None:
            super().__call__(parser, namespace, None, option_string)
            return
        assert option_string is not None  # argparse calls a flag's action with the flag as given
        if option_string.startswith("--no-") or values.lower() not in _BOOLEAN_WORDS:
            allowed = "no value" if option_string.startswith("--no-") else "no value, or true or false"
            raise UsageError(f"{option_string} takes {allowed}, got {values!r} (see --help)")
        setattr(namespace, self.dest, _BOOLEAN_WORDS[values.lower()])


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default once: not where its help already says it, nor for an empty default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS)
            or action.option_strings == ["-h", "--help"]
        ):
            return text
        return super()._get_help_string(action) or text


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """An ArgumentParser whose flags are exactly TrainConfig's fields, grouped as in --help."""
    parser = OneLineParser(description=description, formatter_class=_HelpFormatter)
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for f in dataclasses.fields(TrainConfig):
        group, option = groups[f.metadata["group"]], f"--{flag(f.name)}"
        if f.type in ("bool", bool):
            group.add_argument(option, action=_BooleanAction, default=f.default, help=f.metadata["help"])
            continue
        kind = {"int": int, "float": float}.get(field_kind(f), str)
        words = f.metadata["words"]
        group.add_argument(
            option,
            *FLAG_ALIASES.get(f.name, ()),
            dest=f.name,
            type=_number_or_word(kind, words) if words else kind,
            default=f.default,
            choices=f.metadata["choices"],
            help=f.metadata["help"],
        )
    # Old launchers (torch.distributed.launch) pass --local-rank/--local_rank; ranks come from the environment.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def reference_table() -> str:
    """Every field as the API reference lists it (docs/reference/config.md, through scripts/mkdocs_hooks.py): per
    group of --help, each field's flag, type, default and help, from the same table as the command line."""
    lines = []
    for group in GROUPS:
        lines += [f"**{group}**", "", "| flag (field) | type | default | what it does |", "|---|---|---|---|"]
        for f in dataclasses.fields(TrainConfig):
            if f.metadata["group"] == group:
                cells = (
                    cell.replace("|", "\\|").replace("<", "&lt;") for cell in _reference_row(f)
                )  # not markup
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _reference_row(f: dataclasses.Field) -> list[str]:
    flags = f"`--{flag(f.name)}`" + (f", `--no-{flag(f.name)}`" if f.type in ("bool", bool) else "")
    kind = " or ".join([field_kind(f), *(repr(word) for word in f.metadata["words"])])
    kind += f": one of {', '.join(f.metadata['choices'])}" if f.metadata["choices"] else ""
    kind += " or None" if field_is_optional(f) else ""
    return [f"{flags} (`{f.name}`)", kind, f"`{f.default!r}`", f.metadata["help"]]


# Test-only: flags read before the command line's own, which win over them. The docs test
# (tests/test_docs.py) runs the documented commands as written, with smaller data and fewer epochs.
TEST_ARGS_ENV = "MULTIGPU_TEST_ARGS"


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse command-line arguments into a validated TrainConfig that knows which flags they named (`given`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = vars(build_parser().parse_args(shlex.split(os.environ.get(TEST_ARGS_ENV, "")) + argv))
    args.pop("local_rank")
    config = TrainConfig(**args)
    # The user's flags, not the test harness's; `given` is a ClassVar only to keep it out of the fields.
    config.given = given_fields(argv)  # type: ignore[misc]  # set per instance on purpose
    return config


def given_fields(argv: Sequence[str]) -> frozenset[str]:
    """The TrainConfig fields that `argv` names, whatever their values (--lr-gamma 0.1 names lr_gamma although
    0.1 is its default): parsed with every default suppressed, the namespace holds only what `argv` gave."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(list(argv)))) & FIELDS.keys()


def to_argv(config: TrainConfig) -> list[str]:
    """The flags that reproduce `config` (only those that differ from the defaults, group="output")."""
    argv: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(f"--{flag(f.name)}" if value else f"--no-{flag(f.name)}")
        else:
            argv += [f"--{flag(f.name)}", str(value)]
    return argv
