"""Data set files checked at start (data/files.py): imagefolder class lists and image headers, torchvision files.

Each bad case's one-line CLI error is in test_bad_input.py; here is what the checks let through and why.
"""

from __future__ import annotations

import shutil

import pytest
from PIL import Image

from conftest import SHARED_DATA, image_folder
from multigpu.config import TrainConfig
from multigpu.data import build_datasets
from multigpu.data.files import check_image_headers, idx_problem
from multigpu.errors import UsageError


def test_val_without_some_of_trains_classes_keeps_trains_class_numbers(tmp_path):
    image_folder(tmp_path, {"train": ["cat", "dog", "fox"], "val": ["cat", "fox"]})
    data = build_datasets(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), image_shape="3,8,8"))
    assert data.num_classes == 3
    # torchvision alone would number val/'s fox 1 (dog's number in train/): every fox image mislabelled.
    assert sorted({label for _, label in data.val.samples}) == [0, 2]
    assert data.val.classes == ["cat", "dog", "fox"]


def test_image_headers_are_checked_by_content_not_name(tmp_path):
    paths = []
    for index, fmt in enumerate(["jpeg", "png", "bmp", "tiff", "gif", "webp", "ppm", "ico"]):
        paths.append(tmp_path / f"{index}.jpg")  # every one named .jpg, whatever it holds
        Image.new("RGB", (16, 16), (index, 0, 0)).save(paths[-1], format=fmt)
    check_image_headers(
        [str(path) for path in paths]
    )  # ico has no known signature: PIL decides, and reads it
    (tmp_path / "notes.jpg").write_text("not an image")
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(UsageError) as refused:
        check_image_headers(
            [str(path) for path in paths] + [str(tmp_path / "notes.jpg"), str(tmp_path / "empty.png")]
        )
    assert str(refused.value) == (
        f"--dataset imagefolder: {tmp_path / 'notes.jpg'} is not a readable image (not an "
        f"image format PIL can read) (and 1 more such files); remove or replace it"
    )


def test_idx_files_are_checked_against_their_header(tmp_path):
    raw = SHARED_DATA / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz"
    if not raw.exists():
        pytest.skip(f"real MNIST not available at {raw}")
    import gzip

    labels = gzip.decompress(raw.read_bytes())
    (tmp_path / "good").write_bytes(labels)
    (tmp_path / "short").write_bytes(labels[:-1])
    (tmp_path / "text").write_text("hello world, not IDX")
    assert idx_problem(str(tmp_path / "good")) is None
    assert idx_problem(str(tmp_path / "short")) == "10007 bytes where its header needs 10008: truncated"
    assert idx_problem(str(tmp_path / "text")) == "not an IDX file"


def test_mnist_gz_files_that_are_complete_but_not_extracted_say_download_extracts_them(mnist_root):
    with pytest.raises(
        UsageError,
        match=r"train-images-idx3-ubyte.gz is there but not extracted; pass --download "
        r"to extract it \(nothing is fetched for complete files\)",
    ):
        build_datasets(TrainConfig(dataset="mnist", data_dir=str(mnist_root)))
    data = build_datasets(TrainConfig(dataset="mnist", data_dir=str(mnist_root), download=True))
    assert (len(data.train), len(data.val)) == (60000, 10000)
    shutil.rmtree(mnist_root / "MNIST" / "raw")


def test_links_are_followed_once_and_a_link_back_up_is_refused(tmp_path):
    image_folder(tmp_path / "elsewhere", {"train": ["fox"]})
    image_folder(tmp_path / "images", {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    (tmp_path / "images" / "train" / "fox").symlink_to(
        tmp_path / "elsewhere" / "train" / "fox"
    )  # a linked class
    config = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path / "images"), image_shape="3,8,8")
    assert len(build_datasets(config).train) == 6  # 3 classes x 2 images: the link read once
    (tmp_path / "images" / "train" / "dog" / "up").symlink_to(tmp_path / "images")
    with pytest.raises(
        UsageError,
        match=f"{tmp_path}/images/train/dog/up is a symbolic link to {tmp_path}/images, "
        f"a folder that holds it",
    ):
        build_datasets(config)  # torchvision alone read 324 samples from these 4 images (up/train/dog/up/...)


def test_a_training_set_of_one_class_is_a_warning(tmp_path):
    image_folder(tmp_path, {"train": ["cat"], "val": ["cat"]})
    data = build_datasets(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), image_shape="3,8,8"))
    assert data.warnings == [
        "warning: --dataset imagefolder has one class folder (cat): every label is the same, "
        "so the loss is 0 from the first step and the model learns nothing; add a sub-folder "
        "of train/ per class"
    ]
    assert (
        build_datasets(TrainConfig(num_classes=1, train_size=8, val_size=8))
        .warnings[0]
        .startswith("warning: --dataset synthetic has one class (--num-classes 1)")
    )
    image_folder(tmp_path, {"train": ["dog"], "val": ["dog"]})
    assert (
        build_datasets(
            TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), image_shape="3,8,8")
        ).warnings
        == []
    )
