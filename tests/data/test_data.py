"""The data set registry: the built-in synthetic set, flatten mode and the torchvision sets."""

from __future__ import annotations

import pytest
import torch

from conftest import SHARED_DATA, tiny_text
from multigpu.config import TrainConfig
from multigpu.data import SyntheticImages, build_datasets
from multigpu.errors import UsageError


def test_synthetic_samples_are_a_pure_function_of_seed_and_index():
    first, again = SyntheticImages(50, (3, 8, 8), 5, seed=3), SyntheticImages(50, (3, 8, 8), 5, seed=3)
    for index in (0, 17, 49):
        assert torch.equal(first[index][0], again[index][0]) and first[index][1] == again[index][1]
    other_seed = SyntheticImages(50, (3, 8, 8), 5, seed=4)
    assert not torch.equal(first[0][0], other_seed[0][0])
    assert first[0][0].shape == (3, 8, 8)
    assert {first[i][1] for i in range(50)} == set(range(5))
    with pytest.raises(IndexError):
        first[50]


def test_train_and_val_splits_differ_but_share_the_classes():
    data = build_datasets(TrainConfig(train_size=20, val_size=10))
    assert len(data.train) == 20 and len(data.val) == 10
    assert not torch.equal(data.train[0][0], data.val[0][0])
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10


def test_flatten_mode_presents_vectors():
    data = build_datasets(TrainConfig(mode="flatten", image_shape="3,4,5", train_size=4, val_size=4))
    assert data.input_shape == (60,)
    assert data.train[0][0].shape == (60,)


def test_missing_torchvision_files_name_the_directory_and_the_download_flag(tmp_path):
    with pytest.raises(UsageError, match=rf"files not found in --data-dir {tmp_path}; pass --download"):
        build_datasets(TrainConfig(dataset="mnist", data_dir=str(tmp_path)))


def test_imagefolder_needs_train_and_val_folders(tmp_path):
    with pytest.raises(UsageError, match="needs train/, val/ inside --data-dir"):
        build_datasets(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path)))


def test_real_fashion_mnist_loads_from_the_shared_gz_files(tmp_path):
    import shutil

    raw = SHARED_DATA / "FashionMNIST" / "raw"
    if not raw.exists():
        pytest.skip(f"real FashionMNIST not available at {raw}")
    shutil.copytree(raw, tmp_path / "FashionMNIST" / "raw")
    data = build_datasets(TrainConfig(dataset="fashion-mnist", data_dir=str(tmp_path), download=True))
    assert (len(data.train), len(data.val)) == (60000, 10000)
    image, label = data.val[0]
    assert image.shape == (1, 28, 28) and 0 <= label < 10


def test_imagefolder_reads_class_folders_resized_to_the_image_shape(tmp_path):
    from PIL import Image

    for split, count in (("train", 3), ("val", 2)):
        for class_name, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            folder = tmp_path / split / class_name
            folder.mkdir(parents=True)
            for index in range(count):
                Image.new("RGB", (40, 30), colour).save(folder / f"{index}.png")
    data = build_datasets(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), image_shape="3,16,16"))
    assert (len(data.train), len(data.val), data.num_classes) == (6, 4, 2)
    image, label = data.val[3]
    assert image.shape == (3, 16, 16) and label == 1  # dog: the second class, blue
    assert image[2].mean() > 0.9 > image[0].mean()


def test_fake_data_has_the_requested_shape_and_classes():
    data = build_datasets(
        TrainConfig(dataset="fake", train_size=8, val_size=4, image_shape="3,12,10", num_classes=5)
    )
    image, label = data.train[0]
    assert image.shape == (3, 12, 10) and 0 <= label < 5
    assert (len(data.train), len(data.val), data.num_classes) == (8, 4, 5)
    assert not torch.equal(data.train[0][0], data.val[0][0])


def test_text_windows_are_characters_and_their_targets_the_same_characters_shifted_by_one(tmp_path):
    path = tiny_text(tmp_path / "tiny.txt", characters=2000)
    text = path.read_text()
    data = build_datasets(TrainConfig(dataset="text", data_file=str(path), block_size=32))
    vocabulary = sorted(set(text))
    assert data.num_classes == len(vocabulary) and data.input_shape == (32,)
    decode = lambda ids: "".join(vocabulary[i] for i in ids.tolist())  # noqa: E731
    # 1800 training characters (the last 200 are validation): 56 windows side by side, each needing one more.
    assert (len(data.train), len(data.val)) == (1799 // 32, 199 // 32)
    for index in (0, 1, len(data.train) - 1):
        x, y = data.train[index]
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (32,)
        assert (
            decode(x) == text[32 * index : 32 * index + 32]
            and decode(y) == text[32 * index + 1 : 32 * index + 33]
        )
    assert decode(data.val[0][0]) == text[1800:1832]
    with pytest.raises(IndexError):
        data.train[len(data.train)]
