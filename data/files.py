"""The files of on-disk data sets, checked at start so that a bad one is named before training, not mid-epoch.

- imagefolder: every folder readable and no symbolic link looping back to a folder
  that holds it, class folders present, val/'s classes a subset of train/'s (and
  labelled with train/'s numbers), every image's header readable; an image that
  still fails to decode mid-epoch (truncated after its header) is one line naming it.
- torchvision sets (MNIST family, CIFAR): when torchvision cannot load them,
  say which file is missing, corrupt or not yet extracted, or why --download failed.
"""

from __future__ import annotations

import os
import struct
from math import prod
from typing import Any, Callable

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
    for directory in (train_dir, val_dir):
        refuse_link_loops(directory)
    train = _folder(lambda: ImageFolder(train_dir, train_transform, loader=load_image), train_dir)
    val_classes = _folder(lambda: find_classes(val_dir)[0], val_dir)
    unknown = sorted(set(val_classes) - set(train.classes))
    if unknown:
        raise UsageError(
            f"--dataset imagefolder: {val_dir} has class folder(s) {', '.join(unknown)} that {train_dir} "
            f"lacks, so the model could never predict them; add them to train/ or remove them from val/"
        )

    class TrainClasses(ImageFolder):
        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            return train.classes, train.class_to_idx

    val = _folder(lambda: TrainClasses(val_dir, val_transform, loader=load_image, allow_empty=True), val_dir)
    if len(val) == 0:
        raise UsageError(f"--dataset imagefolder: {val_dir} holds no images in its class folders")
    check_image_headers([path for path, _ in train.samples + val.samples])
    return train, val


def refuse_link_loops(directory: str) -> None:
    """UsageError naming a folder under `directory` that cannot be read, or a symbolic link that leads back to a
    folder holding it. ImageFolder follows links (os.walk(followlinks=True)) with no end: such a link makes it
    load the same images again and again (16 images gave 656 samples) under ever longer paths."""
    real = os.path.realpath(directory)
    outside = {real}  # the real folders that hold `directory`: a link to one of them loops too
    while os.path.dirname(real) != real:
        real = os.path.dirname(real)
        outside.add(real)
    above = {directory: frozenset(outside)}  # each folder still to walk -> the real folders that hold it
    for folder, subfolders, _ in os.walk(directory, followlinks=True, onerror=_unreadable_folder):
        holding = above.pop(folder) | {os.path.realpath(folder)}
        for name in subfolders:
            path = os.path.join(folder, name)
            target = os.path.realpath(path)
            if target in holding:
                raise UsageError(
                    f"--dataset imagefolder: {path} is a symbolic link to {target}, a folder that "
                    f"holds it, so its images would be read again and again; remove the link"
                )
            above[path] = holding


def _unreadable_folder(error: OSError) -> None:
    raise UsageError(
        f"--dataset imagefolder: cannot read the folder {error.filename} "
        f"({error.strerror or error}); give this user read access to it"
    )


class UnreadableFile(UsageError):
    """A data file that fails to load mid-epoch: one line naming it, exit status 2 (bad input: retrying cannot
    help, replacing the file does), said by the rank that read it; training's failure path keeps the last
    checkpoint. A DataLoader worker's copy arrives with the worker's traceback as its message (torch re-raises
    `type(error)(text)`): only the last line, this error's own, is kept."""

    agreed = False  # met by one rank only: that rank says it (main_guarded)

    def __init__(self, message: str):
        last = message.rstrip().splitlines()[-1] if message.strip() else message
        super().__init__(last.split(f"{type(self).__name__}: ", 1)[-1])


