"""Data set registry (`--dataset`) and the data loaders of training and evaluation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from multigpu.config import TrainConfig
from multigpu.errors import UsageError

from .augment import RandomCropFlip
from .files import image_folders, torchvision_problem
from .sampler import ResumableDistributedSampler, ShardedBatchSampler
from .synthetic import SyntheticImages
from .text import CharWindows, text_datasets

__all__ = [
    "DataSpec",
    "build_datasets",
    "build_loader",
    "CharWindows",
    "RandomCropFlip",
    "ResumableDistributedSampler",
    "ShardedBatchSampler",
    "SyntheticImages",
]

TORCHVISION_SETS = {
    # name: (torchvision class, image shape, classes, mean, std)
    "mnist": ("MNIST", (1, 28, 28), 10, (0.1307,), (0.3081,)),
    "fashion-mnist": ("FashionMNIST", (1, 28, 28), 10, (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", (3, 32, 32), 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("CIFAR100", (3, 32, 32), 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@dataclass
class DataSpec:
    """The training and validation sets and what a model needs to know about them."""

    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]  # of one sample as the model sees it: (T,) for a window of characters
    num_classes: int  # of a text set: its vocabulary size
    warnings: list[str] = field(default_factory=list)  # one line each, printed by rank 0 before training
    collate_fn: Callable | None = None  # how samples become a batch (None: torch's default; padded text pads)
    notes: list[str] = field(
        default_factory=list
    )  # the plan's lines on the data, printed by rank 0 before training


class Flattened(Dataset):
    """Presents each CxHxW sample of `dataset` as a vector (--mode flatten)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.fixed_samples = getattr(dataset, "fixed_samples", False)  # flattening changes nothing of that

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a map-style set: it has __len__

    def __getitem__(self, index: int):
        image, target = self.dataset[index]
        return image.reshape(-1), target


def build_datasets(config: TrainConfig, download_allowed: bool = True) -> DataSpec:
    """The data sets named by --dataset, flattened for --mode flatten.

    `download_allowed` is False on every rank but 0, so one process downloads.
    """
    name = config.dataset
    train: Dataset  # each branch's own kind of set
    val: Dataset | None
    if name == "text":  # windows of character ids: nothing to flatten
        assert config.data_file is not None  # --dataset text without it is refused in TrainConfig
        train, val, vocabulary = text_datasets(config.data_file, config.block_size)
        return DataSpec(train, val, (config.block_size,), vocabulary)
    if (
        name == "hf" and config.text_kind is not None
    ):  # text as a transformers model's tokens (data/hf_text.py)
        from .hf_text import hf_text_datasets

        train, val, shape, classes, collate_fn, notes = hf_text_datasets(config)
        return DataSpec(train, val, shape, classes, collate_fn=collate_fn, notes=notes)  # type: ignore[arg-type]  # val: as below
    if name == "hf":  # local files through Hugging Face datasets (data/hf.py)
        from .hf import hf_datasets

        train, val, shape, classes = hf_datasets(config)
        return DataSpec(train, val, shape, classes)  # type: ignore[arg-type]  # val: None without --val-files
    if name in (
        "synthetic",
        "fake",
        "imagefolder",
    ):  # --image-shape sizes their samples: refused before any is made
        check_batch_fits_in_memory(config)
    if name == "synthetic":
        shape, classes = config.image_dims(), config.num_classes
        train = SyntheticImages(config.train_size, shape, classes, config.seed, "train")
        val = SyntheticImages(config.val_size, shape, classes, config.seed, "val")
    elif name == "fake":
        import torchvision

        shape, classes = config.image_dims(), config.num_classes
        to_tensor = torchvision.transforms.ToTensor()
        fake = torchvision.datasets.FakeData(config.train_size, shape, classes, to_tensor, random_offset=0)
        fake.fixed_samples = True  # each image drawn from a generator seeded by its index (device_data.py)
        train = fake
        val = torchvision.datasets.FakeData(config.val_size, shape, classes, to_tensor, random_offset=10**6)
    elif name == "imagefolder":
        train, val, shape, classes = _image_folder(config)
    else:
        train, val, shape, classes = _torchvision_set(config, download_allowed)
    warnings = [one_class_warning(config, train)] if classes == 1 else []
    if config.mode == "flatten":
        train, val = Flattened(train), Flattened(val)
        return DataSpec(train, val, (shape[0] * shape[1] * shape[2],), classes, warnings)
    return DataSpec(train, val, tuple(shape), classes, warnings)


def one_class_warning(config: TrainConfig, train: Dataset) -> str:
    """The warning for a training set of one class: every label is the same, so there is nothing to learn."""
    if config.dataset == "imagefolder":
        which, fix = f"one class folder ({train.classes[0]})", "add a sub-folder of train/ per class"  # type: ignore[attr-defined]  # an ImageFolder
    else:
        which, fix = "one class (--num-classes 1)", "use --num-classes 2 or more"
    return (
        f"warning: --dataset {config.dataset} has {which}: every label is the same, so the loss is 0 from the "
        f"first step and the model learns nothing; {fix}"
    )


