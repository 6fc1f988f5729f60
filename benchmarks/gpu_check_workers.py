"""The parts of the GPU check that need the Python API; gpu_check.py runs each in its own process.

    python benchmarks/gpu_check_workers.py NAME '{"param": value}'
    python -m torch.distributed.run --standalone --nproc_per_node=N benchmarks/gpu_check_workers.py NAME '{...}'

Rank 0 prints one line `GPU_CHECK_RESULT {json}` with the figures; a failed
check raises (exit 1). Each worker decides nothing: it measures, and the row
in gpu_check.py judges. Models and data are built here from torch and
torchvision alone, so the check depends only on the trainer's public API
(`MultiGPUTrainer`, `TrainConfig`, `main_multi_gpu.main`, `multigpu.parallel.distributed.setup/teardown`).
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_common import reset_cuda_peak  # noqa: E402  (after the path set-up)

RESULT = "GPU_CHECK_RESULT "
WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def worker(
    function: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Register `function` under its name with '-' for '_' (the NAME on the command line)."""
    WORKERS[function.__name__.replace("_", "-")] = function
    return function


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files under `log_dir`, as {tag: [(step, value), ...]} by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(
                (event.step, event.value) for event in accumulator.Scalars(tag)
            )
    return {tag: sorted(values) for tag, values in scalars.items()}


