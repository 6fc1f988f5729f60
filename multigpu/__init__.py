"""The multi-GPU trainer's package: one folder per concern, each layer importing only the layers below it.

From the bottom up (a subpackage's own docstring says what it owns and may import):

- the root:     the vocabulary every layer shares: TrainConfig (config) and its warnings (config_checks), the
                LR rule (lr_scaling), one-line errors (errors), files never written through a link (safe_files)
- resilience/:  when things go wrong: heartbeats, signals and lost ranks, the hang doctor, the fault injector
- parallel/:    the process group and the run's devices, the module's form on them (--compile, --float8 ...),
                DDP/DataParallel wrapping, FSDP2 and HSDP sharding
- data/:        the data sets (the checkout's top-level data/), samplers, streams split over ranks and workers
- models/:      the model registry (the checkout's top-level models/)
- loop/:        what a step, an evaluation and a prediction compute: precision, batches, optimizers, metrics,
                callbacks
- checkpoints/: every byte of the save-dir: atomic and sharded checkpoints, resume and save, weights in
                other formats (safetensors, Hugging Face), the save-dir's ownership and numbered run folders
- monitoring/:  what the user sees: plan lines, console, progress bar, TensorBoard and other trackers,
                telemetry
- tuning/:      settings for speed: --autotune, --batch-size auto, memory and garbage-collector settings
- engine/:      MultiGPUTrainer's parts that span concerns (build), those made from many others (parts), what
                its checkpoint adds (state), a run's end (summary); every other part is made by a factory beside it
- train_multi_gpu.py (the checkout's top): MultiGPUTrainer, the training loop, built from the parts above
- launch/:      starting runs: the runner and its exit status, torchrun, the launcher's rules
- sweep/:       experiment sweeps over device slots

Public names kept at short paths, as plain modules: `python -m multigpu.export` (export.py) and
`multigpu.inference.BatchParallel` (inference.py); `multigpu.config.TrainConfig` and `multigpu.data.build_datasets`
are where they live.
"""

import os as _os

from multigpu.resilience.fork_safety import wait_for_thread_states_before_fork as _wait_before_fork

# First, so that its wait runs last before each fork (Python runs fork handlers in reverse order): a loader
# worker forked while a torch thread holds Python's thread-state lock would hang (multigpu/resilience/fork_safety.py).
_wait_before_fork()

# data/ and models/ sit at the top of the checkout, where the layout shows the architecture, yet they
# belong to this package: installed, pyproject maps them to multigpu.data and multigpu.models; run from
# a checkout, this line finds them beside multigpu/. So nothing named plain `data` or `models` is ever
# imported, and a user's own data.py or models.py cannot shadow the framework's.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(
    _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "data")
) and _os.path.isfile(_os.path.join(_checkout, "data", "__init__.py")):
    __path__.append(_checkout)  # noqa: F821
