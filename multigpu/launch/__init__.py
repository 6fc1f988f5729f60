"""Starting runs: one training run from a config or a command line and its exit status (runner), torchrun that
ends with the workers' verdict (torchrun), the launcher's rule set (launch_rules) and a console that never stops
a run (console).

Owns: processes, exit statuses and the commands a user sees.
May import: everything below, and the engine (train_multi_gpu). Nothing in multigpu imports it but sweep.
"""
