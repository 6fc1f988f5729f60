"""The engine's parts: the few of MultiGPUTrainer's (train_multi_gpu.py) that span concerns (build: the
built-in callbacks, --hang-timeout's watchdog, --autotune's switch of settings), the parts made from many of
its others (parts: the step, the evaluator, telemetry, sync points, --batch-size auto, --autotune; every other
part's factory lives beside it), what its checkpoint holds beyond its parts' own state and the words of a
resume (state), what it says and returns at the end of a run (summary), and --fault-tolerance's replica
groups (replicas) with --semi-sync's windows between syncs (sync_windows).

Owns: the composition of the parts below; no training logic of its own.
May import: every subpackage below it (the root, resilience, parallel, data, loop, checkpoints, monitoring,
tuning). Nothing imports it but train_multi_gpu.py.
"""
