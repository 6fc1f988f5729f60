"""The LR: scaling rule, warm-up and schedule per optimizer step, TensorBoard showing the LR applied (issue 5), and the
LR, weight decay and momentum a resume changes (issue 39).

The applied LR is read where it is used: an optimizer step pre-hook records
param_groups[0]["lr"] as each real optimizer step starts. The LR does not
depend on the number of processes (the equivalence tests check DDP's scaled LR
equals one process's), so these run in-process.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import blobs, config_for, read_scalars, tiny_model, use_fp16_on_cpu
from multigpu.config import TrainConfig
from multigpu.errors import TrainingStopped, UsageError
from multigpu.loop.optim import lr_factor
from multigpu.lr_scaling import scaled_lr
from train_multi_gpu import MultiGPUTrainer

BASE_LR = 0.1


def train_recording_lr(tmp_path: Path, **overrides: Any) -> tuple[MultiGPUTrainer, list[float]]:
    """Train 2 epochs of 160 samples with a half-epoch warm-up; return the trainer and the LR of every step."""
    config = config_for(tmp_path, 1, optimizer="sgd", lr=BASE_LR, warmup_epochs=0.5, epochs=2, **overrides)
    trainer = MultiGPUTrainer(tiny_model(), blobs(160, 0), None, config)
    applied: list[float] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(optimizer.param_groups[0]["lr"])
    )
    trainer.fit()
    return trainer, applied


def test_schedule_advances_per_optimizer_step_and_tensorboard_shows_the_applied_lr(tmp_path):
    big, big_lrs = train_recording_lr(tmp_path / "big", batch_size=16, log_every=3)
    accumulated, accumulated_lrs = train_recording_lr(
        tmp_path / "accum", batch_size=8, grad_accum_steps=2, log_every=1
    )
    # Accumulation 2 x 8 covers the same 10 optimizer steps per epoch as batches of 16, with the same LRs.
    assert big.steps_per_epoch == accumulated.steps_per_epoch == 10
    assert accumulated_lrs == big_lrs and len(big_lrs) == 20
    assert big_lrs == [BASE_LR * lr_factor(step, big.config, 10) for step in range(20)]
    assert big_lrs[:5] == pytest.approx(
        [0.02, 0.04, 0.06, 0.08, 0.1]
    )  # warm-up: 0.5 epoch = 5 optimizer steps
    assert all(a > b for a, b in zip(big_lrs[5:], big_lrs[6:]))  # then cosine from 1.0, falling every step
    for trainer, applied in ((big, big_lrs), (accumulated, accumulated_lrs)):
        logged = read_scalars(Path(trainer.config.tensorboard_dir))["train/lr"]
        every = (
            trainer.config.log_every
        )  # log steps, and the epoch ends (steps 10 and 20) are sync points too
        assert [step for step, _ in logged] == sorted(set(range(every, 21, every)) | {10, 20})
        for step, value in logged:  # TensorBoard's value at step s is the LR step s applied (float32-rounded)
            assert value == pytest.approx(applied[step - 1], rel=1e-6)


def test_lr_factor_warm_up_cosine_and_step_decay_count_optimizer_steps():
    cosine = TrainConfig(epochs=4, warmup_epochs=1, lr_schedule="cosine")
    factors = [lr_factor(step, cosine, steps_per_epoch=5) for step in range(20)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factors[5] == 1.0 and factors[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 14 / 15)))
    decay = TrainConfig(epochs=4, lr_schedule="step", lr_step_epochs=1.0, lr_gamma=0.5)
    assert [lr_factor(step, decay, 5) for step in range(0, 20, 5)] == [1.0, 0.5, 0.25, 0.125]
    assert lr_factor(19, TrainConfig(lr_schedule="constant"), 5) == 1.0


def test_lr_is_scaled_by_the_effective_batch_of_devices_times_accumulation(tmp_path):
    assert scaled_lr(0.1, "linear", 256, 32) == pytest.approx(0.8)
    assert scaled_lr(1e-3, "sqrt", 128, 32) == pytest.approx(2e-3)
    assert scaled_lr(0.1, "none", 256, 32) == 0.1
    config = config_for(
        tmp_path, 1, batch_size=8, grad_accum_steps=3, lr=0.1, lr_scaling="linear", lr_base_batch=8
    )
    trainer = MultiGPUTrainer(tiny_model(), blobs(48, 0), None, config)
    assert trainer.effective_batch == 24
    assert trainer.optimizer.param_groups[0]["initial_lr"] == trainer.lr == pytest.approx(0.3)


def test_fp16_gradients_are_clipped_after_unscaling(tmp_path):
    """Clipping the scaled gradients would leave them 1024x too small after unscaling (PITFALLS 5)."""
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, clip_grad_norm=0.05))
    forward_dtypes = use_fp16_on_cpu(trainer)  # scale 1024
    norms: list[float] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: norms.append(
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()])).item()
        )
    )
    trainer.fit()
    assert len(norms) == trainer.progress.global_step == 16  # no step skipped
    assert norms == pytest.approx([0.05] * 16, rel=1e-4)  # every step clipped to the norm asked for
    assert set(forward_dtypes) == {torch.float16}  # the forward really ran in float16


# ---------------------------------------------------------------- the user's own optimizer and schedule
def test_a_users_optimizer_is_used_and_lr_scaling_applies_to_it(tmp_path, capsys):
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    config = config_for(tmp_path, 1, batch_size=8, grad_accum_steps=2, lr_scaling="linear", lr_base_batch=8)
    trainer = MultiGPUTrainer(model, blobs(64, 0), None, config, optimizer=sgd)
    assert trainer.optimizer is sgd and sgd.param_groups[0]["lr"] == pytest.approx(0.1)  # 0.05 x 16/8
    built = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1),
        optimizer=lambda params: torch.optim.Adagrad(params, lr=0.02),
    )
    assert isinstance(built.optimizer, torch.optim.Adagrad) and built.lr == 0.02
    built.fit()
    assert "optimizer Adagrad, lr 0.02 (the optimizer's own)" in capsys.readouterr().out


def test_an_epoch_scheduler_steps_once_per_epoch_and_tensorboard_shows_its_lr(tmp_path):
    trainer = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1, epochs=3, log_every=4),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
        scheduler_interval="epoch",
    )
    applied: list[float] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(optimizer.param_groups[0]["lr"])
    )
    trainer.fit()
    assert applied == [0.1] * 8 + [0.05] * 8 + [0.025] * 8  # 8 steps per epoch
    logged = read_scalars(Path(trainer.config.tensorboard_dir))["train/lr"]
    assert [(step, round(value, 6)) for step, value in logged] == [
        (4, 0.1),
        (8, 0.1),
        (12, 0.05),
        (16, 0.05),
        (20, 0.025),
        (24, 0.025),
    ]


def test_a_scheduler_built_before_lr_scaling_is_refused(tmp_path):
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        UsageError, match="--lr-scaling linear cannot rescale a scheduler that is already built"
    ):
        MultiGPUTrainer(
            model,
            blobs(64, 0),
            None,
            config_for(tmp_path, 1, lr_scaling="linear"),
            optimizer=sgd,
            scheduler=torch.optim.lr_scheduler.StepLR(sgd, 1),
        )


def test_replacing_the_optimizer_after_construction_is_refused_not_silently_ignored(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1))
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="trainer.optimizer was replaced after construction"):
        trainer.fit()


def test_resuming_with_another_optimizer_class_is_refused_naming_both(tmp_path):
    MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1, epochs=1),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    ).fit()
    other = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1, epochs=2, resume="auto"),
        optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
    )
    with pytest.raises(
        UsageError, match=r"optimizer Adam contradicts checkpoint .*last.pt \(saved with SGD\)"
    ):
        other.fit()


def test_a_users_optimizer_without_a_scheduler_keeps_its_lr_unless_lr_schedule_is_set(tmp_path, capsys):
    """As in plain PyTorch (and the upstream ddp-tutorial): no scheduler, a constant LR; the plan says why."""
    kept = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path / "kept", 1),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    applied: list[float] = []
    kept.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(optimizer.param_groups[0]["lr"])
    )
    kept.fit()
    assert applied == [0.1] * 16
    assert (
        "schedule constant (your optimizer's own LR: no scheduler given, lr_schedule not set), warm-up 0 steps "
        "(first step lr 0.1, peak 0.1)"
    ) in capsys.readouterr().out
    asked = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path / "asked", 1, lr_schedule="step", lr_step_epochs=1.0, lr_gamma=0.5),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    applied.clear()
    asked.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(optimizer.param_groups[0]["lr"])
    )
    asked.fit()
    assert applied == pytest.approx([0.1] * 8 + [0.05] * 8)


def test_a_scheduler_factory_with_total_steps_gets_the_runs_steps_after_world_size_and_accumulation(tmp_path):
    """OneCycleLR must know the run's length: 64 samples / (8 x 2 accumulation) x 3 epochs = 12 steps."""
    got: list[int] = []

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        got.append(total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)

    trainer = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1, epochs=3, grad_accum_steps=2),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        scheduler=one_cycle,
    )
    assert got == [trainer.total_steps] == [12]
    trainer.fit()  # OneCycleLR raises when stepped past total_steps
    assert trainer.progress.global_step == 12
    assert (
        trainer.step.applied_lr < 1e-5
    )  # the last step annealed to max_lr / 25 / 1e4: the cycle fits the run


