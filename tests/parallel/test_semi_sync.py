"""--semi-sync (multigpu/parallel/semi_sync.py, multigpu/engine/replicas.py): replica groups that train on
their own between syncs through torchft's DiLoCo and LocalSGD, proved with real processes (forked from the
preloaded server), a real SIGKILL and the session's torchft Lighthouse (tests/conftest.py's `lighthouse`)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import read_scalars, run_forked_workers
from multigpu.config import parse_config
from multigpu.parallel import semi_sync

# A tiny MLP (3 linear layers, the first two its blocks) on 256 synthetic samples: 16 steps an epoch with 2
# groups of batch 8.
TRAINER = [
    "--mode",
    "flatten",
    "--image-shape",
    "1,4,4",
    "--num-classes",
    "2",
    "--train-size",
    "256",
    "--val-size",
    "32",
    "--batch-size",
    "8",
    "--epochs",
    "1",
    "--no-progress",
    "--log-every",
    "4",
    "--data-on-device",
    "on",
    "--dist-timeout",
    "20",
]
# The exactness cases' inner optimizer: plain SGD, whose step is linear in the gradient.
PLAIN_SGD = ["--optimizer", "sgd", "--momentum", "0"]
HOLD_SECONDS = 120.0  # the longest a group waits at --hold-at for the test's word


# ---------------------------------------------------------------- one replica group's process
def wait_for_file(path: str) -> None:
    """Until `path` exists (another process's word), at most HOLD_SECONDS."""
    deadline = time.monotonic() + HOLD_SECONDS
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


class SyncRecorder:
    """A callback: each step's all-reduces and bytes between the groups and its quorum (JSON lines), the
    trainer's state at each step that ended with a sync and, in a group that healed at its start, right after
    the heal; at step `hold_at` it waits until `hold_file` exists."""

    def __init__(self, folder: str, hold_at: int, hold_file: str):
        rank = os.environ.get("RANK", "0")
        self.folder = Path(folder)
        self.hold_at = hold_at
        self.hold_file = hold_file
        self.rank = rank
        self.sent = (0, 0)

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.folder / f"rank{self.rank}.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")

    def _dump(self, trainer: Any, name: str) -> None:
        replicas = trainer.replicas
        state = {
            "step": trainer.progress.global_step,
            "manager_step": replicas.groups.committed_steps,
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "semi_sync": replicas.semi_sync.state_dict(),
        }
        torch.save(state, self.folder / f"{name}-rank{self.rank}.pt")

    def on_fit_start(self, trainer: Any) -> None:
        manager = trainer.replicas.groups.manager
        self.sent = (manager.allreduces, manager.sent_bytes)
        healed_at = trainer.replicas.healed_at
        if healed_at is not None:
            self._dump(trainer, "healed")
        self._write({"event": "start", "step": trainer.progress.global_step, "healed_at": healed_at})

    def on_step_end(self, trainer: Any) -> None:
        replicas = trainer.replicas
        step = trainer.progress.global_step
        manager = replicas.groups.manager
        allreduces = manager.allreduces - self.sent[0]
        sent = manager.sent_bytes - self.sent[1]
        self.sent = (manager.allreduces, manager.sent_bytes)
        synced = replicas.semi_sync.algorithm.local_step == 0
        self._write(
            {"step": step, "allreduces": allreduces, "bytes": sent, "live": replicas.groups.live_groups()}
        )
        if synced:
            self._dump(trainer, f"step{step}")
        if step == self.hold_at:
            wait_for_file(self.hold_file)


