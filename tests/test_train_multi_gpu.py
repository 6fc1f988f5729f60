"""MultiGPUTrainer through its Python API: a user's own module and data sets, in one and several processes."""

from __future__ import annotations

import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from conftest import (
    RUN_TIMEOUT,
    CrashAt,
    blobs,
    busy_cpus,
    cli_command,
    cli_env,
    config_for,
    read_scalars,
    regression_model,
    regression_set,
    run_ranks,
    thread_names,
    tiny_model,
)
from multigpu.checkpoints import checkpoint
from multigpu.loop.callbacks import EMA
from multigpu.loop.forward import BatchMismatch
from train_multi_gpu import MultiGPUTrainer

VAL_SIZES = (4, 5, 7, 101)  # not multiples of 2 or 3, one smaller than 2 batches


def _evaluate(rank: int, world_size: int, tmp_path: Path) -> list[dict]:
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, world_size))
    return [trainer.evaluate(blobs(size, 1)) for size in VAL_SIZES]


@pytest.mark.slow
def test_evaluate_counts_every_sample_once_for_any_world_size(tmp_path):
    single = _evaluate(0, 1, tmp_path)
    assert [result["count"] for result in single] == list(VAL_SIZES)
    assert len({result["acc"] for result in single}) > 1  # the sets differ, so equality below means something
    for world_size in (2, 3):
        for rank_results in run_ranks(_evaluate, world_size, tmp_path, tmp_path):
            assert rank_results == single  # counts, accuracy and loss: bit-identical on every rank


def test_python_api_misuse_is_one_clear_exception_not_torchs(tmp_path):
    floats = TensorDataset(
        torch.randn(32, 16), torch.randint(4, (32,)).float()
    )  # class labels stored as floats
    says = (
        r"^targets of dtype float32 and shape \(8,\) for outputs of shape \(8, 4\): cross-entropy \(the default "
        r"loss_fn\) takes class indices, integers \(e\.g\. targets\.long\(\) in the data set\), or class "
        r"probabilities of the outputs' shape; for real-valued targets pass a loss_fn such as torch\.nn\.MSELoss\(\)$"
    )
    with pytest.raises(BatchMismatch, match=says):  # at the first step
        MultiGPUTrainer(tiny_model(), floats, None, config_for(tmp_path / "fit", 1, epochs=1)).fit()
    with pytest.raises(BatchMismatch, match=says.replace("(8,)", "(4,)").replace("(8, 4)", "(4, 4)")):
        MultiGPUTrainer(
            tiny_model(), floats, floats, config_for(tmp_path / "val", 1)
        )  # the validation set's check
    probabilities = TensorDataset(torch.randn(32, 16), torch.softmax(torch.randn(32, 4), dim=1))
    assert (
        MultiGPUTrainer(tiny_model(), probabilities, None, config_for(tmp_path / "soft", 1, epochs=1)).fit()[
            "global_step"
        ]
        == 4
    )  # floats of the outputs' shape are class probabilities: cross-entropy takes them
    with pytest.raises(
        TypeError,
        match=r"^model is the class Linear, not a model: build it first, e\.g\. "
        r"MultiGPUTrainer\(Linear\(\.\.\.\), \.\.\.\)$",
    ):
        MultiGPUTrainer(torch.nn.Linear, blobs(32, 0), None, config_for(tmp_path / "class", 1))
    with pytest.raises(
        TypeError,
        match=r"^model must be a torch\.nn\.Module \(its parameters are what trains\); got a "
        r"function: <function ",
    ):
        MultiGPUTrainer(lambda inputs: inputs, blobs(32, 0), None, config_for(tmp_path / "function", 1))


def test_fit_trains_a_users_module_and_returns_final_metrics(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(256, 0), blobs(100, 1), config_for(tmp_path, 1, epochs=3))
    before = trainer.evaluate()
    metrics = trainer.fit()
    assert metrics["epochs"] == 3
    assert metrics["val_acc"] > 0.9 > before["acc"]
    assert metrics["val_loss"] < before["loss"]
    assert metrics["best_val_acc"] >= metrics["val_acc"]
    assert metrics["samples_per_sec"] > 0
    assert trainer.evaluate()["acc"] == metrics["val_acc"]
    assert {"last.pt", "best.pt"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}


