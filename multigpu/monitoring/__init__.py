"""What the user sees and measures: the plan lines (plan), the console, progress bar and TensorBoard from rank
0 (reporting, event_file), per-interval numbers (meters), where the time goes (telemetry) and FLOPs (flops).

Owns: every line a run prints and every scalar it logs.
May import: the package root and every subpackage below it (resilience, parallel, data, loop, checkpoints).
"""