# ---------------------------------------------------------------- settings changed on resume
def resume_one_epoch_run(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture, **changes: Any
) -> tuple[MultiGPUTrainer, list[dict[str, float]], str]:
    """A copy of the run in tmp_path/"run" (1 epoch of 8 steps, AdamW at lr 0.01, weight decay 0.01) resumed to 2
    epochs with `changes`: the trainer, each resumed step's LR and weight decay as the step read them, and the plan
    line that describes the optimizer."""
    shutil.copytree(tmp_path / "run", tmp_path / name)
    config = config_for(
        tmp_path / name, 1, **{"epochs": 2, "lr": 0.01, "weight_decay": 0.01, "resume": "auto", **changes}
    )
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config)
    used: list[dict[str, float]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: used.append(
            {key: optimizer.param_groups[0][key] for key in ("lr", "weight_decay")}
        )
    )
    capsys.readouterr()
    trainer.fit()
    return (
        trainer,
        used,
        next(line for line in capsys.readouterr().out.splitlines() if line.startswith("optimizer ")),
    )


def test_lr_and_weight_decay_changed_on_resume_hold_from_the_next_step_and_the_plan_says_the_lrs_used(
    tmp_path, capsys
):
    MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path / "run", 1, epochs=1, lr=0.01, weight_decay=0.01),
    ).fit()
    same, same_used, same_plan = resume_one_epoch_run(tmp_path, "same", capsys)
    faster, faster_used, faster_plan = resume_one_epoch_run(tmp_path, "faster", capsys, lr=0.05)
    decayed, decayed_used, _ = resume_one_epoch_run(tmp_path, "decayed", capsys, weight_decay=0.5)
    # Each resumed step (8 to 15) takes the 2-epoch cosine's value there, from this run's --lr.
    for lr, used in ((0.01, same_used), (0.05, faster_used), (0.01, decayed_used)):
        assert [step["lr"] for step in used] == [
            lr * lr_factor(step, same.config, 8) for step in range(8, 16)
        ]
    assert faster.optimizer.param_groups[0]["initial_lr"] == 0.05
    assert [step["weight_decay"] for step in decayed_used] == [0.5] * 8
    assert {step["weight_decay"] for step in same_used + faster_used} == {0.01}
    for other in (faster, decayed):
        assert not torch.equal(other.model[0].weight, same.model[0].weight)
    for plan, used in (
        (same_plan, same_used),
        (faster_plan, faster_used),
    ):  # cosine: the first step is the peak
        assert plan.startswith(
            f"optimizer AdamW, lr {used[0]['lr'] / lr_factor(8, same.config, 8):g} (as given"
        )
        assert f"(first step lr {used[0]['lr']:g}, peak {used[0]['lr']:g})" in plan
    with pytest.raises(
        TrainingStopped, match="loss became non-finite"
    ):  # an absurd LR is not silently ignored
        resume_one_epoch_run(tmp_path, "absurd", capsys, lr=1e30, log_every=1)