def load_image(path: str) -> Any:
    """ImageFolder's loader (the file as an RGB PIL image), with a file that does not decode (truncated after a
    good header, damaged, unreadable) as an UnreadableFile naming it instead of PIL's traceback."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as file:
            return Image.open(file).convert("RGB")
    except (
        OSError,
        SyntaxError,
        EOFError,
    ) as error:  # PIL's "image file is truncated", "broken PNG file", ...
        reason = (
            "not an image PIL can read: damaged or cut short"
            if isinstance(error, UnidentifiedImageError)
            else (getattr(error, "strerror", None) or str(error) or type(error).__name__).splitlines()[0]
        )
        raise UnreadableFile(
            f"--dataset imagefolder: {path} cannot be read ({reason}); remove or replace it "
            f"(--resume auto then continues from the last checkpoint)"
        ) from None


def _folder(build: Callable[[], Any], directory: str) -> Any:
    try:
        return build()
    except FileNotFoundError as error:  # no class folders, or a class folder without images
        raise UsageError(
            f"--dataset imagefolder: {str(error).rstrip('.')} (one sub-folder of images per class, "
            f"e.g. {os.path.join(directory, 'cat', '1.jpg')})"
        ) from None


# How the formats ImageFolder accepts (and GIF) begin: a file that starts so needs no closer look.
IMAGE_MAGIC = (
    b"\xff\xd8\xff",
    b"\x89PNG\r\n\x1a\n",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
    b"GIF8",
    *(b"P%d" % kind for kind in range(1, 8)),
)


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
        raise UsageError(
            f"--dataset imagefolder: {bad[0][0]} is not a readable image ({bad[0][1]}){more}; "
            f"remove or replace it"
        )


def _pil_problem(path: str) -> str | None:
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


def idx_problem(path: str) -> str | None:
    """Why the IDX file at `path` is unusable (truncated, not IDX), or None if its size matches its header."""
    with open(path, "rb") as file:
        head = file.read(16)
    if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in IDX_ITEM_BYTES or not 1 <= head[3] <= 3:
        return "not an IDX file"
    ndim = head[3]
    if len(head) < 4 + 4 * ndim:
        return "truncated in its header"
    expected = (
        4 + 4 * ndim + prod(struct.unpack(f">{ndim}I", head[4 : 4 + 4 * ndim])) * IDX_ITEM_BYTES[head[2]]
    )
    size = os.path.getsize(path)
    if size != expected:
        return (
            f"{size} bytes where its header needs {expected}: {'truncated' if size < expected else 'damaged'}"
        )
    return None


def _file_states(
    dataset_class: type[Any], root: str
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str], list[str]]:
    """(unreadable files with why, corrupt files with why, missing files, compressed files not yet extracted)
    of a torchvision set."""
    from torchvision.datasets.utils import check_integrity

    unreadable, corrupt, missing, unextracted = [], [], [], []

    def sort_out(path: str, problem: Callable[[], str | None]) -> bool:
        """Whether the file at `path` is unusable, filed under unreadable or corrupt with why."""
        try:
            why = problem()
        except OSError as error:  # no read permission, an I/O error: named as such, not as corrupt
            unreadable.append((path, error.strerror or str(error)))
            return True
        if why:
            corrupt.append((path, why))
        return why is not None

    if hasattr(dataset_class, "resources"):  # the MNIST family: raw/NAME.gz, extracted to raw/NAME
        raw = os.path.join(root, dataset_class.__name__, "raw")
        for filename, md5 in dataset_class.resources:
            packed, unpacked = os.path.join(raw, filename), os.path.join(raw, os.path.splitext(filename)[0])
            if os.path.exists(unpacked):
                sort_out(unpacked, lambda: idx_problem(unpacked))
            elif not os.path.exists(packed):
                missing.append(unpacked)
            elif not sort_out(
                packed,
                lambda: (
                    None
                    if check_integrity(packed, md5)
                    else "checksum mismatch: a truncated or damaged download"
                ),
            ):
                unextracted.append(packed)
    else:  # CIFAR: the archive, and the batch files extracted from it
        folder = os.path.join(root, dataset_class.base_folder)
        for filename, md5 in dataset_class.train_list + dataset_class.test_list:
            path = os.path.join(folder, filename)
            if not os.path.exists(path):
                missing.append(path)
            else:
                sort_out(
                    path,
                    lambda: (
                        None
                        if check_integrity(path, md5)
                        else "checksum mismatch: a truncated or damaged file"
                    ),
                )
    return unreadable, corrupt, missing, unextracted


def torchvision_problem(
    name: str, dataset_class: type, root: str, download: bool, error: BaseException
) -> str:
    """One line for a torchvision set that failed to load: which file is corrupt, missing or not extracted,
    or why --download failed (`error` is what torchvision raised)."""
    unreadable, corrupt, missing, unextracted = _file_states(dataset_class, root)
    where = os.path.abspath(root)
    if unreadable:
        path, why = unreadable[0]
        return f"--dataset {name}: {path} cannot be read ({why}); give this user read access to it"
    if corrupt:
        path, why = corrupt[0]
        more = f" (and {len(corrupt) - 1} more)" if len(corrupt) > 1 else ""
        if download:
            return (
                f"--dataset {name}: {path} is corrupt ({why}){more} and --download could not fetch a good copy "
                f"({_download_reason(error)}); check the network, or copy a good file there"
            )
        return (
            f"--dataset {name}: {path} is corrupt ({why}){more}; pass --download to fetch it again, "
            f"or copy a good one there"
        )
    if download and (missing or unextracted):
        return (
            f"--dataset {name}: --download could not fetch the files into --data-dir {where} "
            f"({_download_reason(error)}); check the network, or copy the files there"
        )
    if unextracted:
        return (
            f"--dataset {name}: {unextracted[0]} is there but not extracted; pass --download to extract it "
            f"(nothing is fetched for complete files)"
        )
    if missing:
        return (
            f"--dataset {name}: files not found in --data-dir {where}; pass --download to fetch them "
            f"(or point --data-dir at a copy)"
        )
    return f"--dataset {name}: cannot read the files in --data-dir {where} ({_download_reason(error)})"


def _download_reason(error: BaseException) -> str:
    """The telling last line of torchvision's error ("<urlopen error [Errno 111] Connection refused>")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[-1].removeprefix("<urlopen error ").removesuffix(">")[:200]
