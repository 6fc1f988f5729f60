"""Parallelism: the process group and the run's devices (distributed), the module made ready for them and
wrapped (wrapping: --compile, --channels-last, --sync-bn, --float8 by float8, --lora-r's adapters by lora,
--activation-checkpointing by activation_checkpointing, then DDP/DataParallel; the gradient nodes held where no
DDP reducer holds them, gradient_nodes), FSDP2 sharding (sharding) and --debug-collectives (collective_check),
--fault-tolerance's replica groups through torchft (fault_tolerance) and --semi-sync's DiLoCo and LocalSGD over
them (semi_sync).

Owns: every call into torch.distributed's process group, and the module's form on its devices.
May import: the package root and multigpu.resilience (heartbeats of collectives, the restart-safe store).
"""
