"""The launcher's rule set: launch_multi_gpu.sh asks and runs, this module decides.

The launcher keeps the conversation (questions, re-asking, confirmation), finds
the GPUs and runs the command. Every check of a flag or an answer, and every
number it shows (effective batch, scaled LR, the command and its flags, the
SLURM script), comes from here, through the trainer's own parser, TrainConfig
and LR rule: the launcher cannot accept what the trainer refuses, nor show an
LR the trainer will not use. It imports no torch, so a call takes milliseconds.

    python -m multigpu.launch.launch_rules STEP [--SETTING VALUE ...] [-- TRAINER ARGS]

STEP is `check` (validate what is known so far; give the questions' defaults),
`plan` (the command, the plan lines and the rendezvous port), `slurm` (also
the SLURM job script), `k8s` (the Kubernetes TrainJob, multigpu/launch/kubernetes.py)
or `ray` (the command that trains on Ray, multigpu/launch/ray_train.py).
SETTINGs are the launcher's flags, by their names (`--epochs 3`), plus what the
launcher found (`--found-gpus 0,1`, `--python`). The answer is NUL-terminated KEY=VALUE records, the last `ok=1`, or
`error=ONE LINE` with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from multigpu.checkpoints import run_folders
from multigpu.config import DEFAULT_SAVE_ROOT, TrainConfig, canonical_flags, flag, parse_config
from multigpu.errors import UsageError
from multigpu.launch import replica_groups
from multigpu.launch.answers import (
    ADAPTERS,
    KUBERNETES,
    PROCESS_PER_DEVICE,
    RAY,
    SLURM,
    TRAINING,
    Devices,
    Engine,
    Settings,
    apply_gpu_choice,
    asks_about_adapters,
    check_save_dir,
    cores_here,
    default_cpu_processes,
    devices_of,
    engine_of,
    mesh_phrase,
    mode_of,
    nodes_of,
    plural,
    rendezvous_port,
    settle_mesh,
    settle_training,
    training_config,
)
from multigpu.launch.command import (
    command,
    device_phrase,
    effective_batch_text,
    quoted,
    torchrun_log,
    training_plan,
)
from multigpu.launch.kubernetes import check_k8s_job, k8s_devices, kubernetes
from multigpu.launch.ray_train import check_ray_job, ray_command, ray_devices, ray_where
from multigpu.launch.slurm import check_slurm_job, slurm, slurm_devices


def check(s: Settings) -> Iterator[tuple[str, str]]:
    """Validate what is known so far; give the normalised settings ("set:" records) and the questions' defaults."""
    mode = mode_of(s)
    apply_gpu_choice(s)
    engine = engine_of(s)
    config_of: Callable[[Settings], TrainConfig] = training_config
    if s.fault_tolerance or s.replica_groups or s.lighthouse_port or s.sync_every:  # replica groups
        devices, nodes = replica_groups.settle(s)
        config_of = replica_groups.group_config
        yield "ask-sync-every", "1" if replica_groups.sync_every_asked(s) else "0"
        if s.sync_every is not None:  # the answer, kept (checked with the group's flags below)
            yield "set:sync-every", s.sync_every
    else:
        nodes = nodes_of(s, mode)
        devices = job_devices_of(s, engine) if engine else devices_of(s, mode)
    config = config_of(s)
    if not (engine and nodes.count > 1):  # several nodes need a --save-dir they all share: said below
        yield from settle_save_dir(s, config)
        config = config_of(s)
    if engine is SLURM:
        check_slurm_job(s, nodes, config)
    elif engine is KUBERNETES:
        check_k8s_job(s, nodes, config)
    elif engine is RAY:
        check_ray_job(s, nodes, config)
    assert config.save_dir is not None  # settled above, or refused by the job's check
    check_save_dir(config.save_dir)
    settle_mesh(s, devices, nodes)
    if not engine and devices.mode in PROCESS_PER_DEVICE and (nodes.port is not None or nodes.count > 1):
        rendezvous_port(s, nodes)  # a port the user named must be free before anything is asked
    # The settings as the launcher should keep them: the mode by its name, the GPU answer as a count or ids.
    if mode is not None:
        yield "set:multi-gpu", mode
    if s.gpu_ids is not None and not engine:
        yield "set:gpu-ids", devices.ids or ""
    for name in ("gpus", *TRAINING, *ADAPTERS):
        if getattr(s, name) is not None:
            yield f"set:{flag(name)}", getattr(s, name)
    defaults = parse_config([])
    for name in TRAINING:
        yield f"default-{flag(name)}", str(getattr(defaults, name))
    yield "default-processes", str(default_cpu_processes())
    if asks_about_adapters(s, config):
        yield "ask-lora", "1"
        yield "default-lora-r", "0"
        yield "default-qlora", "no"
    yield "lr-base-batch", str(config.lr_base_batch)
    yield "effective-batch", effective_batch_text(config, devices, nodes)


def job_devices_of(s: Settings, engine: Engine) -> Devices:
    """The devices per node (per worker on Ray) of a cluster job, with its engine's own checks."""
    if engine is SLURM:
        return slurm_devices(s)
    if engine is KUBERNETES:
        return k8s_devices(s)
    return ray_devices(s)


