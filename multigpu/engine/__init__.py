"""The engine's parts: how MultiGPUTrainer (train_multi_gpu.py) is made from a TrainConfig (build), what its
checkpoint holds beyond its parts' own state and the words of a resume (state), and what it says and returns at
the end of a run (summary).

Owns: the composition of the parts below; no training logic of its own.
May import: every subpackage below it (the root, resilience, parallel, data, loop, checkpoints, monitoring,
tuning). Nothing imports it but train_multi_gpu.py.
"""
