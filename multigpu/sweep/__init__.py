"""Experiment sweeps: seeds x a grid of TrainConfig values (or points an Optuna study draws), one full training run
per experiment.

    python sweep_multi_gpu.py --num-seeds 3 --grid lr=1e-3,3e-3 -- --epochs 5
    python main_multi_gpu.py --num-seeds 3 --max-gpus 4 --epochs 5     # the same sweep
    python sweep_multi_gpu.py --search optuna --trials 20 --space 'lr=log(1e-4,1e-1)' --prune asha -- --epochs 5

One concern per module (docs/sweeps.md, "Sweeps"):

- options:    the sweep's own flags, and telling them apart from the training flags
- plan:       the grid, the experiment list, its shards, and the fingerprint that a resume must match
- records:    the sweep directory: results.jsonl, progress.json, sweep.json, locks
- worker:     one worker process per device slot, running experiments one after another
- scheduler:  the slots, the queue, dead workers and retries, the progress bar
- summary:    mean, std and 95% confidence interval over seeds per grid point
- slurm:      the sbatch job-array script that runs the shards on a cluster
- child:      the torchrun entry of an experiment that is itself a multi-process DDP run
- space:      --search's --space: where each setting is drawn from, by the grid's value rules
- study:      the Optuna study in DIR/study.journal, its sampler and pruner, the link a run follows to its trial
- pruning:    the trainer's side: a callback that reports each epoch to the trial and stops a pruned run
- search:     the search's driver: trials asked when a slot is free, resumed after a kill, told as they end
- search_summary: one row per trial, the best trial and its command line
- study_views: TensorBoard's HParams sessions of the trials, and Optuna's plots
- cli:        the command line that ties them together
"""

from multigpu.sweep.options import requested

__all__ = ["requested"]