def test_bf16_autocast_trains_on_the_cpu(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(256, 0), blobs(100, 1), config_for(tmp_path, 1, amp="bf16"))
    assert trainer.amp_dtype == torch.bfloat16
    dtypes: list[torch.dtype] = []  # what the training steps' forward passes return: autocast is on
    trainer.model.register_forward_hook(
        lambda module, args, output: dtypes.append(output.dtype) if module.training else None
    )
    assert trainer.fit()["val_acc"] > 0.9
    assert dtypes and set(dtypes) == {torch.bfloat16}


def test_fp16_on_the_cpu_falls_back_to_bf16_with_one_line(tmp_path, capsys):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, amp="fp16", epochs=1))
    assert trainer.amp_dtype == torch.bfloat16
    assert not trainer.scaler.is_enabled()
    lines = [line for line in capsys.readouterr().out.splitlines() if "fp16" in line]
    assert lines == ["--amp fp16 needs a CUDA device; using bf16 autocast on the CPU instead"]
    trainer.fit()  # no validation set: trains and saves without evaluating


def _train_and_return_weights(rank: int, world_size: int, tmp_path: Path) -> dict:
    trainer = MultiGPUTrainer(
        tiny_model(),
        blobs(128, 0),
        blobs(50, 1),
        config_for(tmp_path / f"w{world_size}", world_size, epochs=1),
    )
    trainer.fit()
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def test_ddp_ranks_end_with_identical_weights(tmp_path):
    rank0, rank1 = run_ranks(_train_and_return_weights, 2, tmp_path, tmp_path)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name


# ---------------------------------------------------------------- best checkpoint, evaluation batch, lifecycle
def test_best_checkpoint_follows_the_monitored_metric_in_its_direction(tmp_path):

    for mode, pick in (("auto", min), ("max", max)):  # auto: val_loss, lower is better; max overrides it
        config = config_for(tmp_path / mode, 1, epochs=3, monitor_mode=mode, lr=0.002)
        trainer = MultiGPUTrainer(
            regression_model(),
            regression_set(64, 0),
            regression_set(30, 1),
            config,
            loss_fn=torch.nn.functional.mse_loss,
        )
        summary = trainer.fit()
        assert summary["monitor"] == "val_loss" and "val_acc" not in summary and "best_val_acc" not in summary
        losses = [value for _, value in read_scalars(Path(config.tensorboard_dir))["val/loss"]]
        assert len(set(losses)) == 3 and summary["best"] == pytest.approx(pick(losses), rel=1e-6)
        best = checkpoint.load(str(Path(config.save_dir) / "best.pt"))
        assert (best["monitor"], best["best_value"]) == ("val_loss", summary["best"])
        assert best["epoch"] == 1 + losses.index(pick(losses))


def test_eval_batch_size_sets_the_evaluation_batches(tmp_path):
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, eval_batch_size=25))
    sizes: list[int] = []
    trainer.model.register_forward_hook(lambda module, args, output: sizes.append(output.shape[0]))
    assert trainer.evaluate(blobs(101, 1))["count"] == 101
    assert sizes == [25, 25, 25, 25, 1]


def test_fit_closes_its_writer_and_progress_bar_when_training_raises(tmp_path):
    calls: list[int] = []

    def failing_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the user's loss failed")
        return torch.nn.functional.cross_entropy(outputs, targets)

    config = config_for(tmp_path, 1, log_every=1, progress=True)
    trainer = MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config, loss_fn=failing_loss)
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        trainer.fit()
    assert trainer.report.bar is None and trainer.report._writer is None
    assert [step for step, _ in read_scalars(Path(config.tensorboard_dir))["train/loss"]] == [1, 2]  # flushed


def test_resume_waits_for_fit_so_a_user_can_attach_things_first(tmp_path):
    MultiGPUTrainer(tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=1)).fit()
    trainer = MultiGPUTrainer(
        tiny_model(), blobs(64, 0), None, config_for(tmp_path, 1, epochs=2, resume="auto")
    )
    assert trainer.progress.global_step == 0
    steps: list[int] = []
    trainer.optimizer.register_step_post_hook(lambda *args: steps.append(trainer.progress.global_step))
    assert trainer.fit()["global_step"] == 16 and steps == list(range(8, 16))


