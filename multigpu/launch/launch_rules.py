"""The launcher's rule set: launch_multi_gpu.sh asks and runs, this module decides.

The launcher keeps the conversation (questions, re-asking, confirmation), finds
the GPUs and runs the command. Every check of a flag or an answer, and every
number it shows (effective batch, scaled LR, the command and its flags, the
SLURM script), comes from here, through the trainer's own parser, TrainConfig
and LR rule: the launcher cannot accept what the trainer refuses, nor show an
LR the trainer will not use. It imports no torch, so a call takes milliseconds.

    python -m multigpu.launch.launch_rules STEP [--SETTING VALUE ...] [-- TRAINER ARGS]

STEP is `check` (validate what is known so far; give the questions' defaults),
`plan` (the command, the plan lines and the rendezvous port) or `slurm` (also
the SLURM job script). SETTINGs are the launcher's flags, by their names
(`--epochs 3`), plus what the launcher found (`--found-gpus 0,1`, `--python`).
The answer is NUL-terminated KEY=VALUE records, the last `ok=1`, or
`error=ONE LINE` with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from multigpu.checkpoints import run_folders
from multigpu.config import DEFAULT_SAVE_ROOT, TrainConfig, flag, parse_config
from multigpu.errors import UsageError
from multigpu.launch import replica_groups
from multigpu.launch.answers import (
    PROCESS_PER_DEVICE,
    TRAINING,
    Settings,
    apply_gpu_choice,
    check_save_dir,
    cores_here,
    default_cpu_processes,
    devices_of,
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
    lr_text,
    quoted,
    torchrun_log,
)
from multigpu.launch.slurm import check_slurm_job, slurm, slurm_devices


def check(s: Settings) -> Iterator[tuple[str, str]]:
    """Validate what is known so far; give the normalised settings ("set:" records) and the questions' defaults."""
    mode = mode_of(s)
    apply_gpu_choice(s)
    config_of: Callable[[Settings], TrainConfig] = training_config
    if s.fault_tolerance or s.replica_groups or s.lighthouse_port:  # replica groups: the batch of all of them
        devices, nodes = replica_groups.settle(s)
        config_of = replica_groups.group_config
    else:
        nodes = nodes_of(s, mode)
        devices = slurm_devices(s) if s.slurm else devices_of(s, mode)
    config = config_of(s)
    if not (s.slurm and nodes.count > 1):  # several nodes need a --save-dir they all share: said below
        yield from settle_save_dir(s, config)
        config = config_of(s)
    if s.slurm:
        check_slurm_job(s, nodes, config)
    assert config.save_dir is not None  # settled above, or refused by check_slurm_job
    check_save_dir(config.save_dir)
    settle_mesh(s, devices, nodes)
    if not s.slurm and devices.mode in PROCESS_PER_DEVICE and (nodes.port is not None or nodes.count > 1):
        rendezvous_port(s, nodes)  # a port the user named must be free before anything is asked
    # The settings as the launcher should keep them: the mode by its name, the GPU answer as a count or ids.
    if mode is not None:
        yield "set:multi-gpu", mode
    if s.gpu_ids is not None and not s.slurm:
        yield "set:gpu-ids", devices.ids or ""
    for name in ("gpus", *TRAINING):
        if getattr(s, name) is not None:
            yield f"set:{flag(name)}", getattr(s, name)
    defaults = parse_config([])
    for name in TRAINING:
        yield f"default-{flag(name)}", str(getattr(defaults, name))
    yield "default-processes", str(default_cpu_processes())
    yield "lr-base-batch", str(config.lr_base_batch)
    yield "effective-batch", effective_batch_text(config, devices, nodes)


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
    yield "plan", f"  epochs {config.epochs}; effective batch {effective_batch_text(config, devices, nodes)}"
    yield "plan", f"  {lr_text(s, config, devices, nodes)}"
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


STEPS = {"check": check, "plan": plan, "slurm": slurm}
# --fault-tolerance: the Lighthouse and the replica groups (multigpu/launch/replica_groups.py)
FAULT_TOLERANT_STEPS = {
    "check": check,
    "plan": lambda s: replica_groups.plan(s, settle_save_dir),
    "slurm": replica_groups.slurm,
}


def parse(argv: Sequence[str]) -> tuple[str, Settings]:
    if "--" in argv:
        cut = list(argv).index("--")
        argv, trainer_args = list(argv[:cut]), list(argv[cut + 1 :])
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