def group_main(argv: list[str]) -> int:
    """One replica group: `--record FOLDER [--hold-at STEP --hold-file PATH] [--wait-first-quorum PATH]
    [--mark-first-quorum PATH] -- TRAINER FLAGS`. Its first quorum (at its start) waits for the one file and
    then writes the other, so that groups can be made to start together, or a group held until another
    asks."""
    from multigpu.launch.runner import train_from_argv
    from multigpu.parallel.fault_tolerance import ReplicaGroups

    cut = argv.index("--")
    options = dict(zip(argv[:cut:2], argv[1:cut:2]))
    start_quorum = ReplicaGroups.start_quorum
    first = [True]

    def marked(groups: ReplicaGroups) -> None:
        if first.pop() if first else False:
            if "--wait-first-quorum" in options:
                wait_for_file(options["--wait-first-quorum"])
            if "--mark-first-quorum" in options:
                Path(options["--mark-first-quorum"]).touch()
        start_quorum(groups)

    ReplicaGroups.start_quorum = marked  # type: ignore[method-assign,assignment]  # in this test process only
    recorder = SyncRecorder(
        options["--record"], int(options.get("--hold-at", -1)), options.get("--hold-file", "")
    )
    return train_from_argv(argv[cut + 1 :], callbacks=[recorder])


# ---------------------------------------------------------------- the test's side
class Group:
    """Replica group `replica_id` of a run, started in a thread of the test (forked workers: one, or `nproc`
    under torchrun's variables), recording into `folder`."""

    def __init__(
        self,
        folder: Path,
        replica_id: int,
        trainer: Sequence[str],
        nproc: int | None = None,
        env: dict[str, str] | None = None,
        hold: tuple[int, Path] | None = None,
        wait_first_quorum: Path | None = None,
        mark_first_quorum: Path | None = None,
    ):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        held = ["--hold-at", str(hold[0]), "--hold-file", str(hold[1])] if hold else []
        held += ["--wait-first-quorum", str(wait_first_quorum)] if wait_first_quorum else []
        held += ["--mark-first-quorum", str(mark_first_quorum)] if mark_first_quorum else []
        argv = ["--record", str(folder), *held, "--", *trainer, "--ft-replica-id", str(replica_id)]
        self.done: list[Any] = []
        self.thread = threading.Thread(
            target=lambda: self.done.extend(
                run_forked_workers(group_main, argv, nproc, folder, env, script=Path(__file__))
            )
        )
        self.thread.start()

    def wait(self) -> list[Any]:
        self.thread.join()
        return self.done

    def output(self, rank: int = 0) -> str:
        """What the group's process of `rank` has written so far."""
        return "".join(path.read_text() for path in sorted(self.folder.glob(f"workers-*/rank{rank}.out")))

    def records(self, rank: int = 0) -> list[dict[str, Any]]:
        path = self.folder / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def dump(self, name: str, rank: int = 0) -> dict[str, Any]:
        return torch.load(self.folder / f"{name}-rank{rank}.pt", weights_only=True)


def run_flags(lighthouse: str, save_dir: Path, *extra: str) -> list[str]:
    return [
        *TRAINER,
        "--fault-tolerance",
        "--ft-replica-groups",
        "2",
        "--ft-lighthouse",
        lighthouse,
        "--save-dir",
        str(save_dir),
        *extra,
    ]


def both_groups(folder: Path, flags: list[str], nproc: int | None = None) -> list[Group]:
    groups = [Group(folder / f"group{replica}", replica, flags, nproc) for replica in range(2)]
    for group in groups:
        assert all(done.returncode == 0 for done in group.wait()), [d.stderr[-3000:] for d in group.done]
    return groups