def test_a_users_scheduler_refuses_a_resume_at_another_lr_in_one_line_and_keeps_its_weight_decay(tmp_path):
    """A scheduler of the user's continues the checkpoint's LR and cannot be moved to another: another LR is refused
    (under the built-in schedule the same optimizer takes it); weight decay, which no scheduler changes, holds."""

    def trainer(
        lr: float, weight_decay: float = 0.0, resume: bool = True, **schedule: Any
    ) -> MultiGPUTrainer:
        config = config_for(
            tmp_path / ("builtin" if schedule else "own"),
            1,
            epochs=2 if resume else 1,
            resume="auto" if resume else None,
            **schedule,
        )
        own: dict[str, Any] = (
            {}
            if schedule
            else {"scheduler": lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)}
        )
        return MultiGPUTrainer(
            tiny_model(),
            blobs(64, 0),
            None,
            config,
            **own,
            optimizer=lambda params: torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay),
        )

    trainer(0.01, resume=False).fit()
    with pytest.raises(UsageError) as refused:
        trainer(0.05).fit()
    assert str(refused.value) == (
        "this run's optimizer starts from lr 0.05 and the checkpoint's from 0.01, but your "
        "scheduler ExponentialLR continues the checkpoint's LR (a scheduler's state cannot be "
        "moved to another base LR): resume with lr 0.01, or start afresh in a new --save-dir"
    )
    decayed = trainer(0.01, weight_decay=0.1)
    decayed.fit()
    assert decayed.optimizer.param_groups[0]["weight_decay"] == 0.1 and decayed.progress.epoch == 2
    trainer(0.01, resume=False, lr_schedule="constant").fit()
    moved = trainer(0.05, lr_schedule="constant")
    moved.fit()
    assert moved.optimizer.param_groups[0]["lr"] == 0.05 == moved.scheduler.base_lrs[0]


def test_sgd_momentum_changed_on_resume_holds_from_the_next_step(tmp_path):
    MultiGPUTrainer(
        tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=1, optimizer="sgd")
    ).fit()
    resumed = MultiGPUTrainer(
        tiny_model(),
        blobs(64, 0),
        None,
        config_for(tmp_path, 1, epochs=2, optimizer="sgd", momentum=0.5, resume="auto"),
    )
    used: list[float] = []
    resumed.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: used.append(optimizer.param_groups[0]["momentum"])
    )
    resumed.fit()
    assert used == [0.5] * 8
