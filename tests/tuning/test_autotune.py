"""--autotune (multigpu/tuning/autotune.py): it tries its settings on real training steps, prints and saves its choice,
ends where a run given the chosen settings directly ends (within rounding), keeps fp32, and a resume reuses the
choice without measuring again; under DDP the layout switch re-wraps the model and the ranks stay equal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import blobs, config_for, run_ranks, tiny_model
from multigpu.tuning import autotune
from train_multi_gpu import MultiGPUTrainer

STEPS = 48  # enough for 4 settings of 5 steps, twice over


def conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)
    )


def images(size: int = STEPS * 8) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(size, 2, 8, 8, generator=generator), torch.randint(0, 3, (size,), generator=generator)
    )


def train(tmp_path: Path, name: str, world_size: int = 1, **overrides) -> MultiGPUTrainer:
    # The data on the device as given: --data-on-device auto's own trial is data/test_device_data.py's
    config = config_for(
        tmp_path / name,
        world_size,
        **{
            "epochs": 1,
            "batch_size": 8 // world_size,
            "log_every": 7,
            "optimizer": "sgd",
            "data_on_device": "on",
            **overrides,
        },
    )
    trainer = MultiGPUTrainer(conv_net(), images(), None, config)
    trainer.fit()
    return trainer


def weights(trainer: MultiGPUTrainer) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone().contiguous() for key, value in trainer.model.state_dict().items()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:  # channels-last convolutions sum in another order: equal up to rounding
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), (key, (a[key] - b[key]).abs().max())


@pytest.fixture
def threads_kept():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_autotune_tries_the_settings_on_training_steps_and_prints_saves_and_reuses_its_choice(
    tmp_path, capsys, threads_kept
):
    tuned = train(tmp_path, "tuned", autotune=True)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("--autotune:"))
    tuner = tuned.autotune
    assert tuner.trials[:2] == [
        autotune.Setting(False, tuner.trials[0].threads),
        autotune.Setting(True, tuner.trials[0].threads),
    ]  # as given first, then NHWC
    assert len(tuner.medians) == len(tuner.trials) and tuner.chosen in tuner.trials
    assert re.match(
        rf"--autotune: {re.escape(tuner.chosen.words())}, x\d+\.\d\d the settings as given \(median "
        rf"step [\d.]+ ms vs [\d.]+ ms; steps 1-{5 * len(tuner.trials)} measured",
        line,
    ), line
    # whether compile was tried and why: steps of milliseconds could never repay a compile
    assert re.search(
        rf"\); compile not tried: (the {STEPS - 5 * len(tuner.trials)} steps left at [\d.]+ ms would "
        rf"save [\d,]+ s if compiled steps were 10% faster, less than the [\d,]+ s a compile is expected "
        rf"to take( on cores this process had \d+% of)?|no C\+\+ compiler \(g\+\+\) here)$",
        line,
    ), line
    assert (
        tuned.model[0].weight.is_contiguous(memory_format=torch.channels_last) == tuner.chosen.channels_last
    )
    assert torch.get_num_threads() == tuner.chosen.threads
    assert tuned.amp.dtype is None and all(
        p.dtype == torch.float32 for p in tuned.model.parameters()
    )  # fp32 stays

    saved = torch.load(tmp_path / "tuned" / "ckpt" / "last.pt", weights_only=True)["autotune"]
    assert autotune.Setting(**saved["setting"]) == tuner.chosen and saved["at_step"] == 5 * len(tuner.trials)

    torch.set_num_threads(tuner.chosen.threads)  # the chosen settings, given directly
    direct = train(tmp_path, "direct", channels_last=tuner.chosen.channels_last)
    assert_close(weights(tuned), weights(direct))

    resumed = train(tmp_path, "tuned", autotune=True, resume="auto", epochs=2)
    out = capsys.readouterr().out
    assert (
        f"--autotune: {tuner.chosen.words()}, as chosen at step {saved['at_step']} and saved in the "
        f"checkpoint (not measured again)" in out
    )
    assert resumed.autotune.medians == [] and resumed.autotune.chosen == tuner.chosen


def test_a_run_too_short_to_tune_trains_with_the_settings_as_given(tmp_path, capsys, threads_kept):
    trainer = train(tmp_path, "short", autotune=True, max_steps=12)
    assert trainer.autotune.chosen == trainer.autotune.trials[0] and trainer.autotune.medians == []
    assert "--autotune: 12 steps are too few to measure" in capsys.readouterr().out
    assert not trainer.model[0].weight.is_contiguous(memory_format=torch.channels_last)


class Steps:
    """Counts the on_step_end calls it gets."""

    def __init__(self) -> None:
        self.calls = 0

    def on_step_end(self, trainer: MultiGPUTrainer) -> None:
        self.calls += 1


def test_every_callback_runs_at_every_step_the_step_of_the_choice_too(tmp_path, threads_kept):
    """The autotuner leaves the trainer's step hooks as it chooses, while the trainer goes through them: a hook
    after it missed that step (an --ema-decay average one update short, and not bit-exact across a resume)."""
    steps = Steps()
    config = config_for(tmp_path, 1, epochs=1, batch_size=8, data_on_device="auto")  # the data's trial alone
    trainer = MultiGPUTrainer(tiny_model(), blobs(160, 0), None, config, callbacks=[steps])
    trainer.fit()
    assert trainer.autotune.chosen is not None and steps.calls == trainer.progress.global_step == 20


def _ddp_tuned_then_direct(rank: int, world_size: int, tmp_path: Path) -> dict:
    tuned = train(tmp_path, "tuned", world_size, autotune=True)
    autotune = tuned.autotune
    assert autotune is not None and autotune.chosen is not None  # --autotune, done choosing
    chosen = autotune.chosen
    torch.set_num_threads(chosen.threads)  # then the chosen settings, given directly
    direct = train(tmp_path, "direct", world_size, channels_last=chosen.channels_last)
    return {
        "tuned": weights(tuned),
        "direct": weights(direct),
        "trials": autotune.trials,
        "chosen": chosen,
        "measured": len(autotune.medians),
        "wrapped": type(tuned.step.wrapped).__name__,
    }


@pytest.mark.slow
def test_under_ddp_the_layout_switch_rewraps_the_model_and_both_ranks_train_as_a_direct_run(tmp_path):
    """Two gloo ranks: the trials switch to channels-last and back (DDP is wrapped anew each time, its gradient
    buckets in the new layout), the ranks end equal, and equal within rounding to a run given the chosen
    settings from the start."""
    ranks = run_ranks(_ddp_tuned_then_direct, 2, tmp_path, tmp_path)
    assert {setting.channels_last for setting in ranks[0]["trials"]} == {False, True}
    assert (
        ranks[0]["measured"] == len(ranks[0]["trials"]) and ranks[0]["wrapped"] == "DistributedDataParallel"
    )
    assert ranks[0]["chosen"] == ranks[1]["chosen"]
    for key in ranks[0]["tuned"]:
        assert torch.equal(ranks[0]["tuned"][key], ranks[1]["tuned"][key]), key
    assert_close(ranks[0]["tuned"], ranks[0]["direct"])


@pytest.mark.slow
@pytest.mark.skipif(
    not autotune.can_compile(torch.device("cpu")), reason="torch.compile on the CPU needs g++"
)
def test_on_a_run_long_enough_compile_is_tried_last_and_kept_only_if_it_repays_itself(
    tmp_path, monkeypatch, capsys, threads_kept
):
    """With the bar for a long enough run lowered to 0 s, the compiled form of the fastest eager setting is the
    last trial; whether kept or not, the module is compiled exactly when the choice says so, and the run ends
    where one given the chosen settings directly ends."""
    monkeypatch.setitem(autotune.EXPECTED_COMPILE_SECONDS, "cpu", 0.0)
    tuned = train(
        tmp_path, "tuned", autotune=True, channels_last=False
    )  # given: only threads and compile tried
    tuner = tuned.autotune
    assert tuner.trials[-1].compiled and not any(setting.compiled for setting in tuner.trials[:-1])
    assert len(tuner.medians) == len(tuner.trials)
    assert (tuned.model._compiled_call_impl is not None) == tuner.chosen.compiled
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("--autotune:"))
    assert (
        "compiled " in line
    )  # the compiled trial's time is in the line, and why it was tried and kept or not
    kept = "kept" if tuner.chosen.compiled else "not kept"
    left = STEPS - 5 * (len(tuner.trials) - 1)  # at the decision; the compiled trial then takes 7 steps
    assert re.search(
        rf"; compile tried: the {left} steps left at [\d.]+ ms would save [\d,]+ s if compiled steps "
        rf"were 10% faster, at least the 0 s a compile is expected to take( on cores this process had \d+% "
        rf"of)?; {kept}: it (saves|would "
        rf"save) [\d,]+ s over the {left - 7} steps left, its compile took [\d,]+ s$",
        line,
    ), line
    torch.set_num_threads(tuner.chosen.threads)
    direct = train(tmp_path, "direct", channels_last=False, compile=tuner.chosen.compiled)
    assert_close(weights(tuned), weights(direct))


def test_compile_is_tried_only_where_the_planned_steps_left_could_repay_it():
    """resnet18 at 32 px on 2 CPU cores, about 0.8 s a step: 60 steps cannot repay a compile, 2,000 can."""
    cpu = torch.device("cpu")
    assert autotune.compile_worth_trying(50, 0.8, cpu) == (
        False,
        "compile not tried: the 50 steps left at 800.0 ms would save 4 s if compiled steps were 10% faster, "
        "less than the 60 s a compile is expected to take",
    )
    assert autotune.compile_worth_trying(1990, 0.8, cpu) == (
        True,
        "compile tried: the 1,990 steps left at 800.0 ms would save 159 s if compiled steps were 10% faster, "
        "at least the 60 s a compile is expected to take",
    )
    assert not autotune.compile_worth_trying(100_000, 0.005, cpu)[0]  # the cnn's steps: never worth a compile


def test_a_process_that_got_a_fraction_of_its_cores_expects_a_compile_that_much_slower():
    """On 2 cores other jobs kept busy, resnet18's measured steps took 15 s instead of 0.8 s: 50 of them would
    have repaid the 60 s a compile takes on free cores, and compile was tried, and took 280 s. The process had
    16% of its cores' time in the trials (its CPU seconds over the wall seconds of its threads), and a compile
    is expected to take that much longer too."""
    cpu = torch.device("cpu")
    share = autotune.cpu_share(cpu_seconds=337.0, wall_seconds=1078.0, threads=2)
    assert share == pytest.approx(337.0 / 2156.0)
    assert autotune.compile_worth_trying(50, 15.377, cpu, share) == (
        False,
        "compile not tried: the 50 steps left at 15377.0 ms would save 77 s if compiled steps were 10% faster, "
        "less than the 384 s a compile is expected to take on cores this process had 16% of",
    )
    assert autotune.compile_worth_trying(50, 15.377, cpu)[0]  # as if it had its cores: tried
    assert autotune.compile_worth_trying(1990, 0.8, cpu, 0.95) == autotune.compile_worth_trying(
        1990, 0.8, cpu
    )
    assert autotune.compile_worth_trying(10, 1.0, cpu, 0.0)[1].endswith(
        "the 1200 s a compile is expected to take on cores this process had 5% of"
    )  # counted as 5% at the least
