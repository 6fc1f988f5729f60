"""The plan lines a run prints before its first step, their warnings, and the done line
(multigpu/monitoring/plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import main_multi_gpu
from conftest import blobs, config_for, tiny_model
from multigpu.loop.optim import lr_factor
from multigpu.monitoring.meters import Interval
from multigpu.monitoring.plan import chance_accuracy, done_line, learning_warning, plan_lines, trained
from multigpu.monitoring.reporting import Reporter
from train_multi_gpu import MultiGPUTrainer


def test_the_plan_gives_the_layout_the_batch_arithmetic_and_the_schedule(tmp_path: Path):
    config = config_for(tmp_path, 1, grad_accum_steps=2, epochs=3, warmup_epochs=1.0)
    with MultiGPUTrainer(
        tiny_model(), blobs(64, 0), None, config
    ) as trainer:  # 64 / (8 x 2): 4 steps per epoch
        layout, batch, optimizer, data = plan_lines(trainer.plan_facts())
    assert layout == "mode none: one device, cpu"
    assert batch == "batch 8 per device x 1 devices x 2 accumulation = 16 effective (one device)"
    assert optimizer.startswith("optimizer AdamW, lr 0.01")
    assert optimizer.endswith(
        "; schedule cosine, warm-up 4 steps (first step lr 0.0025, peak 0.01), 4 steps/epoch, "
        "12 steps; amp off"
    )
    assert data.startswith("data: the training set on the device (64 samples")  # data/device_data.py


def test_lr_0_is_a_frozen_run_whose_plan_says_the_weights_will_not_change(tmp_path: Path, capsys):
    """--lr 0 was refused, though torch takes it: a run to measure throughput, or to evaluate."""
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, lr=0.0, epochs=1))
    before = {key: value.clone() for key, value in trainer.model.state_dict().items()}
    trainer.fit()
    assert (
        "--lr 0: the weights will not change (every step applies LR 0: a frozen run, to measure throughput or to "
        "evaluate); buffers a forward updates, such as BatchNorm's running statistics, still do"
    ) in capsys.readouterr().out.splitlines()
    assert all(torch.equal(before[key], value) for key, value in trainer.model.state_dict().items())


def test_the_plan_gives_a_users_schedulers_first_and_peak_lr(tmp_path: Path):
    """The optimizer's LR is only OneCycleLR's peak: the first step applies max_lr / 25."""
    one_cycle = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1, epochs=2),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        scheduler=lambda optimizer, total_steps: torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-3, total_steps=total_steps, pct_start=0.25
        ),
    )
    with one_cycle:
        optimizer = plan_lines(one_cycle.plan_facts())[2]
    assert (
        "; scheduler OneCycleLR per step (first step lr 4e-05, peak 0.001), 8 steps/epoch, 16 steps;"
        in optimizer
    )


def test_a_warm_up_longer_than_the_run_is_a_warning_with_the_lr_it_peaks_at(tmp_path: Path):
    config = config_for(tmp_path, 1, epochs=1, warmup_epochs=2.0)  # 8 steps of warm-up in a run of 8 steps
    with MultiGPUTrainer(tiny_model(), blobs(32, 0), None, config) as trainer:
        warnings = [line for line in plan_lines(trainer.plan_facts()) if line.startswith("warning:")]
    peak = 0.01 * lr_factor(3, config, 4)  # the last of the run's 4 steps
    assert warnings == [
        f"warning: the warm-up (8 steps) is longer than the run (4 steps): the LR peaks at "
        f"{peak:g}, never at 0.01"
    ]


def test_linear_lr_scaling_of_an_adam_family_optimizer_is_a_warning_pointing_at_sqrt(tmp_path: Path):
    config = config_for(tmp_path, 1, lr=1e-3, lr_scaling="linear", lr_base_batch=2, epochs=1)  # 8/2: x4 or x2
    with MultiGPUTrainer(tiny_model(), blobs(32, 0), None, config) as adamw:
        warnings = [line for line in plan_lines(adamw.plan_facts()) if line.startswith("warning:")]
    assert warnings == [
        "warning: --lr-scaling linear is the rule for SGD; AdamW usually scales by sqrt "
        "(lr 0.004 here, 0.002 with --lr-scaling sqrt)"
    ]
    with MultiGPUTrainer(
        tiny_model(),
        blobs(32, 0),
        None,
        config_for(tmp_path / "sgd", 1, lr_scaling="linear", optimizer="sgd", epochs=1),
    ) as sgd:
        assert not [line for line in plan_lines(sgd.plan_facts()) if line.startswith("warning:")]


def test_fewer_samples_than_one_step_is_a_warning(tmp_path: Path):
    config = config_for(tmp_path, 1, batch_size=16, grad_accum_steps=2, epochs=1)
    with MultiGPUTrainer(tiny_model(), blobs(20, 0), None, config) as trainer:
        warnings = [line for line in plan_lines(trainer.plan_facts()) if line.startswith("warning:")]
    assert warnings == [
        "warning: each process gets 20 training samples per epoch, fewer than one step's 16 x 2: "
        "every step uses 20 samples per process, not the effective batch above"
    ]


def test_the_done_line_gives_the_best_value_and_what_fit_returned(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(32, 1), config_for(tmp_path, 1)) as trainer:
        summary = trainer.fit()
        line = done_line(summary, trainer.monitor.name, True, 1, trainer.telemetry.summary_text(summary))
    assert line.startswith(f"done: best val acc {summary['best']:.4f}, 2 epochs, wall time ")
    assert (
        f"{summary['samples_per_sec']:.0f} samples/s" in line and line in capsys.readouterr().out.splitlines()
    )


def test_a_run_that_ends_inside_an_epoch_says_its_steps_not_0_epochs(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    """`--max-steps 60` ended with `done: ... 0 epochs`."""
    config = config_for(tmp_path, 1, max_steps=3, epochs=2)  # 8 steps an epoch
    with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(32, 1), config) as trainer:
        trainer.fit()
    assert re.search(
        r"^done: best val acc [\d.]+, 3 steps \(0\.38 epochs\), wall time ", capsys.readouterr().out, re.M
    )
    assert (
        trained(1, 11, 0.0) == "1 epochs" and trained(0, 7, None) == "7 steps"
    )  # a stream's epoch: no length


def test_a_run_that_ended_where_it_started_says_so_with_the_lr_to_check(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    # SGD at 5 diverges: its losses end far above its first step's; at 1e-6 it stays put.
    summaries = []
    for lr in (0.01, 5.0, 1e-6):
        config = config_for(tmp_path / str(lr), 1, optimizer="sgd", lr=lr, epochs=3, log_every=2)
        with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(32, 1), config) as trainer:
            summaries.append(trainer.fit())
    learned, diverged, stayed = capsys.readouterr().out.split("mode none: one device, cpu")[1:]
    assert "warning: the run ended where it started" not in learned and "did_not_learn" not in summaries[0]
    warning = next(line for line in diverged.splitlines() if line.startswith("warning: the run diverged"))
    assert re.fullmatch(
        r"warning: the run diverged \(training loss grew from \S+ to \S+; val loss \S+, \S+x the first "
        r"step's loss \S+; val loss \S+ -> \S+ since the first epoch(; val acc \S+, chance for 4 classes "
        r"is 0\.2500)?\): check the LR first, "
        r"lr 5; SGD usually trains at 0\.01 to 0\.1",
        warning,
    ), warning
    warning = next(line for line in stayed.splitlines() if line.startswith("warning: the run ended"))
    assert re.fullmatch(
        r"warning: the run ended where it started \(val loss (\S+) -> (\S+) since the first epoch; "
        r"val acc 0\.0312, chance for 4 classes is 0\.2500\): check the LR first, lr 1e-06; SGD usually "
        r"trains at 0\.01 to 0\.1",
        warning,
    ), warning
    assert summaries[2]["did_not_learn"] == warning.split("(", 1)[1].split("): ")[0]  # what a sweep marks


def test_after_a_resume_the_run_is_judged_from_its_first_recorded_loss_kept_in_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    """A run that learned in its first 2 epochs and is resumed for 2 more at an LR too small to move it: its
    second segment alone looks flat, but the run did learn. One that never moved is still told so."""
    endings = {}
    for name, first_lr in (("learned", 0.5), ("stayed", 1e-9)):
        for epochs, lr in ((2, first_lr), (4, 1e-9)):
            config = config_for(
                tmp_path / name, 1, optimizer="sgd", lr=lr, epochs=epochs, log_every=2, resume="auto"
            )
            with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(32, 1), config) as trainer:
                endings[name] = trainer.fit()
        endings[name]["out"] = capsys.readouterr().out.split("resumed from")[1]
    assert "warning: the run" not in endings["learned"]["out"] and "did_not_learn" not in endings["learned"]
    assert "warning: the run ended where it started (val loss" in endings["stayed"]["out"]
    assert endings["stayed"]["did_not_learn"].startswith("val loss ")


def slowly_learnable(size: int, seed: int) -> TensorDataset:
    """Ten classes whose centres lie close together (0.3 of the noise): learnable, but slowly."""
    centres = torch.randn(10, 16, generator=torch.Generator().manual_seed(1234)) * 0.3
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(10, (size,), generator=generator)
    return TensorDataset(centres[targets] + torch.randn(size, 16, generator=generator), targets)


def test_a_run_that_learns_slowly_at_a_usual_lr_gets_no_warning_but_is_marked_at_chance(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    """AdamW at 1e-3, the middle of its usual range, on a learnable task: its val loss falls epoch after epoch while
    its accuracy is still near chance. Evidence, not the accuracy, decides the warning; a sweep still marks the run
    (its result is at chance)."""
    config = config_for(tmp_path, 1, lr=1e-3, epochs=2, log_every=8)
    with MultiGPUTrainer(
        tiny_model(16, 10), slowly_learnable(256, 0), slowly_learnable(400, 1), config
    ) as trainer:
        summary = trainer.fit()
    out = capsys.readouterr().out
    losses = [float(loss) for loss in re.findall(r"^epoch \d/2: val loss ([\d.]+)", out, re.M)]
    assert losses[1] < losses[0] and summary["val_acc"] < 0.15, out  # it learns, and is still at chance
    assert "warning: the run ended where it started" not in out
    assert summary["did_not_learn"] == f"val acc {summary['val_acc']:.4f}, chance for 10 classes is 0.1000"


def test_a_run_that_did_not_learn_at_a_usual_lr_is_told_to_check_its_data_first(tmp_path: Path):
    """The advice follows the LR: inside the optimizer's usual range the data and targets come first."""
    report = Reporter(config_for(tmp_path, 1), enabled=False)  # records what it is told, prints nothing
    for loss in (2.303, 2.304):  # two epochs: the val loss did not fall, the accuracy stayed at chance
        report.epoch_metrics(0, 2, {"loss": loss, "acc": 0.1, "count": 400}, step=8)
    sgd = torch.optim.SGD(tiny_model().parameters(), lr=0.05)
    assert learning_warning(report, 10, sgd, 0.05, "none") == (
        "warning: the run ended where it started (val loss 2.303 -> 2.304 since the first epoch; val acc 0.1000, "
        "chance for 10 classes is 0.1000): lr 0.05 is in SGD's usual range (0.01 to 0.1): check the data and targets "
        "first (do the targets follow the inputs?), then the LR"
    )
    assert chance_accuracy(10) == pytest.approx(0.15) and chance_accuracy(2) == pytest.approx(0.6)
    assert chance_accuracy(1) is None and chance_accuracy(None) is None


