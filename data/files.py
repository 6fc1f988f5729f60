"""The files of on-disk data sets, checked at start so that a bad one is named before training, not mid-epoch.

- imagefolder: class folders present, val/'s classes a subset of train/'s (and
  labelled with train/'s numbers), every image's header readable.
- torchvision sets (MNIST family, CIFAR): when torchvision cannot load them,
  say which file is missing, corrupt or not yet extracted, or why --download failed.
"""

from __future__ import annotations

import os
import struct
from math import prod
from typing import Any, Callable, Optional

from multigpu.errors import UsageError


# ---------------------------------------------------------------- imagefolder
def image_folders(data_dir: str, train_transform: Callable, val_transform: Callable) -> tuple[Any, Any]:
    """ImageFolder data sets of `data_dir`/train and `data_dir`/val, checked; UsageError naming what is wrong.

    val/ is labelled with train/'s class numbers: torchvision numbers each folder's
    classes on its own, so a val/ that lacks one of train/'s classes would
    otherwise get shifted labels.
    """
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import find_classes

    train_dir, val_dir = os.path.join(data_dir, "train"), os.path.join(data_dir, "val")
    train = _folder(lambda: ImageFolder(train_dir, train_transform), train_dir)
    val_classes = _folder(lambda: find_classes(val_dir)[0], val_dir)
    unknown = sorted(set(val_classes) - set(train.classes))
    if unknown:
        raise UsageError(f"--dataset imagefolder: {val_dir} has class folder(s) {', '.join(unknown)} that {train_dir} "
                         f"lacks, so the model could never predict them; add them to train/ or remove them from val/")

    class TrainClasses(ImageFolder):
        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            return train.classes, train.class_to_idx

    val = _folder(lambda: TrainClasses(val_dir, val_transform, allow_empty=True), val_dir)
    if len(val) == 0:
        raise UsageError(f"--dataset imagefolder: {val_dir} holds no images in its class folders")
    check_image_headers([path for path, _ in train.samples + val.samples])
    return train, val


def _folder(build: Callable[[], Any], directory: str) -> Any:
    try:
        return build()
    except FileNotFoundError as error:  # no class folders, or a class folder without images
        raise UsageError(f"--dataset imagefolder: {str(error).rstrip('.')} (one sub-folder of images per class, "
                         f"e.g. {os.path.join(directory, 'cat', '1.jpg')})") from None


# How the formats ImageFolder accepts (and GIF) begin: a file that starts so needs no closer look.
IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"BM", b"II*\x00", b"MM\x00*", b"GIF8",
               *(b"P%d" % kind for kind in range(1, 8)))


def check_image_headers(paths: list[str]) -> None:
    """UsageError naming the first file that is not an image PIL can read (and how many there are).

    Reads 16 bytes per file (about 10 us each from the page cache); only a file
    without a known signature is handed to PIL's Image.open, which reads its header.
    """
    bad: list[tuple[str, str]] = []
    for path in paths:
        try:
            with open(path, "rb") as file:
                head = file.read(16)
        except OSError as error:
            bad.append((path, error.strerror or str(error)))
            continue
        if not (head.startswith(IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")):
            problem = _pil_problem(path)
            if problem:
                bad.append((path, problem))
    if bad:
        more = f" (and {len(bad) - 1} more such files)" if len(bad) > 1 else ""
        raise UsageError(f"--dataset imagefolder: {bad[0][0]} is not a readable image ({bad[0][1]}){more}; "
                         f"remove or replace it")


def _pil_problem(path: str) -> Optional[str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            return None
    except UnidentifiedImageError:
        return "not an image format PIL can read"
    except OSError as error:
        return error.strerror or str(error)


# ---------------------------------------------------------------- torchvision sets
# IDX (the MNIST files): 0, 0, item type, dimension count, then one big-endian uint32 per dimension.
IDX_ITEM_BYTES = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}


def idx_problem(path: str) -> Optional[str]:
    """Why the IDX file at `path` is unusable (truncated, not IDX), or None if its size matches its header."""
    with open(path, "rb") as file:
        head = file.read(16)
    if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in IDX_ITEM_BYTES or not 1 <= head[3] <= 3:
        return "not an IDX file"
    ndim = head[3]
    if len(head) < 4 + 4 * ndim:
        return "truncated in its header"
    expected = 4 + 4 * ndim + prod(struct.unpack(f">{ndim}I", head[4:4 + 4 * ndim])) * IDX_ITEM_BYTES[head[2]]
    size = os.path.getsize(path)
    if size != expected:
        return f"{size} bytes where its header needs {expected}: {'truncated' if size < expected else 'damaged'}"
    return None


def _file_states(dataset_class: type, root: str) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(corrupt files with why, missing files, compressed files not yet extracted) of a torchvision set."""
    from torchvision.datasets.utils import check_integrity

    corrupt, missing, unextracted = [], [], []
    if hasattr(dataset_class, "resources"):  # the MNIST family: raw/NAME.gz, extracted to raw/NAME
        raw = os.path.join(root, dataset_class.__name__, "raw")
        for filename, md5 in dataset_class.resources:
            packed, unpacked = os.path.join(raw, filename), os.path.join(raw, os.path.splitext(filename)[0])
            if os.path.exists(unpacked):
                problem = idx_problem(unpacked)
                if problem:
                    corrupt.append((unpacked, problem))
            elif not os.path.exists(packed):
                missing.append(unpacked)
            elif not check_integrity(packed, md5):
                corrupt.append((packed, "checksum mismatch: a truncated or damaged download"))
            else:
                unextracted.append(packed)
    else:  # CIFAR: the archive, and the batch files extracted from it
        folder = os.path.join(root, dataset_class.base_folder)
        for filename, md5 in dataset_class.train_list + dataset_class.test_list:
            path = os.path.join(folder, filename)
            if not os.path.exists(path):
                missing.append(path)
            elif not check_integrity(path, md5):
                corrupt.append((path, "checksum mismatch: a truncated or damaged file"))
    return corrupt, missing, unextracted


def torchvision_problem(name: str, dataset_class: type, root: str, download: bool, error: BaseException) -> str:
    """One line for a torchvision set that failed to load: which file is corrupt, missing or not extracted,
    or why --download failed (`error` is what torchvision raised)."""
    corrupt, missing, unextracted = _file_states(dataset_class, root)
    where = os.path.abspath(root)
    if corrupt:
        path, why = corrupt[0]
        more = f" (and {len(corrupt) - 1} more)" if len(corrupt) > 1 else ""
        if download:
            return (f"--dataset {name}: {path} is corrupt ({why}){more} and --download could not fetch a good copy "
                    f"({_download_reason(error)}); check the network, or copy a good file there")
        return (f"--dataset {name}: {path} is corrupt ({why}){more}; pass --download to fetch it again, "
                f"or copy a good one there")
    if download and (missing or unextracted):
        return (f"--dataset {name}: --download could not fetch the files into --data-dir {where} "
                f"({_download_reason(error)}); check the network, or copy the files there")
    if unextracted:
        return (f"--dataset {name}: {unextracted[0]} is there but not extracted; pass --download to extract it "
                f"(nothing is fetched for complete files)")
    if missing:
        return (f"--dataset {name}: files not found in --data-dir {where}; pass --download to fetch them "
                f"(or point --data-dir at a copy)")
    return f"--dataset {name}: cannot read the files in --data-dir {where} ({_download_reason(error)})"


def _download_reason(error: BaseException) -> str:
    """The telling last line of torchvision's error ("<urlopen error [Errno 111] Connection refused>")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[-1].removeprefix("<urlopen error ").removesuffix(">")[:200]
