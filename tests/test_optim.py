"""The LR: scaling rule, warm-up and schedule per optimizer step, and TensorBoard showing the LR applied (issue 5).

The applied LR is read where it is used: an optimizer step pre-hook records
param_groups[0]["lr"] as each real optimizer step starts. The LR does not
depend on the number of processes (the equivalence tests check DDP's scaled LR
equals one process's), so these run in-process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import blobs, config_for, read_scalars, tiny_model, use_fp16_on_cpu
from multigpu.config import TrainConfig
from multigpu.errors import UsageError
from multigpu.lr_scaling import scaled_lr
from multigpu.optim import lr_factor
from train_multi_gpu import MultiGPUTrainer

BASE_LR = 0.1


def train_recording_lr(tmp_path: Path, **overrides: Any) -> tuple[MultiGPUTrainer, list[float]]:
    """Train 2 epochs of 160 samples with a half-epoch warm-up; return the trainer and the LR of every step."""
    config = config_for(tmp_path, 1, optimizer="sgd", lr=BASE_LR, warmup_epochs=0.5, epochs=2, **overrides)
    trainer = MultiGPUTrainer(tiny_model(), blobs(160, 0), None, config)
    applied: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs:
                                             applied.append(optimizer.param_groups[0]["lr"]))
    trainer.fit()
    return trainer, applied


def test_schedule_advances_per_optimizer_step_and_tensorboard_shows_the_applied_lr(tmp_path):
    big, big_lrs = train_recording_lr(tmp_path / "big", batch_size=16, log_every=3)
    accumulated, accumulated_lrs = train_recording_lr(tmp_path / "accum", batch_size=8, grad_accum_steps=2,
                                                      log_every=1)
    # Accumulation 2 x 8 covers the same 10 optimizer steps per epoch as batches of 16, with the same LRs.
    assert big.steps_per_epoch == accumulated.steps_per_epoch == 10
    assert accumulated_lrs == big_lrs and len(big_lrs) == 20
    assert big_lrs == [BASE_LR * lr_factor(step, big.config, 10) for step in range(20)]
    assert big_lrs[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1])  # warm-up: 0.5 epoch = 5 optimizer steps
    assert all(a > b for a, b in zip(big_lrs[5:], big_lrs[6:]))  # then cosine from 1.0, falling every step
    for trainer, applied in ((big, big_lrs), (accumulated, accumulated_lrs)):
        logged = read_scalars(Path(trainer.config.tensorboard_dir))["train/lr"]
        every = trainer.config.log_every  # log steps, and the epoch ends (steps 10 and 20) are sync points too
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
    config = config_for(tmp_path, 1, batch_size=8, grad_accum_steps=3, lr=0.1, lr_scaling="linear", lr_base_batch=8)
    trainer = MultiGPUTrainer(tiny_model(), blobs(48, 0), None, config)
    assert trainer.effective_batch == 24
    assert trainer.optimizer.param_groups[0]["initial_lr"] == trainer.lr == pytest.approx(0.3)


def test_fp16_gradients_are_clipped_after_unscaling(tmp_path):
    """Clipping the scaled gradients would leave them 1024x too small after unscaling (PITFALLS 5)."""
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, clip_grad_norm=0.05))
    forward_dtypes = use_fp16_on_cpu(trainer)  # scale 1024
    norms: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: norms.append(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()])).item()))
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
    built = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1),
                            optimizer=lambda params: torch.optim.Adagrad(params, lr=0.02))
    assert isinstance(built.optimizer, torch.optim.Adagrad) and built.lr == 0.02
    built.fit()
    assert "optimizer Adagrad, lr 0.02 (the optimizer's own)" in capsys.readouterr().out


def test_an_epoch_scheduler_steps_once_per_epoch_and_tensorboard_shows_its_lr(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=3, log_every=4),
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                              scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5),
                              scheduler_interval="epoch")
    applied: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs:
                                             applied.append(optimizer.param_groups[0]["lr"]))
    trainer.fit()
    assert applied == [0.1] * 8 + [0.05] * 8 + [0.025] * 8  # 8 steps per epoch
    logged = read_scalars(Path(trainer.config.tensorboard_dir))["train/lr"]
    assert [(step, round(value, 6)) for step, value in logged] == [(4, 0.1), (8, 0.1), (12, 0.05), (16, 0.05),
                                                                   (20, 0.025), (24, 0.025)]


def test_a_scheduler_built_before_lr_scaling_is_refused(tmp_path):
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="--lr-scaling linear cannot rescale a scheduler that is already built"):
        MultiGPUTrainer(model, blobs(64, 0), None, config_for(tmp_path, 1, lr_scaling="linear"), optimizer=sgd,
                        scheduler=torch.optim.lr_scheduler.StepLR(sgd, 1))


def test_replacing_the_optimizer_after_construction_is_refused_not_silently_ignored(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1))
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="trainer.optimizer was replaced after construction"):
        trainer.fit()


def test_resuming_with_another_optimizer_class_is_refused_naming_both(tmp_path):
    MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=1),
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1)).fit()
    other = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=2, resume="auto"),
                            optimizer=lambda params: torch.optim.Adam(params, lr=0.1))
    with pytest.raises(UsageError, match=r"optimizer Adam contradicts checkpoint .*last.pt \(saved with SGD\)"):
        other.fit()


def test_a_users_optimizer_without_a_scheduler_keeps_its_lr_unless_lr_schedule_is_set(tmp_path, capsys):
    """As in plain PyTorch (and the upstream ddp-tutorial): no scheduler, a constant LR; the plan says why."""
    kept = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path / "kept", 1),
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    applied: list[float] = []
    kept.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs:
                                          applied.append(optimizer.param_groups[0]["lr"]))
    kept.fit()
    assert applied == [0.1] * 16
    assert ("schedule constant (your optimizer's own LR: no scheduler given, lr_schedule not set), warm-up 0 steps "
            "(first step lr 0.1, peak 0.1)") in capsys.readouterr().out
    asked = MultiGPUTrainer(tiny_model(), blobs(64, 0), None,
                            config_for(tmp_path / "asked", 1, lr_schedule="step", lr_step_epochs=1.0, lr_gamma=0.5),
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    applied.clear()
    asked.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs:
                                           applied.append(optimizer.param_groups[0]["lr"]))
    asked.fit()
    assert applied == pytest.approx([0.1] * 8 + [0.05] * 8)


def test_a_scheduler_factory_with_total_steps_gets_the_runs_steps_after_world_size_and_accumulation(tmp_path):
    """OneCycleLR must know the run's length: 64 samples / (8 x 2 accumulation) x 3 epochs = 12 steps."""
    got: list[int] = []

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        got.append(total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)

    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=3, grad_accum_steps=2),
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1), scheduler=one_cycle)
    assert got == [trainer.total_steps] == [12]
    trainer.fit()  # OneCycleLR raises when stepped past total_steps
    assert trainer.progress.global_step == 12
    assert trainer.applied_lr < 1e-5  # the last step annealed to max_lr / 25 / 1e4: the cycle fits the run
