"""Building blocks of the multi-GPU trainer, one concern per module.

- config:       TrainConfig, the one typed description of a run (CLI, checkpoint, hparams)
- errors:       UsageError, the one-line, exit-2 way to reject bad input
- distributed:  which mode/device/backend to use, and process-group set-up
- optim:        optimizer and LR schedule
- lr_scaling:   the LR scaling rule (torch-free, so the launcher can ask it)
- rng:          seeding, and RNG state as plain types for checkpoints
- checkpoint:   atomic rank-0 saves, safe loads, finding the newest good checkpoint
- reporting:    rank-0 console, progress bar and TensorBoard
- preemption:   SIGTERM/SIGINT handling, naming a lost rank, torchrun restarts, the test-only fault injector
- launch_rules: the launcher's rule set: checks, numbers, the command and the SLURM script (torch-free)
- torchrun:     torchrun that ends with the workers' exit status, its own reports in a log file
"""