# ---------------------------------------------------------------------------- models and data
def class_blobs(size: int, shape: tuple[int, ...], classes: int = 10, seed: int = 0) -> TensorDataset:
    """Learnable data, the same in every process: one random prototype per class plus noise."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(classes, *shape, generator=generator)
    targets = torch.randint(classes, (size,), generator=generator)
    return TensorDataset(prototypes[targets] + torch.randn(size, *shape, generator=generator), targets)


class RepeatedImages(Dataset):
    """`size` samples cycling through a small pool of random images: throughput data that costs little memory."""

    def __init__(self, size: int, shape: tuple[int, ...], classes: int, pool: int = 256):
        generator = torch.Generator().manual_seed(0)
        self.size = size
        self.images = torch.randn(min(pool, size), *shape, generator=generator)
        self.targets = torch.randint(classes, (len(self.images),), generator=generator)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % len(self.images)], self.targets[index % len(self.images)]


def small_net(channels: int, classes: int, batchnorm: bool = False) -> nn.Module:
    """A small conv net, the same initial weights in every process; with `batchnorm`, one BatchNorm2d and one
    BatchNorm1d."""
    torch.manual_seed(0)
    norm2d: list[nn.Module] = [nn.BatchNorm2d(16)] if batchnorm else []
    norm1d: list[nn.Module] = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        *norm2d,
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(256, 32),
        *norm1d,
        nn.ReLU(),
        nn.Linear(32, classes),
    )


def throughput_model(name: str, shape: tuple[int, ...], classes: int) -> nn.Module:
    """torchvision's ResNet-50 (untrained) for the real check; the small net in a dry run."""
    if name == "resnet50":
        import torchvision

        torch.manual_seed(0)
        return torchvision.models.resnet50(weights=None, num_classes=classes)
    return small_net(shape[0], classes)


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def device_of(model: nn.Module) -> str:
    """Where the trainer put the model (from its public `.model`)."""
    return str(next(model.parameters()).device)


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_memory(device: torch.device) -> int | None:
    """torch.cuda.max_memory_allocated since the last reset; None off CUDA, where it is not measured."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        reset_cuda_peak(device)


# ---------------------------------------------------------------------------- workers
@worker
def cli(params: dict[str, Any]) -> dict[str, Any]:
    """main_multi_gpu.py's main() in this process, then every GPU's peak memory (which a CLI run does not report)."""
    import main_multi_gpu

    status = main_multi_gpu.main(params["argv"])
    peaks = [torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count())]
    return {"exit": status, "max_memory_allocated": peaks}


class OverflowProbe(nn.Module):
    """Cross-entropy made infinite at optimizer step `bad_step`, recording what the check needs.

    Called once per optimizer step (one micro-batch per step, no validation set),
    so its call count is the step. It records the loss scale each step used and
    the weights before steps bad-1, bad and bad+1: a skipped step leaves the
    weights before bad+1 equal to those before bad.
    """

    def __init__(self, bad_step: int):
        super().__init__()
        self.loss = nn.CrossEntropyLoss()
        self.bad_step, self.calls = bad_step, 0
        self.scales: list[float] = []
        self.weights: dict[int, torch.Tensor] = {}
        self.trainer: Any = None

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scales.append(self.trainer.scaler.get_scale())  # a host sync per step: fine in a check
        if abs(self.calls - self.bad_step) <= 1:
            self.weights[self.calls] = flat_weights(self.trainer.model)
        loss = self.loss(outputs, targets)
        return loss * math.inf if self.calls == self.bad_step else loss


@worker
def fp16_overflow(params: dict[str, Any]) -> dict[str, Any]:
    """Train in fp16 with one injected inf loss: which steps the GradScaler skipped, and what the trainer logged."""
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    bad = params["bad_step"]
    probe = OverflowProbe(bad)
    config = TrainConfig(
        multi_gpu="none",
        amp="fp16",
        epochs=1,
        batch_size=params["batch"],
        lr=1e-3,
        log_every=params["log_every"],
        num_workers=0,
        progress=False,
        save_dir=params["save_dir"],
    )
    trainer = MultiGPUTrainer(
        small_net(3, 10), class_blobs(params["samples"], (3, 16, 16)), None, config, loss_fn=probe
    )
    if not torch.cuda.is_available():
        # --amp fp16 is CUDA-only (the CPU falls back to bf16 without a scaler); a CPU GradScaler runs
        # the trainer's same scale/step/update path, so the dry run checks this worker's logic.
        trainer.amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what trainer.scaler returns
    probe.trainer = trainer
    trainer.fit()
    scales = probe.scales + [trainer.scaler.get_scale()]  # scales[i]: the scale of step i + 1
    skipped = [step for step in range(1, len(scales)) if scales[step] < scales[step - 1]]
    logged = read_scalars(os.path.join(params["save_dir"], "tb"))
    return {
        "device": device_of(trainer.model),
        "steps": probe.calls,
        "injected_step": bad,
        "skipped_steps_seen": skipped,
        "skipped_steps_logged": sum(value for _, value in logged.get("train/skipped_steps", [])),
        "loss_scale_logged": [value for _, value in logged.get("train/loss_scale", [])],
        "scale_before": scales[bad - 1],
        "scale_after": scales[bad],
        "weights_unchanged_at_injected_step": torch.equal(probe.weights[bad], probe.weights[bad + 1]),
        "weights_changed_at_step_before": not torch.equal(probe.weights[bad - 1], probe.weights[bad]),
    }


@worker
def sync_bn(params: dict[str, Any]) -> dict[str, Any]:
    """Train a net with two BatchNorm layers, under torchrun with --sync-bn or in one process without it.

    fp32 without TF32, so several GPUs can be compared with one process holding
    the whole batch. Rank 0 saves the final state to params["state_out"].
    """
    from multigpu.parallel.distributed import launched_by_torchrun, setup, teardown
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    config = TrainConfig(
        multi_gpu="ddp" if launched_by_torchrun() else "none",
        sync_bn=params["sync_bn"],
        epochs=1,
        batch_size=params["batch"],
        optimizer="sgd",
        lr=0.05,
        num_workers=0,
        log_every=params["log_every"],
        progress=False,
        save_dir=params["save_dir"],
    )
    runtime = setup(config)
    model = small_net(3, 10, batchnorm=True)
    batchnorm = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    trainer = MultiGPUTrainer(
        model, class_blobs(params["samples"], (3, 16, 16)), None, config, runtime=runtime
    )
    synced = sum(isinstance(m, nn.SyncBatchNorm) for m in trainer.model.modules())
    trainer.fit()
    result: dict[str, Any] = {}
    if runtime.is_main:
        torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}, params["state_out"])
        losses = [value for _, value in read_scalars(os.path.join(params["save_dir"], "tb"))["train/loss"]]
        result = {
            "world_size": runtime.world_size,
            "mode": runtime.mode,
            "device": str(runtime.device),
            "batchnorm_layers": batchnorm,
            "sync_batchnorm_layers": synced,
            "losses": losses,
        }
    del trainer
    teardown()
    return result


@torch.no_grad()
def copy_rates(shape: tuple[int, ...], steps: int) -> dict[str, dict[str, float]]:
    """Steps/s of copy-to-GPU (non_blocking) plus a conv, from pinned and from pageable memory.

    `host_wait_ms` is how long the copy call holds the host: a pinned
    non_blocking copy is only queued, a pageable one is a synchronising copy.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    conv = nn.Conv2d(shape[1], 16, 3, padding=1).to(device)
    host = torch.randn(shape)
    rates = {}
    for name, source in (("pinned", host.pin_memory()), ("pageable", host)):
        for _ in range(3):  # warm-up: allocator, kernels
            conv(source.to(device, non_blocking=True))
        torch.cuda.synchronize()
        waits, started = [], time.perf_counter()
        for _ in range(steps):
            before = time.perf_counter()
            inputs = source.to(device, non_blocking=True)
            waits.append(time.perf_counter() - before)
            conv(inputs)
        torch.cuda.synchronize()
        rates[name] = {
            "steps_per_sec": steps / (time.perf_counter() - started),
            "host_wait_ms": 1000 * statistics.median(waits),
        }
    return rates


