"""The model registry builds every model for the shapes the data sets produce."""

from __future__ import annotations

import pytest
import torch

from multigpu.models import MODELS, build_model
from multigpu.errors import UsageError


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_every_model_maps_images_to_class_scores(name, shape):
    model = build_model(name, shape, 7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, *shape)).shape == (2, 7)


def test_mlp_takes_flattened_samples_and_image_models_refuse_them():
    assert build_model("mlp", (784,), 10)(torch.randn(3, 784)).shape == (3, 10)
    with pytest.raises(UsageError, match="--mode flatten use --model mlp"):
        build_model("resnet18", (784,), 10)