def settle_save_dir(s: Settings, config: TrainConfig) -> Iterator[tuple[str, str]]:
    """The save-dir the command names (launch_command.sh goes there too).

    Without --save-dir: a new run folder under checkpoints/ (with --resume auto,
    the newest with the same settings), as the trainer would choose. A --save-dir holding another run's
    checkpoints, with neither --resume nor --overwrite, is reported
    ("save-dir-holds") with a fresh folder beside it, for the launcher to ask.
    """
    if s.save_dir is None:
        continued = (
            run_folders.run_to_continue(DEFAULT_SAVE_ROOT, config) if config.resume == "auto" else None
        )
        s.save_dir = continued[0] if continued else run_folders.next_run_dir(DEFAULT_SAVE_ROOT)
        yield "set:save-dir", s.save_dir
    elif config.resume is None and not config.overwrite and os.path.isdir(s.save_dir):
        held = run_folders.checkpoint_files(s.save_dir)
        if held:
            yield "save-dir-holds", ", ".join(os.path.basename(path) for path in held)
            yield "new-save-dir", run_folders.sibling_dir(s.save_dir)


def plan(s: Settings) -> Iterator[tuple[str, str]]:
    """The command and what it will do, for a run on this machine."""
    mode = mode_of(s)
    apply_gpu_choice(s)
    devices = devices_of(s, mode)
    nodes = nodes_of(s, mode)
    mesh = settle_mesh(s, devices, nodes)
    yield from settle_save_dir(s, training_config(s, devices))
    config = training_config(s, devices)
    assert config.save_dir is not None  # settled just above
    check_save_dir(config.save_dir)
    settle_training(s, config)
    port, note = rendezvous_port(s, nodes) if devices.mode in PROCESS_PER_DEVICE else (0, "")
    yield "plan", f"Plan: {device_phrase(devices, nodes)}{mesh_phrase(mesh, nodes, devices)}"
    if not devices.on_gpu and devices.count > cores_here():
        yield (
            "plan",
            f"  --oversubscribe: {plural(devices.count, 'process')} share {plural(cores_here(), 'CPU core')}",
        )
    yield from training_plan(s, config, devices, nodes)
    yield "plan", f"  checkpoints and launch_command.sh in {config.save_dir}/"
    if devices.mode in PROCESS_PER_DEVICE:
        yield "plan", f"  torchrun's own messages go to {torchrun_log(config.save_dir, nodes)}"
    if nodes.count > 1:
        yield (
            "plan",
            (
                "  checkpoints come from global rank 0, which c10d may place on any node: use a --save-dir "
                "all nodes share"
            ),
        )
    if note:
        yield "plan", f"  {note}"
    yield "save-dir", config.save_dir
    yield "command", quoted(command(s, devices, nodes, port, config))


def ray_plan(s: Settings) -> Iterator[tuple[str, str]]:
    """The command that trains on Ray (main_multi_gpu.py --ray-workers N) and what it will do."""
    s.ray = "1"
    devices = ray_devices(s)
    nodes = nodes_of(s, devices.mode)
    settle_mesh(s, devices, nodes)
    yield from settle_save_dir(s, training_config(s, devices))
    config = training_config(s, devices)
    check_ray_job(s, nodes, config)
    assert config.save_dir is not None  # settled just above
    settle_training(s, config)
    each = "1 GPU each" if devices.on_gpu else "1 CPU each, gloo"
    yield (
        "plan",
        f"Plan: Ray, {plural(devices.count, 'worker')} ({each}), {devices.mode.upper()}, on {ray_where(s)}",
    )
    yield from training_plan(s, config, devices, nodes)
    yield (
        "plan",
        f"  checkpoints and launch_command.sh in {config.save_dir}/, Ray's own files in {config.save_dir}/ray/",
    )
    restarts = s.ray_max_failures or "0"
    yield (
        "plan",
        f"  Ray restarts the workers after up to {restarts} failure(s), each from the newest checkpoint",
    )
    yield "save-dir", config.save_dir
    yield "command", quoted(ray_command(s, devices))


STEPS = {"check": check, "plan": plan, "slurm": slurm, "k8s": kubernetes, "ray": ray_plan}
# --fault-tolerance: the Lighthouse and the replica groups (multigpu/launch/replica_groups.py); not on Kubernetes
# or Ray (engine_of says so)
FAULT_TOLERANT_STEPS = {
    **STEPS,
    "plan": lambda s: replica_groups.plan(s, settle_save_dir),
    "slurm": replica_groups.slurm,
}


def parse(argv: Sequence[str]) -> tuple[str, Settings]:
    if "--" in argv:
        cut = list(argv).index("--")
        # --monitor as --monitor-metric: torchrun would refuse the command for its own --monitor-interval
        argv, trainer_args = list(argv[:cut]), canonical_flags(argv[cut + 1 :])
    else:
        argv, trainer_args = list(argv), []
    parser = argparse.ArgumentParser(prog="launch_rules", add_help=False, allow_abbrev=False)
    parser.add_argument("step", choices=sorted(STEPS))
    for f in dataclasses.fields(Settings):
        if f.name != "trainer_args":
            parser.add_argument(f"--{flag(f.name)}", dest=f.name)
    namespace = vars(parser.parse_args(argv))
    step = namespace.pop("step")
    values = {name: value for name, value in namespace.items() if value is not None}
    return step, Settings(**values, trainer_args=trainer_args)


def records(step: str, s: Settings) -> Iterator[str]:
    for key, value in (FAULT_TOLERANT_STEPS if s.fault_tolerance else STEPS)[step](s):
        yield f"{key}={value}"


def main(argv: Sequence[str] | None = None) -> int:
    step, s = parse(sys.argv[1:] if argv is None else argv)
    out = sys.stdout
    try:
        answer = list(records(step, s))
    except UsageError as error:
        out.write(f"error={error}\0")
        return error.exit_code
    out.write("".join(record + "\0" for record in answer) + "ok=1\0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