@worker
def data_path(params: dict[str, Any]) -> dict[str, Any]:
    """Whether the trainer's training loader pins memory on this device, and pinned vs pageable copy rates."""
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    config = TrainConfig(
        multi_gpu="none",
        epochs=1,
        batch_size=8,
        progress=False,
        save_dir=params["save_dir"],
        data_on_device="off",
    )  # the loader's path is what this row proves
    trainer = MultiGPUTrainer(small_net(3, 10), class_blobs(64, (3, 16, 16)), None, config)
    result: dict[str, Any] = {
        "device": device_of(trainer.model),
        "loader_pin_memory": trainer.train_loader.pin_memory,
        "loader_workers": trainer.train_loader.num_workers,
    }
    del trainer
    if torch.cuda.is_available():
        result["copy"] = copy_rates(tuple(params["batch_shape"]), params["steps"])
    return result


def steady_rate(interval_rates: list[float]) -> float:
    """Samples/s over every log interval but the first (start-up, allocator and kernel warm-up).

    The intervals hold equal numbers of samples, so the rate over them is the harmonic mean.
    """
    rates = interval_rates[1:]
    return len(rates) / sum(1.0 / rate for rate in rates)


def trainer_rate(params: dict[str, Any], amp: str, runtime: Any, save_dir: str) -> tuple[float, int | None]:
    """MultiGPUTrainer's samples/s (whole job) from its TensorBoard train/samples_per_sec, and its peak memory
    from memory/max_allocated_gb (its telemetry resets CUDA's peak at each sync point, the last one after the
    last step, so torch's counter after fit() holds only what came after training); (0, None) off rank 0."""
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    config = TrainConfig(
        multi_gpu=runtime.mode,
        amp=amp,
        epochs=1,
        batch_size=params["batch"],
        num_workers=params["workers"],
        log_every=params["log_every"],
        lr_schedule="constant",
        progress=False,
        save_dir=save_dir,
    )
    shape = tuple(params["image_shape"])
    model = throughput_model(params["model"], shape, params["classes"])
    data = RepeatedImages(params["steps"] * params["batch"] * runtime.world_size, shape, params["classes"])
    trainer = MultiGPUTrainer(model, data, None, config, runtime=runtime)
    trainer.fit()
    del trainer
    if not runtime.is_main:
        return 0.0, None
    scalars = read_scalars(os.path.join(save_dir, "tb"))
    rates = [value for _, value in scalars["train/samples_per_sec"]]
    peaks = [value for _, value in scalars.get("memory/max_allocated_gb", [])]
    shutil.rmtree(save_dir)  # a ResNet-50 checkpoint with its AdamW state is 300 MB
    return steady_rate(rates), round(max(peaks) * 2**30) if peaks else None


def raw_rate(params: dict[str, Any], amp: str, runtime: Any) -> float:
    """A minimal hand-written loop in the same process layout: DDP over the ranks (or the bare model in one
    process), AdamW, the same loader settings, a host sync only every log_every steps, as the trainer."""
    device, world = runtime.device, runtime.world_size
    shape = tuple(params["image_shape"])
    model = throughput_model(params["model"], shape, params["classes"]).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = RepeatedImages(params["steps"] * params["batch"] * world, shape, params["classes"])
    sampler = DistributedSampler(data, num_replicas=world, rank=runtime.rank, seed=0, drop_last=True)
    loader = DataLoader(
        data,
        batch_size=params["batch"],
        sampler=sampler,
        num_workers=params["workers"],
        pin_memory=device.type == "cuda",
    )
    loss_fn = nn.CrossEntropyLoss()
    dtype = torch.bfloat16 if amp == "bf16" else None
    rates, started = [], time.perf_counter()
    for step, (inputs, targets) in enumerate(loader, start=1):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % params["log_every"] == 0:
            loss.item()  # the host waits for the device here only, as at the trainer's sync points
            now = time.perf_counter()
            rates.append(params["log_every"] * params["batch"] * world / (now - started))
            started = now
    return steady_rate(rates)


