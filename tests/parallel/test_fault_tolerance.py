"""--fault-tolerance (multigpu/parallel/fault_tolerance.py, multigpu/engine/replicas.py): replica groups that
outlive each other's loss, proved with real processes, a real SIGKILL and a real torchft Lighthouse (one, shared:
tests/conftest.py's `lighthouse`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import (
    LIGHTHOUSE_HEARTBEAT_MS,
    PYTHON,
    REPO,
    RUN_TIMEOUT,
    cli_command,
    cli_env,
    config_for,
    free_port,
    run_forked_workers,
)
from multigpu.data.device_data import DeviceData
from multigpu.data.feed import batch_sizes, training_data
from multigpu.engine.replicas import Ledger
from multigpu.errors import UsageError
from multigpu.parallel.distributed import Runtime

DIST_TIMEOUT = 10.0  # seconds: a step whose all-reduce hangs waits this long before torchft gives up on it


@pytest.mark.slow
@pytest.mark.parametrize(
    "group_size, group_mode",
    [(1, "none"), (2, "ddp"), (2, "fsdp")],
    ids=["1-process-groups", "2-process-ddp-groups", "2-process-fsdp-groups"],
)
def test_a_killed_group_is_left_out_then_heals_from_a_live_peer_and_the_other_one_can_die_next(
    lighthouse, tmp_path, group_size, group_mode
):
    """Group 1 SIGKILLed after step 6 (its last process: a torchrun job then ends the group's others): group 0
    commits the next step alone within the stall bound; group 1 started again heals from group 0 (no
    checkpoint read) and at its first commit every parameter and optimizer tensor is torch.equal in both
    groups, rank by rank (fsdp: each rank's shards), step counters too; then group 0 is killed and group 1
    trains on alone, leads and writes the run's checkpoints. The run's lines say it, once each."""
    raw = tmp_path / "raw.json"
    done = subprocess.run(
        [
            PYTHON,
            str(REPO / "benchmarks" / "fault_tolerance.py"),
            "--tiny",
            "--second-kill",
            "--lighthouse",
            lighthouse,
            "--heartbeat-ms",
            str(LIGHTHOUSE_HEARTBEAT_MS),
            "--kill-at",
            "6",
            "--save-every",
            "4",
            "--step-seconds",
            "0.02",
            "--dist-timeout",
            str(DIST_TIMEOUT),
            "--group-size",
            str(group_size),
            *(["--group-mode", group_mode] if group_size > 1 else []),
            "--json",
            str(raw),
            "--folder",
            str(tmp_path),
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ft = json.loads(raw.read_text())["fault_tolerance"]
    assert (ft["group_size"], ft["group_mode"]) == (group_size, group_mode)
    group0, group1 = ft["group_output"]
    killed = ft["kill_after_step"]
    assert ft["next_commit_live_groups"] == [0]
    assert ft["kill_to_next_commit_seconds"] < ft["stall_bound_seconds"], ft
    assert len(ft["uncommitted_steps"]) <= 1  # at most the step the kill broke
    assert ft["healed_at"] == ft["rejoined_step"] and ft["rejoined_live_groups"] == [0, 1]
    # 6 weights, 2 moments + step, on each rank
    assert ft["at_rejoin"]["all_equal"] and ft["at_rejoin"]["tensors_compared"] == 24 * group_size
    assert len(ft["at_rejoin"]["steps"]) == 1 and len(ft["at_rejoin"]["committed_steps"]) == 1
    # Lost from the step after the kill's, or the one after that when the process was already in it (in its
    # quorum: that step's all-reduce broke, or group 0 committed it alone).
    lost = re.findall(
        r"replica group 1 lost at step (\d+): its 1/2 of the data skipped until it rejoined", group0
    )
    assert len(lost) == 1 and int(lost[0]) in (killed + 1, killed + 2), group0
    assert group1.count(f"replica group 1 joined at step {ft['healed_at']}: healed from replica group 0") == 1
    second = ft["second_kill"]
    assert second["next_commit_live_groups"] == [1] and second["leads_after"]
    assert torch.load(second["checkpoint"], weights_only=True)["global_step"] > second["kill_after_step"]
    assert "replica group 0 is not in the quorum of step" in group1
    assert "stopped by SIGTERM at step" in group1  # group 1 stopped cleanly at the end and wrote last.pt
    # Group 0 killed; group 1 stopped by SIGTERM. A torchrun job exits 1 for both: its process killed, or it
    # was told to stop (torchrun's SignalException); group 0's may still be ending its other process when the
    # driver stops the run, and then ends by that SIGTERM itself.
    if group_size == 1:
        assert ft["exit_statuses"] == [-9, 0]
    else:
        assert ft["exit_statuses"][0] in (1, -signal.SIGTERM) and ft["exit_statuses"][1] == 1, ft[
            "exit_statuses"
        ]


def group_0_without_a_lighthouse(save_dir: Path) -> list[str]:
    """The flags of replica group 0 of 2, its Lighthouse at a free port, where none answers."""
    return [
        "--fault-tolerance",
        "--ft-replica-groups",
        "2",
        "--ft-replica-id",
        "0",
        "--ft-lighthouse",
        f"http://127.0.0.1:{free_port()}",
        "--save-dir",
        str(save_dir),
        "--mode",
        "flatten",
    ]


def test_fault_tolerance_without_torchft_or_its_lighthouse_is_one_line_and_exit_2(tmp_path):
    """No torchft installed, or no Lighthouse at the address: one line each, exit 2, nothing trained."""
    args = [*group_0_without_a_lighthouse(tmp_path / "run"), "--dist-timeout", "2"]
    without_torchft = [
        PYTHON,
        "-c",
        "import sys; sys.modules['torchft'] = None; import main_multi_gpu; sys.exit(main_multi_gpu.main(sys.argv[1:]))",
        *args,
    ]
    runs = [
        subprocess.Popen(
            command, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command in (without_torchft, cli_command(args))
    ]
    (missing_out, missing), (unreachable_out, unreachable) = (run.communicate(timeout=120) for run in runs)
    assert [run.returncode for run in runs] == [2, 2], (missing, unreachable)
    assert missing.strip().splitlines() == [
        "error: --fault-tolerance needs torchft: pip install 'multigpu[ft]' (or pip install torchft), or run without "
        "--fault-tolerance"
    ]
    lines = [line for line in unreachable.strip().splitlines() if "Warning" not in line]
    assert len(lines) == 1 and "no torchft Lighthouse answers at http://127.0.0.1:" in lines[0], unreachable
    assert not (tmp_path / "run" / "last.pt").exists() and "step" not in missing_out + unreachable_out


def test_a_group_with_a_hybrid_fsdp_mesh_of_its_own_is_refused_in_one_line(tmp_path):
    """The replica groups are the replicas: a group of 2 processes whose fsdp mesh replicates again is refused
    in one line (exit 2 from each process), before any Lighthouse is asked or anything written."""
    hybrid = ["--multi-gpu", "fsdp", "--dp-replicate", "2", "--dp-shard", "1"]
    args = [*hybrid, *group_0_without_a_lighthouse(tmp_path / "run")]
    refused = subprocess.run(
        cli_command(args, nproc=2), cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    line = (
        "error: --fault-tolerance with fsdp's hybrid mesh (replicate 2 x shard 1): the replica groups are "
        "the model's replicas"
    )
    assert refused.returncode != 0 and refused.stderr.count(line) == 1, refused.stderr
    assert "exitcode  : 2" in refused.stderr  # each process's own status: bad input
    assert not any((tmp_path / "run").glob("*.pt"))


def test_each_process_reads_its_own_share_over_every_group_and_without_groups_its_rank_share(tmp_path):
    """The sampler is sharded over groups x ranks (group 1's rank 1 of 2 is data rank 3 of 4), and without
    --fault-tolerance a rank's share is its rank's, as it always was; the effective batch counts every group."""
    data = TensorDataset(torch.randn(64, 16), torch.randint(4, (64,)))
    config = config_for(tmp_path, 2, data_on_device="off")
    plain = Runtime("ddp", torch.device("cpu"), rank=1, local_rank=1, world_size=2)
    grouped = Runtime("ddp", torch.device("cpu"), 1, 1, 2, replica_groups=2, replica_id=1, leads=False)
    shares = {}
    for name, runtime in (("plain", plain), ("grouped", grouped)):
        on_device = DeviceData(data, config, runtime.device, runtime.world_size, None, False)
        sampler = training_data(data, config, runtime, 8, None, on_device).sampler
        shares[name] = (sampler.rank, sampler.num_replicas, batch_sizes(config, runtime).effective)
    assert shares == {"plain": (1, 2, 16), "grouped": (3, 4, 32)}
    assert (plain.is_main, grouped.is_main, plain.replicas) == (False, False, None)


def test_the_ledger_says_each_absence_once_and_counts_what_it_cost():
    ledger = Ledger(groups=3)
    assert ledger.observe([0, 1, 2], 1, 8) == []
    said = ledger.observe([0, 2], 2, 8) + ledger.observe([0, 2], 3, 8)
    assert said == ["replica group 1 is not in the quorum of step 2: training on with 2 of 3 groups"]
    assert ledger.observe([0, 1, 2], 4, 8) == [
        "replica group 1 lost at step 2: its 1/3 of the data skipped until it rejoined at step 4 (2 steps)"
    ]
    ledger.observe([1, 2], 5, 8)
    assert ledger.uncommitted(5, 16, RuntimeError("Connection closed by peer\ntrace")) == (
        "step 5 not committed (Connection closed by peer): the weights stay as they were, its data is skipped"
    )
    assert ledger.at_end(5)[0] == (
        "replica group 0 lost at step 5: its 1/3 of the data skipped until the run's end at step 5 (1 steps)"
    )
    assert (
        ledger.skipped_group_steps,
        ledger.skipped_samples,
        ledger.uncommitted_samples,
        ledger.rejoins,
    ) == (
        3,
        24,
        16,
        1,
    )


def test_the_lighthouse_address_comes_from_the_flag_or_the_environment(monkeypatch):
    from multigpu.config import TrainConfig
    from multigpu.parallel.fault_tolerance import LIGHTHOUSE_ENV, lighthouse_address

    config = TrainConfig(fault_tolerance=True, ft_replica_groups=2, ft_replica_id=1, save_dir="run")
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(UsageError, match="needs torchft's Lighthouse: give its address with --ft-lighthouse"):
        lighthouse_address(config)
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://node0:29510")
    assert lighthouse_address(config) == "http://node0:29510"
    config.ft_lighthouse = "http://other:1"
    assert lighthouse_address(config) == "http://other:1"


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--ft-replica-groups", "2"], "--ft-replica-groups is for --fault-tolerance"),
        (["--fault-tolerance"], "--fault-tolerance needs --ft-replica-groups N"),
        (["--fault-tolerance", "--ft-replica-groups", "2", "--ft-replica-id", "2"], "must be below"),
        (["--fault-tolerance", "--ft-replica-groups", "2", "--ft-replica-id", "0"], "needs --save-dir"),
        (
            [
                "--fault-tolerance",
                "--ft-replica-groups",
                "2",
                "--ft-replica-id",
                "0",
                "--save-dir",
                "r",
                "--autotune",
            ],
            "--autotune tries settings in each group",
        ),
    ],
)
def test_fault_tolerance_settings_are_checked_with_the_config(flags, refusal):
    from multigpu.config import parse_config

    with pytest.raises(UsageError, match=refusal):
        parse_config(flags)


@pytest.mark.slow
def test_a_group_started_with_other_settings_than_its_peers_is_refused_in_one_line_as_it_joins(
    lighthouse, tmp_path
):
    """Two groups started together, one with --lr 0.001, the other with --lr 0.01: the one that heals from the
    other (at the first quorum, torchft's first sync, or later, as it joins the other's run) would train another
    run's steps; it is refused in one line naming the setting, exit 2, having trained nothing, and the other
    trains its own run on until its SIGTERM. Neither run can end before the other has joined, so the test waits
    for the events themselves (a group's end, the other's next quorum without it), never for the clock."""
    import main_multi_gpu

    save_dir = tmp_path / "run"
    rates = {0: "0.001", 1: "0.01"}

    def group(replica_id: int) -> list[str]:
        return [
            *("--fault-tolerance", "--ft-replica-groups", "2", "--ft-replica-id", str(replica_id)),
            *("--ft-lighthouse", lighthouse, "--save-dir", str(save_dir), "--lr", rates[replica_id]),
            *("--lr-scaling", "none", "--model", "mlp", "--mode", "flatten", "--image-shape", "1,4,4"),
            *("--train-size", "2000", "--val-size", "32", "--batch-size", "4", "--epochs", "1000"),
            *("--no-progress", "--dist-timeout", str(DIST_TIMEOUT)),
        ]

    ended: dict[int, subprocess.CompletedProcess] = {}
    workers: dict[int, Any] = {}
    one_ended = threading.Event()

    def start(replica_id: int) -> None:
        def keep(started: list[Any]) -> None:
            workers[replica_id] = started[0]  # the one process of the group, to signal later

        folder = tmp_path / f"group{replica_id}"
        (ended[replica_id],) = run_forked_workers(
            main_multi_gpu.main, group(replica_id), None, folder, started=keep
        )
        one_ended.set()

    starts = [threading.Thread(target=start, args=(replica_id,)) for replica_id in rates]
    for thread in starts:
        thread.start()
    assert one_ended.wait(RUN_TIMEOUT)
    (refused,) = ended
    trained = 1 - refused
    assert ended[refused].returncode == 2, ended[refused].stdout[-3000:] + ended[refused].stderr
    # A stop signal inside a quorum that waits for the refused group's heartbeat to lapse would end the process
    # without a checkpoint: signal the trained group once it has trained a step without its peer.
    wait_for_line(
        tmp_path / f"group{trained}", rf"replica group {refused} is not in the quorum of step ([2-9]|\d\d+):"
    )
    os.kill(workers[trained].pid, signal.SIGTERM)
    for thread in starts:
        thread.join()
    lines = [line for line in ended[refused].stderr.splitlines() if "Warning" not in line]
    assert len(lines) == 1 and "step" not in ended[refused].stdout, (
        ended[refused].stdout + ended[refused].stderr
    )
    assert lines[0] == (
        f"error: replica group {refused} was started with other settings than replica group {trained}, which it "
        f"would heal from (lr: {rates[trained]} -> {rates[refused]}: group {trained}'s -> this group's): start "
        f"every group with the same command"
    )
    assert ended[trained].returncode == 0, ended[trained].stdout[-3000:] + ended[trained].stderr
    assert "stopped by SIGTERM at step" in ended[trained].stdout
    assert torch.load(save_dir / "last.pt", weights_only=True)["config"]["lr"] == float(rates[trained])


def wait_for_line(folder: Path, pattern: str, timeout: float = RUN_TIMEOUT) -> None:
    """Until a line matching `pattern` is in the output of the forked worker whose files are under `folder`
    (run_forked_workers' rank0.out): the event a test waits for, read as the worker prints it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for output in folder.glob("workers-*/rank0.out"):
            if re.search(pattern, output.read_text(), re.MULTILINE):
                return
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} under {folder} within {timeout:g} s")