def max_difference(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> float:
    return max((one[name] - two[name]).abs().max().item() for name in one)


def equal_tensors(one: Any, two: Any) -> bool:
    """Whether two states hold torch.equal tensors and equal everything else, all the way down."""
    if isinstance(one, dict):
        return one.keys() == two.keys() and all(equal_tensors(one[key], two[key]) for key in one)
    if isinstance(one, (list, tuple)):
        return len(one) == len(two) and all(equal_tensors(a, b) for a, b in zip(one, two))
    if isinstance(one, torch.Tensor):
        return torch.equal(one, two)
    return one == two


# ---------------------------------------------------------------- exactness
def test_local_sgd_and_diloco_syncing_every_step_with_plain_sgd_give_ddps_weights(lighthouse, tmp_path):
    """--semi-sync local-sgd --sync-every 1 and diloco --sync-every 1 --outer-lr 1 --outer-momentum 0, inner
    SGD: the same weights as DDP over 2 processes on the same data (max abs difference at most 1e-6), and the
    bytes between groups per step are DDP's."""
    import main_multi_gpu

    ddp_dir = tmp_path / "ddp"
    ddp = run_forked_workers(
        main_multi_gpu.main,
        [*TRAINER, *PLAIN_SGD, "--multi-gpu", "ddp", "--save-dir", str(ddp_dir)],
        2,
        tmp_path,
    )
    assert [done.returncode for done in ddp] == [0, 0], ddp[0].stderr
    ddp_weights = torch.load(ddp_dir / "last.pt", weights_only=True)["model"]
    cases = {
        "local-sgd": ["--semi-sync", "local-sgd", "--sync-every", "1"],
        "diloco": ["--semi-sync", "diloco", "--sync-every", "1", "--outer-lr", "1", "--outer-momentum", "0"],
    }
    for name, semi in cases.items():
        save_dir = tmp_path / name
        flags = run_flags(lighthouse, save_dir, *PLAIN_SGD, *semi, "--ft-min-replicas", "2")
        group0 = both_groups(tmp_path / f"{name}-groups", flags)[0]
        weights = torch.load(save_dir / "last.pt", weights_only=True)["model"]
        assert max_difference(weights, ddp_weights) <= 1e-6, name
        model_bytes = sum(tensor.numel() * 4 for tensor in ddp_weights.values())
        between = semi_sync.between_groups_text(model_bytes, model_bytes)
        output = group0.output()
        assert output.count(between) == 2, output  # the plan line and the done line


# ---------------------------------------------------------------- a lost group, and its return
@pytest.mark.slow
def test_a_killed_group_heals_within_the_window_and_the_groups_are_identical_after_every_sync(
    lighthouse, tmp_path
):
    """Streaming DiLoCo, H=4 in 2 fragments (one synced every 2 steps in turn). Group 1 is SIGKILLed after
    step 6; group 0 syncs on alone. Started again, group 1 heals from group 0 in the sync group 0 is in:
    model, inner and outer optimizer, the place in the window and the step, all equal; the two end that sync
    with the same weights, and after every sync both groups hold bit-identical weights. One all-reduce between
    the groups per fragment sync, at the staggered steps, carrying that fragment's bytes; nothing between
    syncs."""
    flags = run_flags(
        lighthouse, tmp_path / "run", "--semi-sync", "diloco", "--sync-every", "4", "--fragments", "2"
    )
    starting = tmp_path / "group 1 starts"
    asking = tmp_path / "group 1 asks again"
    # Group 0 asks for its first quorum once group 1 does, and waits after step 10 until group 1, started
    # again, asks for its first quorum. Group 1 never trains alone (--ft-min-replicas 2): it starts with group
    # 0 or, if a busy machine delayed the heartbeats the Lighthouse judges by, heals from group 0 at its first
    # sync.
    run0 = [*flags, "--max-steps", "16"]
    group0 = Group(tmp_path / "group0", 0, run0, hold=(10, asking), wait_first_quorum=starting)
    run1 = [*run0, "--ft-min-replicas", "2"]  # the same settings: a group with others is refused at join
    kill = {"MULTIGPU_FAULT_INJECT": "0:6"}
    killed = Group(tmp_path / "group1", 1, run1, env=kill, mark_first_quorum=starting)
    assert [done.returncode for done in killed.wait()] == [-9]
    deadline = time.monotonic() + HOLD_SECONDS
    while not any(record.get("live") == [0] for record in group0.records()) and time.monotonic() < deadline:
        time.sleep(0.05)  # until group 0 has trained alone (its sync of step 8 left group 1 out)
    group1 = Group(tmp_path / "group1-again", 1, run1, mark_first_quorum=asking)
    for group in (group0, group1):
        assert [done.returncode for done in group.wait()] == [0], group.done[0].stderr[-3000:]

    start = group1.records()[0]
    rejoined = start["step"]  # the sync group 1 joined: its first step is the one after
    assert start["healed_at"] == rejoined + 1 and rejoined in (10, 12), start
    peer = group0.dump(f"step{rejoined}")
    assert equal_tensors(
        peer, group1.dump("healed")
    )  # model, inner and outer optimizer, window, step, Manager step
    assert peer["semi_sync"]["local_step"] == 0 and peer["step"] == rejoined
    # After every sync both groups trained through, the fragment synced is bit-identical in both, and the
    # other one (its own steps since its sync) is not: fragment 0 (the first block) at steps 2, 6, ..., 1 at
    # 4, 8, ...
    synced_steps = [step for step in range(2, 17, 2) if (killed.folder / f"step{step}-rank0.pt").exists()]
    synced_steps += [step for step in range(rejoined + 2, 17, 2)]
    assert 6 in synced_steps and 16 in synced_steps, synced_steps
    for step in synced_steps:
        group1_dump = killed.dump(f"step{step}") if step <= 6 else group1.dump(f"step{step}")
        one = group0.dump(f"step{step}")["model"]
        two = group1_dump["model"]
        synced = {name for name in one if name.startswith("net.1.")} if step % 4 == 2 else None
        synced = synced or {name for name in one if not name.startswith("net.1.")}
        assert all(torch.equal(one[name], two[name]) for name in synced), step
        assert not all(torch.equal(one[name], two[name]) for name in one.keys() - synced), step
    # One all-reduce per fragment sync (every 2 steps, fragments 0 and 1 in turn), none between; alone, none.
    records = group0.records()[1:]
    sizes = [next(r["bytes"] for r in records if r["step"] % 4 == turn and r["bytes"]) for turn in (2, 0)]
    model_bytes = sum(tensor.numel() * 4 for tensor in peer["model"].values())
    assert sizes[0] + sizes[1] == model_bytes, sizes
    for record in records:
        step = record["step"]
        together = record["live"] == [0, 1]
        expected = (1, sizes[(step // 2 - 1) % 2]) if step % 2 == 0 and together else (0, 0)
        assert (record["allreduces"], record["bytes"]) == expected, record
    output0 = group0.output()
    assert "replica group 1 is not in the quorum of step 8: training on with 1 of 2 groups" in output0
    assert (
        f"replica group 1 lost at step 8: its 1/2 of the data skipped until it rejoined at step {rejoined}"
        in output0
    )
    assert f"replica group 1 joined at step {rejoined + 1}: healed from replica group 0" in group1.output()


@pytest.mark.slow
def test_groups_of_two_processes_hold_identical_weights_rank_by_rank_after_every_sync(lighthouse, tmp_path):
    """2 groups x 2 processes (ddp within each): after every sync, rank r of each group holds the same
    weights; TensorBoard's perf/bytes_between_groups_per_step is the model's bytes over H at each --log-every
    step."""
    flags = run_flags(
        lighthouse, tmp_path / "run", "--semi-sync", "diloco", "--sync-every", "2", "--max-steps", "8"
    )
    groups = both_groups(tmp_path, [*flags, "--multi-gpu", "ddp", "--ft-min-replicas", "2"], nproc=2)
    for rank in range(2):
        for step in (2, 4, 6, 8):
            dumps = [group.dump(f"step{step}", rank)["model"] for group in groups]
            assert equal_tensors(dumps[0], dumps[1]), (rank, step)
        for group in groups:  # nothing between the groups between syncs, one all-reduce at each
            sent = [(record["step"], record["allreduces"]) for record in group.records(rank)[1:]]
            assert sent == [(step, int(step % 2 == 0)) for step in range(1, 9)], sent
    model_bytes = sum(tensor.numel() * 4 for tensor in groups[0].dump("step2")["model"].values())
    logged = read_scalars(tmp_path / "run" / "tb")["perf/bytes_between_groups_per_step"]
    assert logged == [(4, model_bytes / 2), (8, model_bytes / 2)], logged


@pytest.mark.slow
def test_both_groups_killed_resume_exactly_where_an_uninterrupted_run_ends(lighthouse, tmp_path):
    """DiLoCo with its outer momentum, inner SGD, a checkpoint every 4 steps; both groups SIGKILLed after step
    6 and started again with the same command: they resume from step 4 (outer optimizer and window from the
    checkpoint) and end with exactly the weights of the run that was never interrupted (max abs difference
    0)."""
    semi = ["--semi-sync", "diloco", "--sync-every", "2", "--max-steps", "10", "--save-every-steps", "4"]
    weights = {}
    for name in ("uninterrupted", "interrupted"):
        flags = run_flags(lighthouse, tmp_path / name, *PLAIN_SGD, *semi, "--ft-min-replicas", "2")
        if name == "interrupted":
            kill = {"MULTIGPU_FAULT_INJECT": "0:6"}
            dying = [
                Group(tmp_path / f"{name}-dying{replica}", replica, flags, env=kill) for replica in range(2)
            ]
            assert [group.wait()[0].returncode for group in dying] == [-9, -9]
            assert not (tmp_path / name / "last.pt").exists()
        group0 = both_groups(tmp_path / name, flags)[0]
        weights[name] = torch.load(tmp_path / name / "last.pt", weights_only=True)["model"]
    assert f"resumed from {tmp_path / 'interrupted' / 'step-000000004.pt'}" in group0.output()
    assert max_difference(weights["interrupted"], weights["uninterrupted"]) == 0


# ---------------------------------------------------------------- bad input where the model and device are known
# (the flags' own: tests/test_bad_input.py), and the plan's figures
def test_more_fragments_than_blocks_and_quantizing_on_the_cpu_are_one_line_and_exit_2(lighthouse, tmp_path):
    """Refused where the model and the device are known: at the trainer's start, one line each, exit 2."""
    import main_multi_gpu

    base = run_flags(
        lighthouse, tmp_path / "run", "--semi-sync", "diloco", "--sync-every", "4", "--ft-replica-id", "0"
    )
    cases = {
        "fragments": (
            ["--fragments", "4"],
            "error: --fragments 4: this model has 2 blocks to cut it at (Linear); give at most 2",
        ),
        "quantize": (
            ["--quantize-outer"],
            "error: --quantize-outer needs torchft's quantized all-reduce, which runs on CUDA GPUs",
        ),
    }
    for name, (extra, line) in cases.items():
        done = run_forked_workers(main_multi_gpu.main, [*base, *extra], None, tmp_path / name)[0]
        errors = [text for text in done.stderr.splitlines() if text.startswith("error:")]
        assert done.returncode == 2 and errors == [errors[0]] and errors[0].startswith(line), done.stderr


def test_the_bytes_are_said_in_powers_of_1000_and_planned_from_the_model():
    assert [semi_sync.byte_text(count) for count in (512, 1_200_000, 9_600_000, 340_000_000, 2.5e9)] == [
        "512 B",
        "1.2 MB",
        "9.6 MB",
        "340 MB",
        "2.5 GB",
    ]
    model = torch.nn.Sequential(
        torch.nn.Linear(1000, 600), torch.nn.Linear(600, 1000)
    )  # 1,201,600 parameters
    config = parse_config(
        [
            "--fault-tolerance",
            "--ft-replica-groups",
            "2",
            "--ft-replica-id",
            "0",
            "--save-dir",
            "r",
            "--semi-sync",
            "diloco",
            "--sync-every",
            "8",
        ]
    )
    planned = semi_sync.planned_bytes(config, model, 2)
    assert semi_sync.between_groups_text(planned, semi_sync.parameter_bytes(model)) == (
        "between groups: 601 kB per step (DDP: 4.8 MB)"
    )
