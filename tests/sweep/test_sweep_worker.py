"""A run of several processes (--gpus-per-run 2): torchrun started by the worker, on the CPU with gloo."""

from __future__ import annotations

import pytest

from conftest import TINY_SWEEP_RUN, assert_ok, read_results, run_sweep
from multigpu.sweep.worker import _error_from_log


@pytest.mark.slow
def test_multi_process_runs_go_through_torchrun(tmp_path):
    # --monitor: torchrun's parser would take it for its own --monitor-interval unless the run's flags follow "--"
    result = run_sweep(
        [
            "--sweep-dir",
            str(tmp_path),
            "--gpus-per-run",
            "2",
            "--workers",
            "1",
            "--",
            *TINY_SWEEP_RUN,
            "--epochs",
            "1",
            "--dist-timeout",
            "60",
            "--monitor",
            "val_loss",
        ]
    )
    assert_ok(result)
    record = read_results(tmp_path)["seed-0"]
    # 64 samples / 2 ranks / 16 a batch = 2 optimizer steps; rank 0's summary came back through its file.
    assert (
        record["status"] == "ok"
        and record["metrics"]["epochs"] == 1
        and record["metrics"]["global_step"] == 2
    )
    assert record["metrics"]["val_acc"] >= 0 and record["metrics"]["samples_per_sec"] > 0
    log = (tmp_path / "seed-0/train.log").read_text()
    assert "mode ddp: 2 processes, backend gloo" in log
    assert not (tmp_path / "seed-0/run-summary.json").exists()


def test_a_failed_torchrun_run_is_named_by_its_own_error_line(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "model mlp\nerror: --model cnn needs image samples (--mode image)\nTraceback ...\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert (
        _error_from_log(str(log), 1)
        == "--model cnn needs image samples (--mode image) (torchrun exit status 1)"
    )
    log.write_text("Segmentation fault\n")
    assert _error_from_log(str(log), 1) == "see its log (torchrun exit status 1)"