@worker
def throughput(params: dict[str, Any]) -> dict[str, Any]:
    """Trainer vs raw loop, alternating which goes first, for each precision in params["amps"]; peak memory of each."""
    from multigpu.parallel.distributed import setup, teardown
    from train_multi_gpu import TrainConfig

    runtime = setup(TrainConfig(multi_gpu="auto"))
    rates: dict[str, dict[str, list[float]]] = {amp: {"trainer": [], "raw": []} for amp in params["amps"]}
    memory: dict[str, dict[str, int | None]] = {amp: {"trainer": None, "raw": None} for amp in params["amps"]}
    for amp in params["amps"]:
        for round_index in range(params["rounds"]):
            for loop in ("trainer", "raw") if round_index % 2 == 0 else ("raw", "trainer"):
                reset_peak_memory(runtime.device)
                save_dir = os.path.join(params["tmp"], f"{amp}-{round_index}-{loop}")
                if loop == "trainer":
                    rate, peak = trainer_rate(params, amp, runtime, save_dir)
                else:
                    rate, peak = raw_rate(params, amp, runtime), peak_memory(runtime.device)
                rates[amp][loop].append(rate)
                if runtime.is_main:  # progress, and the last words if the check runs out of time
                    print(f"amp {amp}, round {round_index + 1}: {loop} {rate:.0f} samples/s", flush=True)
                if peak is not None:
                    memory[amp][loop] = max(memory[amp][loop] or 0, peak)
                free_cuda()
    result = {
        "world_size": runtime.world_size,
        "device": str(runtime.device),
        "samples_per_sec": rates,
        "max_memory_allocated": memory,
    }
    teardown()
    return result


def timed_predict(trainer: Any, data: Dataset) -> tuple[torch.Tensor, float]:
    """trainer.predict(data) after a warm-up call, and its wall time (it returns complete CPU tensors)."""
    trainer.predict(data)
    started = time.perf_counter()
    outputs = trainer.predict(data)
    return outputs, time.perf_counter() - started


@worker
def predict(params: dict[str, Any]) -> dict[str, Any]:
    """MultiGPUTrainer.predict on this run's devices (DDP over the GPUs under torchrun) against the same model
    on the CPU, fp32 without TF32: the largest difference, whether both are in dataset order, and their times."""
    from multigpu.parallel.distributed import Runtime, setup, teardown
    from train_multi_gpu import MultiGPUTrainer, TrainConfig

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    config = TrainConfig(
        multi_gpu="auto",
        eval_batch_size=params["batch"],
        num_workers=0,
        progress=False,
        save_dir=params["save_dir"],
    )
    runtime = setup(config)
    data = class_blobs(params["samples"], tuple(params["shape"]))
    device_trainer = MultiGPUTrainer(small_net(params["shape"][0], 10), data, None, config, runtime=runtime)
    outputs, seconds = timed_predict(device_trainer, data)
    result: dict[str, Any] = {}
    if runtime.is_main:
        cpu_trainer = MultiGPUTrainer(
            small_net(params["shape"][0], 10),
            data,
            None,
            config,
            runtime=Runtime("none", torch.device("cpu")),
        )
        reference, cpu_seconds = timed_predict(cpu_trainer, data)
        inputs = data.tensors[0][: params["batch"]]
        with torch.no_grad():  # the first batch through the plain CPU model: the outputs are in dataset order
            in_order = torch.allclose(reference[: len(inputs)], cpu_trainer.model(inputs), atol=1e-6)
        result = {
            "device": str(runtime.device),
            "world_size": runtime.world_size,
            "samples": len(outputs),
            "max_abs_difference": (outputs.double() - reference.double()).abs().max().item(),
            "in_order": in_order,
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
        }
    del device_trainer
    teardown()
    return result


def main(argv: list[str]) -> int:
    from multigpu.tuning.gc_pauses import skip_the_collection_at_exit

    skip_the_collection_at_exit()  # as the trainer's commands: a second less at exit
    name, params = argv[0], json.loads(argv[1])
    result = WORKERS[name](params)
    if is_rank0():
        print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
