"""The training loop's parts: precision (amp), batches of any structure (batches), optimizers and schedules
(optim), metrics and exact evaluation (metrics, evaluation), losses over tokens (tokens), prediction in
dataset order (prediction, inference), callbacks (callbacks), where training stands (progress), seeding (rng)
and probes that leave no trace (snapshot).

Owns: what one step, one evaluation and one prediction compute.
May import: the package root, multigpu.resilience, multigpu.parallel and multigpu.data.
"""