def _process_group_owner(rank: int, world_size: int, tmp_path: Path) -> dict[str, bool]:
    with MultiGPUTrainer(
        tiny_model(), blobs(32, 0), None, config_for(tmp_path, world_size, epochs=1)
    ) as trainer:
        trainer.fit()
        during = dist.is_initialized() and trainer.owns_process_group
    return {
        "during": during,
        "after": dist.is_initialized(),
        "gloo threads after": any(name.startswith(("gloo", "pt_gloo")) for name in thread_names()),
    }


@pytest.mark.slow
def test_a_trainer_destroys_only_the_process_group_it_set_up(tmp_path):
    """Destroyed means gone: its gloo threads are joined, though DDP's first construction imports a module whose
    default arguments would hold the group for good (multigpu/parallel/distributed.py _import_before_the_group)."""
    owned = run_ranks(_process_group_owner, 2, tmp_path / "owned", tmp_path / "owned", join_group=False)
    assert owned == [{"during": True, "after": False, "gloo threads after": False}] * 2
    given = run_ranks(_process_group_owner, 2, tmp_path / "given", tmp_path / "given")  # the test set it up
    assert given == [{"during": False, "after": True, "gloo threads after": True}] * 2


# A user's script, as the guide's "Your own task" shows it: build, fit (or only predict), and simply end; no
# close(), no `with`. Its own at-exit handler, registered first, runs after the framework's and reports which
# threads are still there then: only the main thread may be, or the interpreter's finalization meets them.
SCRIPT_THAT_ENDS = """
import atexit, os, sys, threading

def threads_at_exit():
    names = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))
    print(f"threads at exit: {len(names)} {names} {[t.name for t in threading.enumerate()]}", flush=True)

atexit.register(threads_at_exit)

import torch
from torch.utils.data import TensorDataset
from train_multi_gpu import MultiGPUTrainer, TrainConfig

torch.manual_seed(0)
inputs, targets = torch.randn(48, 8), torch.randint(0, 3, (48,))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
config = TrainConfig(save_dir=sys.argv[1], epochs=1, batch_size=8, progress=False, dist_timeout=60)
if sys.argv[2] == "fit":
    validation = TensorDataset(inputs[:16], targets[:16])
    MultiGPUTrainer(model, TensorDataset(inputs, targets), validation, config=config).fit()
else:  # a trainer built only to predict, kept to the end of the script
    trainer = MultiGPUTrainer(model, TensorDataset(inputs, targets), None, config=config)
    trainer.predict(TensorDataset(inputs[:16], targets[:16]))
"""


WORKERS = 4  # processes of each torchrun job below


