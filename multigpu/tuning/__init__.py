"""Speed settings found or applied at start: --autotune (autotune), --batch-size auto (batch_size), memory a
CPU step frees kept for the next (cpu_memory) and short garbage-collector pauses (gc_pauses).

Owns: settings that change how fast a step runs, never what it computes.
May import: the package root and every subpackage below it (resilience, parallel, data, loop, checkpoints,
monitoring).
"""