def test_a_run_that_diverged_or_ended_no_better_than_chance_is_warned_about(tmp_path: Path):
    """Issue 49's AdamW at lr 5: its first step's loss 2.3, the untrained model's; the first logged interval's mean
    already in the hundreds, so its training loss fell from there; val loss 118 then 52 and val acc 0.094 then
    0.078 (chance 0.1). And a run whose loss fell while its accuracy stayed no better than chance."""
    adamw = torch.optim.AdamW(tiny_model().parameters(), lr=5.0)
    report = Reporter(config_for(tmp_path, 1), enabled=False)  # records what it is told, prints nothing
    for step, losses in ((8, [2.3] + [400.0] * 7), (16, [20.0] * 8)):  # per step, 32 samples each
        report.interval(
            step,
            step - 7,
            Interval([loss * 32 for loss in losses], 256, 0, 1.0, first_count=32),
            5.0,
            1,
            None,
            None,
        )
    for loss, acc in ((118.0, 0.094), (52.0, 0.078)):
        report.epoch_metrics(0, 2, {"loss": loss, "acc": acc, "count": 100}, step=8)
    assert learning_warning(report, 10, adamw, 5.0, "none") == (
        "warning: the run diverged (val loss 52, 22.6x the first step's loss 2.3; val acc 0.0780, chance for 10 "
        "classes is 0.1000): check the LR first, lr 5; AdamW usually trains at 0.0001 to 0.003"
    )
    slow = Reporter(config_for(tmp_path, 1), enabled=False)
    slow.interval(8, 1, Interval([2.3 * 32] * 8, 256, 0, 1.0, first_count=32), 1e-3, 1, None, None)
    for loss in (2.25, 2.2):  # falling, but the accuracy is no better than guessing
        slow.epoch_metrics(0, 2, {"loss": loss, "acc": 0.09, "count": 100}, step=8)
    assert learning_warning(slow, 10, adamw, 1e-3, "none") == (
        "warning: the run ended where it started (val acc 0.0900, chance for 10 classes is 0.1000): lr 0.001 is in "
        "AdamW's usual range (0.0001 to 0.003): check the data and targets first (do the targets follow the "
        "inputs?), then the LR"
    )


def test_adamw_at_lr_5_on_the_built_in_data_ends_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    args = [
        "--train-size",
        "256",
        "--val-size",
        "100",
        "--batch-size",
        "32",
        "--no-progress",
        "--optimizer",
        "adamw",
        "--lr",
        "5",
        "--epochs",
        "1",
        "--save-dir",
        str(tmp_path / "run"),
    ]
    assert main_multi_gpu.main(args) == 0
    warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: the run")]
    assert len(warning) == 1 and warning[0].startswith("warning: the run diverged ("), warning
    assert warning[0].endswith("): check the LR first, lr 5; AdamW usually trains at 0.0001 to 0.003")
