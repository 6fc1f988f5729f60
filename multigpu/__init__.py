"""Building blocks of the multi-GPU trainer, one concern per module.

- config:       TrainConfig, the one typed description of a run (CLI, checkpoint, hparams)
- config_checks: the warnings for flags the user gave that this run does not use
- errors:       UsageError, the one-line, exit-2 way to reject bad input
- distributed:  which mode/device/backend to use, and process-group set-up
- sharding:     --multi-gpu fsdp: FSDP2 fully_shard per block then the root, its mixed precision, a sharded EMA
- amp:          mixed precision: autocast, the fp16 GradScaler, skipped-step counting
- batches:      moving any nesting of tensors to the device; a batch into outputs and a loss by forward's signature
- optim:        optimizer and LR schedule (built-in, or the user's own)
- lr_scaling:   the LR scaling rule (torch-free, so the launcher can ask it)
- metrics:      evaluation metrics reduced exactly across ranks (sums and counts)
- evaluation:   exact distributed evaluation: every sample once, any world size
- streaming:    IterableDataset input: split over ranks and workers, uneven ends agreed, the stream's position
- device_data:  --data-on-device: a training set of tensors kept on the device, each batch gathered there
- float8:       --float8: torchao's float8 Linear layers where the GPU has float8 (refused in one line elsewhere)
- prediction:   the outputs of every sample in dataset order, any world size, in memory or streamed to a file
- inference:    BatchParallel: a batch split over several devices in one process, for prediction
- meters:       per-interval loss/throughput, the one host sync of a logging interval
- telemetry:    where the time goes (data wait, copy, compute), CUDA memory, MFU: logged at sync points only
- flops:        FLOPs counted once per run, and the table of GPU peaks MFU divides by (never guessed)
- batch_size:   --batch-size auto: the largest batch whose step fits in GPU memory, agreed by all ranks
- snapshot:     probes at start that leave no trace (model, optimizer and RNG restored exactly)
- callbacks:    user code at fixed points of fit() (state in checkpoints); built-ins: early stopping, EMA
- checkpoint:   checkpoint files: atomic saves, safe loads, finding the newest good one
- checkpointer: the resume and save protocol over a dict of stateful things (what must match); knows no trainer
- stateful:     the things a checkpoint holds, each with state_dict()/load_state_dict() (model, optimizer, RNG...)
- sharded:      sharded checkpoint folders: every rank writes its shards with DCP, renamed into place when complete
- export:       python -m multigpu.export CKPT_DIR OUT.pt: a sharded folder as one checkpoint file
- rng:          seeding, and RNG state as plain types for checkpoints
- reporting:    rank-0 console, progress bar and TensorBoard
- preemption:   SIGTERM/SIGINT as a clean stop, naming a lost rank, torchrun restarts
- faults:       the test-only fault injector (SIGKILL or SIGSTOP a rank)
- heartbeat:    where each rank is (step, phase, last collective): plain attribute writes on the hot path
- watchdog:     --hang-timeout: publishes heartbeats to the store; when no rank advances, report, save, exit 3
- hang_report:  the watchdog's diagnosis, hang_report.txt, the save of the last completed step, NCCL's recorder
- collective_check: --debug-collectives: ranks agree on each collective's op and shapes through the store
- savedir:      one run owns a save-dir; numbered run folders; --overwrite's set-aside copies
- run_settings: the settings a checkpoint was trained with, read torch-free; how a command differs from them
- safe_files:   every file the project writes, never through a planted symbolic link (O_NOFOLLOW, or rename)
- launch_rules: the launcher's rule set: checks, numbers, the command and the SLURM script (torch-free)
- torchrun:     torchrun that ends with the workers' exit status, its own reports in a log file
- runner:       one training run from a config or a command line, and its exit status (CLI and sweep workers)
- console:      the console is best-effort: a closed or broken stdout/stderr never stops a run
- fork_safety:  each fork waits for Python's thread-state lock (held at a fork, it hangs the worker: < 3.12)
- sweep/:       experiment sweeps (seeds x a grid over device slots, resume, summary, SLURM job arrays)
- data, models: the data-set and model registries (the checkout's top-level data/ and models/)
"""

import os as _os

from multigpu.fork_safety import wait_for_thread_states_before_fork as _wait_before_fork

# First, so that its wait runs last before each fork (Python runs fork handlers in reverse order): a loader
# worker forked while a torch thread holds Python's thread-state lock would hang (multigpu/fork_safety.py).
_wait_before_fork()

# data/ and models/ sit at the top of the checkout, where the layout shows the architecture, yet they
# belong to this package: installed, pyproject maps them to multigpu.data and multigpu.models; run from
# a checkout, this line finds them beside multigpu/. So nothing named plain `data` or `models` is ever
# imported, and a user's own data.py or models.py cannot shadow the framework's.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "data")) \
        and _os.path.isfile(_os.path.join(_checkout, "data", "__init__.py")):
    __path__.append(_checkout)  # type: ignore[name-defined]  # noqa: F821