@pytest.mark.slow
def test_a_script_that_fits_or_predicts_and_simply_ends_exits_0_under_load(tmp_path):
    """Gloo's threads met interpreter finalization ("terminate called without an active exception", SIGABRT) in
    3 of 5 such runs of 2 processes on a busy machine: the trainer that set up the group destroys it, and its
    threads end, at exit. What decides it is seen directly: each process prints the threads still alive when the
    interpreter finalizes, and only its main thread may be left. So one torchrun job of 4 fit processes and one of
    4 predict-only processes, side by side beside 2 busy loops (ten processes on two cores), prove it; the 20
    processes this test once ran only repeated the same count (and took 2.5 minutes of CI's 25)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT_THAT_ENDS)
    runs = {"fit-0": "fit", "predict-0": "predict"}
    results = {}
    with busy_cpus(2):
        started = {
            name: subprocess.Popen(
                cli_command([str(tmp_path / name), kind], nproc=WORKERS, script=script),
                cwd=tmp_path,
                env=cli_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name, kind in runs.items()
        }
        for name, process in started.items():
            output = process.communicate(timeout=RUN_TIMEOUT)[0]
            results[name] = process.returncode, output
    failed = {name: output[-2000:] for name, (code, output) in results.items() if code != 0}
    assert not failed, f"{len(failed)} of {len(runs)} runs failed: {failed}"
    for name, (_, output) in results.items():  # searched, not read by line: the ranks share one pipe
        assert re.findall(r"threads at exit: (\d+) ", output) == ["1"] * WORKERS, (name, output)


# Calls that make the host wait for the device (on CUDA): reading a tensor's value, or synchronising.
HOST_SYNCS = [
    (torch.Tensor, name) for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
] + [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "elapsed_time")]
FRAMEWORK = (
    str(Path(__file__).resolve().parent.parent / "multigpu"),
    str(Path(__file__).resolve().parent.parent / "train_multi_gpu.py"),
)


def host_syncs_in_fit(monkeypatch, tmp_path: Path, steps: int, log_every: int, callbacks: tuple = ()) -> int:
    """How many host-sync calls the framework's own code makes in a fit() of `steps` steps. Calls from torch
    itself (AdamW reads its CPU step counter each step) are not the trainer's: a plain loop makes them too."""
    calls: list[str] = []
    with monkeypatch.context() as patch:
        for owner, name in HOST_SYNCS:

            def counted(*args, _original=getattr(owner, name), **kwargs):  # noqa: B008
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(FRAMEWORK):
                    calls.append(caller)
                return _original(*args, **kwargs)

            patch.setattr(owner, name, counted)
        config = config_for(tmp_path / f"{steps}-{log_every}", 1, epochs=1, log_every=log_every)
        MultiGPUTrainer(tiny_model(), blobs(8 * steps, 0), None, config, callbacks=callbacks).fit()
    return len(calls)


def test_training_adds_no_host_sync_per_step_only_per_logging_interval(monkeypatch, tmp_path):
    once = host_syncs_in_fit(monkeypatch, tmp_path, steps=4, log_every=4)  # one interval; start and end
    assert host_syncs_in_fit(monkeypatch, tmp_path, steps=32, log_every=32) == once  # 8x the steps: no more
    per_interval = host_syncs_in_fit(monkeypatch, tmp_path, steps=8, log_every=4) - once
    assert per_interval > 0  # the sync point reads the interval, and the counter sees it
    assert host_syncs_in_fit(monkeypatch, tmp_path, steps=32, log_every=4) == once + 7 * per_interval


class LogsEachStep:
    def on_step_end(self, trainer):
        trainer.log(
            {
                "mine/lr_tensor": trainer.optimizer.param_groups[0]["lr"]
                * torch.ones((), device=trainer.device)
            }
        )


def test_own_scalars_and_the_ema_add_no_host_sync_per_step(monkeypatch, tmp_path):
    once = host_syncs_in_fit(
        monkeypatch, tmp_path / "4", steps=4, log_every=4, callbacks=(LogsEachStep(), EMA(0.9))
    )
    assert (
        host_syncs_in_fit(
            monkeypatch, tmp_path / "32", steps=32, log_every=32, callbacks=(LogsEachStep(), EMA(0.9))
        )
        == once
    )


class LogitsWatcher(torch.nn.Module):
    """tiny_model's layers; during each training backward it notes whether that step's logits are still alive."""

    def __init__(self):
        super().__init__()
        self.layers = tiny_model()
        self.logits_alive_in_backward: list[bool] = []

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.layers[1](self.layers[0](inputs))
        logits: weakref.ref[torch.Tensor]  # set below, read in the backward
        if (
            hidden.requires_grad
        ):  # training: its gradient arrives after the loss's and the last layer's backward
            hidden.register_hook(lambda grad: self.logits_alive_in_backward.append(logits() is not None))
        outputs = self.layers[2](hidden)
        logits = weakref.ref(outputs)
        return outputs


def test_a_steps_logits_are_freed_before_its_backward_not_after(tmp_path):
    """No backward needs the logits, so once the loss is computed nothing may keep them: the memory peak of a large
    vocabulary's logits does not last through the whole backward."""
    model = LogitsWatcher()
    MultiGPUTrainer(model, blobs(32, 0), None, config_for(tmp_path, 1, epochs=1)).fit()
    training = model.logits_alive_in_backward[-4:]  # 32 samples, batch 8 (before them: the FLOP count's pass)
    assert training == [False] * 4


