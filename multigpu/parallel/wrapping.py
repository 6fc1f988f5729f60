"""The model in the form it trains in, and what wraps it: --sync-bn, --channels-last and --compile applied to the
plain module on its device, then DDP, DataParallel or FSDP2's sharding around it (multigpu/parallel/sharding.py).
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.parallel import activation_checkpointing, collective_check, float8, lora, sharding
from multigpu.parallel.distributed import Runtime
from multigpu.parallel.gradient_nodes import hold_gradient_nodes
from multigpu.resilience.heartbeat import BEAT


def prepare_model(
    model: torch.nn.Module, config: TrainConfig, runtime: Runtime, say: Callable[[str], None]
) -> torch.nn.Module:
    """The plain module on this process's device, in the form it trains in; `wrap_model` then wraps it.

    --sync-bn converts BatchNorm (a CUDA feature: it raises in training mode on
    the CPU; docs/scaling.md, "BatchNorm"). --channels-last converts the
    weights here, before the DDP wrap, so DDP's buckets match their layout.
    --compile compiles the module in place (`module.compile()`, the order
    torch's documentation gives for DDP: compile the module, then wrap it), so
    its state_dict keeps plain keys and checkpoints load compiled or not.
    What fsdp cannot do is refused first; --float8 converts before --compile compiles; --lora-r's adapters
    (multigpu/parallel/lora.py) and --activation-checkpointing come before the module moves to its device.
    """
    nn = torch.nn
    if runtime.mode == "fsdp":
        sharding.refuse_unsupported(config)
    if config.float8:
        float8.convert_for_training(model, config.float8, runtime.device, runtime.mode == "fsdp", say)
    if _syncs_batchnorm(config, runtime):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # keeps weights, buffers and train/eval flags
    elif config.sync_bn:
        say("--sync-bn needs DDP on CUDA devices; keeping per-device BatchNorm")
    # --lora-r: the base frozen, adapters beside its linear layers; then --activation-checkpointing around the
    # blocks, which hold the adapters by now.
    if config.qlora and runtime.mode == "dp":
        raise UsageError(
            "--qlora's 4-bit base cannot be copied to each GPU by nn.DataParallel: run it under torchrun "
            "(--multi-gpu ddp) or on one device (--multi-gpu none)"
        )
    model = lora.add_adapters(model, config)
    if config.activation_checkpointing:
        say(
            activation_checkpointing.checkpoint_activations(model, config.fsdp_blocks, runtime.mode == "fsdp")
        )
    model = model.to(runtime.device)
    if config.channels_last:
        model = model.to(
            memory_format=torch.channels_last
        )  # 4-D weights (convolutions); others stay as they are
    if config.compile and runtime.mode == "dp":
        say(
            "--compile does not work with nn.DataParallel (it copies the model to each GPU every step): training "
            "uncompiled; use --multi-gpu ddp to compile"
        )
    elif config.compile:
        # float8's kernels do not build for a symbolic batch dimension (torchao with inductor: "expected [s0] to
        # have been codegen-ed"), so a float8 model is compiled once per batch shape instead.
        model.compile(dynamic=False if config.float8 else None)
    return model


def uncompiled() -> AbstractContextManager:
    """A --compile'd module runs eagerly meanwhile. The probes of a few samples at start (the FLOP count, the
    names check, --batch-size auto's trials) must not compile it at their batch sizes: training's first step
    would then recompile it with a symbolic batch dimension, whose kernels are slower (and float8's fail)."""
    if "torch._dynamo" not in sys.modules:
        # Nothing is compiled (compiling imports dynamo), and importing dynamo to set its stance would cost
        # every run of an uncompiled model 1.7 s of start.
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def wrapped_for_training(
    model: torch.nn.Module,
    config: TrainConfig,
    runtime: Runtime,
    amp_dtype: torch.dtype | None,
    say: Callable[[str], None],
) -> tuple[torch.nn.Module, Callable[[], AbstractContextManager], list[Any]]:
    """What trains (DDP, DataParallel, the module sharded in place by fsdp, or the module), the context of the
    inner micro-steps of an accumulation window (no gradient sync), and the gradient nodes held for the run:
    without DDP's reducer to hold them autograd would rebuild every parameter's AccumulateGrad node each step
    (multigpu/parallel/gradient_nodes.py); fsdp's parameters are its own to manage."""
    nodes = hold_gradient_nodes(model) if runtime.mode in ("none", "dp") else []
    wrapped = wrap_model(model, config, runtime, say, amp_dtype)
    no_sync = (
        as_ddp(wrapped).no_sync
        if runtime.mode == "ddp"
        else contextlib.nullcontext
        if runtime.mode != "fsdp"
        else sharding.no_gradient_sync(wrapped, config.fsdp_accumulate == "sharded")
    )
    return wrapped, no_sync, nodes


def wrap_model(
    model: torch.nn.Module,
    config: TrainConfig,
    runtime: Runtime,
    say: Callable[[str], None],
    amp_dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """What training calls: DDP or DataParallel around the prepared module, the module itself sharded in
    place (fsdp, in `amp_dtype`: multigpu/parallel/sharding.py), or the module itself.

    Small per-device batches with BatchNorm get a warning, since their statistics
    then depend on the device count (docs/scaling.md, "BatchNorm").
    """
    nn = torch.nn
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if (
        has_batchnorm
        and not _syncs_batchnorm(config, runtime)
        and runtime.devices_per_step > 1
        and isinstance(config.batch_size, int)  # resolved from auto before
        and config.batch_size < 16
    ):
        say(
            f"warning: BatchNorm statistics come from {config.batch_size} samples per device; "
            f"results will depend on the device count (consider --sync-bn or a larger batch)"
        )
    BEAT.check = None  # until --debug-collectives installs its check (a process may build several trainers)
    if runtime.mode == "fsdp":
        assert runtime.mesh_shape is not None  # Runtime.__post_init__ fills it
        model, blocks = sharding.shard(
            model,
            runtime.device,
            runtime.world_size,
            blocks=config.fsdp_blocks,
            reshard_after_forward=config.fsdp_reshard_after_forward,
            amp_dtype=amp_dtype,
            replicate=runtime.mesh_shape[0],
        )
        say(
            f"fsdp: {blocks} block(s) sharded as units of their own, then the root"
            f"{'' if config.fsdp_reshard_after_forward else ' (parameters kept gathered from forward to backward)'}"
        )
        return model
    if runtime.mode == "ddp":
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        if config.debug_collectives:
            collective_check.install(ddp, runtime.rank, runtime.world_size, config.dist_timeout)
        return ddp
    if runtime.mode == "dp":
        say(
            "warning: nn.DataParallel drives all GPUs from one process (GPU 0 holds more memory, other replicas' "
            "BatchNorm statistics are lost); DDP via torchrun is faster"
        )
        return nn.DataParallel(
            model, device_ids=runtime.dp_device_ids, output_device=runtime.dp_device_ids[0]
        )
    return model


def as_ddp(wrapped: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    """What wrap_model made under ddp, typed as the DDP it is (its no_sync, its hooks)."""
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    return wrapped


def _syncs_batchnorm(config: TrainConfig, runtime: Runtime) -> bool:
    return config.sync_bn and runtime.mode == "ddp" and runtime.device.type == "cuda"