def check_batch_fits_in_memory(config: TrainConfig) -> None:
    """UsageError when one batch of --image-shape images (4 bytes a value) would not fit in the memory available
    now: refused before anything is allocated, where it would otherwise take the machine's memory until the
    kernel's OOM killer ends the run (or another process)."""
    channels, height, width = config.image_dims()
    batch = max(
        (size for size in (config.batch_size, config.eval_batch_size) if isinstance(size, int)), default=1
    )
    needed, available = batch * channels * height * width * 4, available_memory()
    if available is not None and needed > available:
        raise UsageError(
            f"--image-shape {config.image_shape}: one batch of {batch} such images takes "
            f"{_gigabytes(needed)}, more than the {_gigabytes(available)} of memory available; use smaller "
            f"images or a smaller --batch-size"
        )


def available_memory() -> int | None:
    """Bytes of memory available to new allocations now (Linux's MemAvailable, which counts the page cache the
    kernel can drop), else the free pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gigabytes(count: int) -> str:
    return f"{count / 1e9:,.1f} GB"


def _torchvision_set(config: TrainConfig, download_allowed: bool):
    import torchvision
    from torchvision import transforms

    class_name, shape, classes, mean, std = TORCHVISION_SETS[config.dataset]
    dataset_class = getattr(torchvision.datasets, class_name)
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    download = config.download and download_allowed
    try:
        train = dataset_class(config.data_dir, train=True, download=download, transform=normalize)
        val = dataset_class(config.data_dir, train=False, download=download, transform=normalize)
    except (RuntimeError, OSError, ValueError, TypeError, AssertionError) as error:  # what torchvision raises
        raise UsageError(
            torchvision_problem(config.dataset, dataset_class, config.data_dir, download, error)
        ) from None
    train.fixed_samples = (
        True  # normalised, not augmented: --data-on-device may read it once (device_data.py)
    )
    if shape[0] == 3:  # CIFAR's training augmentation; the padding is black, -mean/std once normalised
        train = RandomCropFlip(train, padding=4, fill=[-m / s for m, s in zip(mean, std)])
    return train, val, shape, classes


def _image_folder(config: TrainConfig):
    from torchvision import transforms

    channels, height, width = config.image_dims()
    missing = [split for split in ("train", "val") if not os.path.isdir(os.path.join(config.data_dir, split))]
    if missing:
        raise UsageError(
            f"--dataset imagefolder needs {', '.join(s + '/' for s in missing)} inside --data-dir "
            f"{os.path.abspath(config.data_dir)} (one sub-folder per class)"
        )
    to_tensor = [transforms.Resize((height, width)), transforms.ToTensor()]
    if channels == 1:
        to_tensor.insert(0, transforms.Grayscale())
    train_transform = transforms.Compose([transforms.RandomHorizontalFlip()] + to_tensor)
    train, val = image_folders(config.data_dir, train_transform, transforms.Compose(to_tensor))
    return train, val, (channels, height, width), len(train.classes)


def check_num_workers(workers: int) -> None:
    """UsageError for more loader workers than 4 per CPU core this process may use: each is a process with its
    own copy of the data set, and 100000 of them hang the machine before the first batch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers > 4 * cores:
        raise UsageError(
            f"--num-workers {workers} is more than 4 per CPU core ({cores} cores here), and each worker "
            f"is a process; use at most {4 * cores} (the default: 0 on CPU, 4 per GPU)"
        )


def default_num_workers(device: torch.device) -> int:
    """0 on CPU (workers would compete with the training processes for cores), 4 per GPU."""
    return 4 if device.type == "cuda" else 0


def build_loader(
    dataset: Dataset,
    device: torch.device,
    num_workers: int | None,
    seed: int = 0,
    *,
    sampler: Sampler | None = None,
    batch_size: int | None = None,
    batch_sampler: Sampler | None = None,
    collate_fn: Callable | None = None,
    persistent_workers: bool = True,
) -> DataLoader:
    """A DataLoader with the settings that matter for speed on GPUs.

    Pinned memory lets the trainer's non_blocking copies overlap with compute;
    persistent workers are not restarted every epoch (unless `persistent_workers=False`: a stream's workers
    must see where each pass resumes). `collate_fn` is the user's
    (None: torch's default, which stacks tensors inside any tuple/dict nesting). The generator makes the
    workers' base seeds a function of `seed`, so augmentation repeats on a rerun.
    """
    workers = default_num_workers(device) if num_workers is None else num_workers
    check_num_workers(workers)
    return DataLoader(
        dataset,
        batch_size=batch_size if batch_sampler is None else 1,
        sampler=sampler,
        batch_sampler=batch_sampler,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=persistent_workers and workers > 0,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=collate_fn,
    )