def test_max_steps_ends_mid_epoch_on_its_schedule_and_a_resume_reaches_it_bit_identically(tmp_path):
    """--max-steps 13 with 8 steps per epoch: training ends in epoch 2 at step 13, evaluated and saved there, the
    cosine schedule at its end; a run that died at step 7 resumes from its step-5 checkpoint to the same weights."""

    def trainer(name: str, **extra) -> MultiGPUTrainer:
        torch.manual_seed(0)
        config = config_for(tmp_path / name, 1, epochs=3, max_steps=13, lr_schedule="cosine", **extra)
        return MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config)

    with trainer("whole") as whole:
        assert whole.steps_per_epoch == 8 and whole.total_steps == 13
        summary = whole.fit()
        assert (summary["global_step"], summary["epochs"], whole.progress.samples_in_epoch) == (13, 1, 5 * 8)
        assert whole.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
        final = checkpoint.load(str(tmp_path / "whole" / "ckpt" / "last.pt"))
        assert final["global_step"] == 13 and final["evaluated"] and "val_acc" in final["metrics"]
    with pytest.raises(Exception, match="already at --max-steps 13"):
        with trainer("whole", resume="auto") as again:
            again.fit()

    torch.manual_seed(0)
    config = config_for(tmp_path / "cut", 1, epochs=3, max_steps=13, lr_schedule="cosine", save_every_steps=5)
    with pytest.raises(RuntimeError, match="killed"):
        with MultiGPUTrainer(tiny_model(), blobs(64, 0), blobs(16, 1), config, callbacks=[CrashAt(7)]) as cut:
            cut.fit()
    with trainer("cut", save_every_steps=5, resume="auto") as resumed:
        assert resumed.fit()["global_step"] == 13
        for name, tensor in resumed.model.state_dict().items():
            assert torch.equal(tensor, whole.model.state_dict()[name]), name


def _fitted_regression(config, validation: bool = True) -> dict:
    """fit() of the regression model on 64 samples (8 steps an epoch at batch 8), 30 validation samples."""
    val = regression_set(30, 1) if validation else None
    trainer = MultiGPUTrainer(
        regression_model(), regression_set(64, 0), val, config, loss_fn=torch.nn.functional.mse_loss
    )
    return trainer.fit()


def test_eval_every_steps_evaluates_and_keeps_the_best_inside_epochs_too(tmp_path):
    config = config_for(tmp_path, 1, epochs=2, eval_every_steps=3, lr=0.002)
    summary = _fitted_regression(config)
    losses = read_scalars(Path(config.tensorboard_dir))["val/loss"]
    assert [step for step, _ in losses] == [3, 6, 8, 9, 12, 15, 16]  # every 3 steps, and each epoch's end
    best = checkpoint.load(str(Path(config.save_dir) / "best.pt"))
    assert best["best_value"] == summary["best"] == pytest.approx(min(value for _, value in losses), rel=1e-6)
    assert best["global_step"] == min(losses, key=lambda logged: logged[1])[0]


def test_early_stopping_counts_the_evaluations_inside_an_epoch(tmp_path, capsys):
    config = config_for(tmp_path, 1, epochs=3, eval_every_steps=2, lr=0.0, early_stop_patience=2)
    summary = _fitted_regression(config)  # lr 0: the first evaluation's loss never improves
    assert summary["global_step"] == 6 and summary["epochs"] == 0  # stopped at the third, inside epoch 1
    assert [step for step, _ in read_scalars(Path(config.tensorboard_dir))["val/loss"]] == [2, 4, 6]
    assert "epoch 1/3 at step 6 (--eval-every-steps): val loss" in capsys.readouterr().out
    assert checkpoint.load(str(Path(config.save_dir) / "last.pt"))["global_step"] == 6


def test_warmup_steps_raise_the_lr_linearly_over_that_many_steps(tmp_path):
    config = config_for(tmp_path, 1, epochs=1, warmup_steps=4, lr=0.01, lr_schedule="constant", log_every=1)
    _fitted_regression(config, validation=False)
    rates = [value for _, value in read_scalars(Path(config.tensorboard_dir))["train/lr"]]
    assert rates == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01, 0.01, 0.01])
