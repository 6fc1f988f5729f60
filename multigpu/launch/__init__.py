"""Starting runs: one training run from a config or a command line and its exit status (runner), torchrun that
ends with the workers' verdict (torchrun), the launcher's rule set (launch_rules) and a console that never stops
a run (console); the cluster engines' jobs: the rules they share (cluster_jobs), SLURM's script (slurm),
Kubernetes' TrainJob (kubernetes) and Ray Train's workers (ray_train).

Owns: processes, exit statuses and the commands a user sees.
May import: everything below, and the engine (train_multi_gpu). Nothing in multigpu imports it but sweep.
"""
