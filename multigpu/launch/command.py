"""The command the launcher runs (torchrun, through multigpu/launch/torchrun.py, or python) and the numbers it
shows beside it: the device phrase, the effective batch and the LR the trainer will use (torch-free).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import replace

from multigpu.config import AUTO, FIELDS, TrainConfig
from multigpu.launch.answers import (
    PROCESS_PER_DEVICE,
    TORCHRUN,
    TRAINER,
    Devices,
    Nodes,
    Settings,
    cores_here,
    omp_threads,
    plural,
    trainer_flags,
)
from multigpu.lr_scaling import effective_batch, scaled_lr


def shown(path: str) -> str:
    """A path as printed: relative when under the current directory (commands run from there)."""
    cwd = os.getcwd() + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else path


def quoted(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(word) for word in words)


def torchrun_log(save_dir: str, nodes: Nodes) -> str:
    name = "torchrun.log" if nodes.count == 1 else f"torchrun-node{nodes.rank}.log"
    return os.path.join(save_dir, name)


def command(s: Settings, devices: Devices, nodes: Nodes, port: int, config: TrainConfig) -> list[str]:
    """The command line, environment assignments first: exactly what runs, and what launch_command.sh repeats."""
    env = []
    if devices.ids and devices.mode != "dp":
        env.append(f"CUDA_VISIBLE_DEVICES={devices.ids}")
    trainer = shown(TRAINER)
    if devices.mode in PROCESS_PER_DEVICE:
        env.append(f"OMP_NUM_THREADS={omp_threads(cores_here(), devices.count)}")
        assert config.save_dir is not None  # the launcher settles it before the command (launch_rules)
        words = [
            shown(s.python),
            shown(TORCHRUN),
            "--log-file",
            torchrun_log(config.save_dir, nodes),
            f"--nproc_per_node={devices.count}",
        ]
        if nodes.count > 1:
            # c10d: node 0 hosts the store at --master-addr:port (said, not guessed from the address);
            # the id only has to be the same on every node, as the port is.
            host = f"[{nodes.master_addr}]" if ":" in str(nodes.master_addr) else nodes.master_addr
            words += [
                f"--nnodes={nodes.count}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={host}:{port}",
                f"--rdzv_id=multigpu-{port}",
                f"--rdzv_conf=is_host={int(nodes.rank == 0)}",
            ]
        else:
            if nodes.master_addr:
                words.append(f"--master_addr={nodes.master_addr}")
            words.append(f"--master_port={port}")
        if nodes.max_restarts is not None:
            words.append(f"--max_restarts={nodes.max_restarts}")
        words.append(trainer)
    else:
        words = [shown(s.python), trainer]
    words += trainer_flags(s, devices) + s.trainer_args
    return env + words


def devices_per_step(devices: Devices, nodes: Nodes) -> int:
    """The devices whose batches make one step: every process on every node under DDP, dp's GPUs, or one."""
    return devices.count * nodes.count if devices.mode in PROCESS_PER_DEVICE else devices.count


def per_device_batch(config: TrainConfig, devices: Devices) -> int | None:
    """--batch-size as the run will use it: None where --batch-size auto will find it on the GPUs at start, the
    trainer's default where auto has no CUDA to measure (the trainer says so too)."""
    if isinstance(config.batch_size, int):  # else AUTO
        return config.batch_size
    default = FIELDS["batch_size"].default
    assert isinstance(default, int)  # the field's default is a number
    return None if devices.on_gpu else default


def effective_batch_text(config: TrainConfig, devices: Devices, nodes: Nodes) -> str:
    total, batch = devices_per_step(devices, nodes), per_device_batch(config, devices)
    tail = f" x {plural(total, devices.unit)} x {plural(config.grad_accum_steps, 'accumulation step')}"
    if batch is None:
        return f"the largest batch that fits per GPU, found at start (--batch-size auto){tail}"
    auto = " (--batch-size auto needs CUDA)" if config.batch_size == AUTO else ""
    return f"{effective_batch(replace(config, batch_size=batch), total)} = {batch} per {devices.unit}{auto}{tail}"


def lr_text(s: Settings, config: TrainConfig, devices: Devices, nodes: Nodes) -> str:
    batch = per_device_batch(config, devices)
    if config.lr_scaling == "none":
        return f"lr {config.lr!r} (not scaled)"
    if batch is None:
        return f"lr {s.lr} x {config.lr_scaling}(effective batch/{config.lr_base_batch}), once the batch is found"
    total = effective_batch(replace(config, batch_size=batch), devices_per_step(devices, nodes))
    lr = scaled_lr(config.lr, config.lr_scaling, total, config.lr_base_batch)
    return f"lr {lr!r} = {s.lr} x {config.lr_scaling}({total}/{config.lr_base_batch})"


def training_plan(
    s: Settings, config: TrainConfig, devices: Devices, nodes: Nodes
) -> Iterator[tuple[str, str]]:
    """The plan's lines of epochs, effective batch and LR: the same for a run here and every cluster engine."""
    yield "plan", f"  epochs {config.epochs}; effective batch {effective_batch_text(config, devices, nodes)}"
    yield "plan", f"  {lr_text(s, config, devices, nodes)}"
    if config.lora_r:
        four_bit = ", the base's linear layers in 4-bit NF4 (QLoRA)" if config.qlora else ""
        yield "plan", f"  LoRA adapters of rank {config.lora_r} train, the base frozen{four_bit}"


def device_phrase(devices: Devices, nodes: Nodes) -> str:
    """'DDP with 4 GPUs', 'DataParallel over GPUs 0,2', 'one CPU process', ..."""
    if devices.ids:
        what = f"GPU{'s' if ',' in devices.ids else ''} {devices.ids}"
    elif devices.on_gpu:
        what = plural(devices.count, "GPU")
    else:
        what = f"{plural(devices.count, 'CPU process')} (gloo)"
    phrase = {
        "ddp": f"DDP with {what}",
        "fsdp": f"FSDP (the model sharded) over {what}",
        "dp": f"DataParallel over {what}",
    }.get(devices.mode)
    if devices.mode == "dp" and not devices.on_gpu:
        phrase = "one CPU process (--multi-gpu dp needs 2 or more GPUs and none were found: the trainer falls back)"
    if phrase is None:
        phrase = (
            f"one GPU{f' (id {devices.ids})' if devices.ids else ''}" if devices.on_gpu else "one CPU process"
        )
    if nodes.count > 1:
        phrase += f" per node x {nodes.count} nodes (this is node {nodes.rank})"
    return phrase
