"""Parallelism: the process group and the run's devices (distributed), DDP/DataParallel wrapping (wrapping),
FSDP2 sharding (sharding) and --debug-collectives (collective_check).

Owns: every call into torch.distributed's process group and the wrappers around the model.
May import: the package root and multigpu.resilience (heartbeats of collectives, the restart-safe store).
"""
