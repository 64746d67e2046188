"""Padding of scenes smaller than the model's input never reaches a loss or a metric."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from geofm.config.finetune_data import PADDING_LABEL
from geofm.data.finetune import build_finetune_dataset
from geofm.data.writers import write_geotiff
from geofm.tasks.finetuning import task_of
from geofm.tasks.finetuning.metrics import TaskMetrics

TRANSFORM = (10.0, 0.0, 500_000.0, 0.0, -10.0, 5_000_000.0)


def _scenes(root, size: int, label: int, count: int = 2) -> None:
    """``count`` segmentation scenes of ``size`` px, every pixel labelled ``label``."""
    for i in range(count):
        image = np.full((4, size, size), 2500, dtype=np.uint16)
        write_geotiff(root / "train" / "images" / f"s{i}.tif", image, transform=TRANSFORM, crs="EPSG:32632")
        write_geotiff(
            root / "train" / "masks" / f"s{i}.tif",
            np.full((1, size, size), label, dtype=np.uint8),
            transform=TRANSFORM,
            crs="EPSG:32632",
        )


@pytest.mark.parametrize("ignore_index", [None, 255])
@pytest.mark.parametrize("train", [True, False], ids=["training crop", "evaluation tile"])
def test_a_small_scene_is_padded_with_a_label_that_is_never_scored(tmp_path, task_config, ignore_index, train):
    _scenes(tmp_path, 8, label=1)
    cfg = task_config("segmentation", data={"root": str(tmp_path), "ignore_index": ignore_index})
    sample = build_finetune_dataset(cfg.data, "segmentation", "train", 32, train=train)[0]
    mask = sample["mask"]
    assert mask.shape == (32, 32) and int((mask == 1).sum()) == 64, "the 8 x 8 real pixels keep their label"
    unscored = PADDING_LABEL if ignore_index is None else ignore_index
    assert int((mask == unscored).sum()) == 32 * 32 - 64, "every padded pixel carries the unscored label"
    assert int((mask == 0).sum()) == 0, "padding never passes for class 0"


def test_metrics_and_loss_count_the_real_pixels_only(tmp_path, task_config):
    """Vaihingen's defect: a model that predicts class 0 everywhere scored the padding as right."""
    _scenes(tmp_path, 8, label=1)
    cfg = task_config("segmentation", data={"root": str(tmp_path), "ignore_index": None})
    dataset = build_finetune_dataset(cfg.data, "segmentation", "train", 32, train=False)
    masks = torch.stack([dataset[i]["mask"] for i in range(len(dataset))])
    class_0 = torch.zeros(len(dataset), 3, 32, 32)
    class_0[:, 0] = 5.0
    metrics = TaskMetrics(cfg)
    metrics.update(class_0, masks)
    result = metrics.compute()
    assert result["accuracy"] == 0.0, f"every real pixel is class 1, predicted 0: {result}"
    loss = task_of(cfg).criterion(class_0, masks)
    # per real pixel: -log softmax(5, 0, 0)[1] = log(e^5 + 2) - 0
    assert float(loss) == pytest.approx(math.log(math.exp(5.0) + 2.0), rel=1e-5)


def test_a_batch_without_a_labelled_pixel_is_a_zero_loss_with_gradients(task_config):
    cfg = task_config("segmentation", data={"ignore_index": 255})
    logits = torch.randn(2, 3, 8, 8, requires_grad=True)
    loss = task_of(cfg).criterion(logits, torch.full((2, 8, 8), 255))
    assert loss.item() == 0.0
    loss.backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0


def test_padded_superres_targets_are_left_out_of_the_loss_and_the_metrics(task_config):
    cfg = task_config("superres")
    criterion, metrics = task_of(cfg).criterion, TaskMetrics(cfg)
    target = torch.full((1, 4, 32, 32), float("nan"))
    target[..., :24, :20] = 0.5  # the real 24 x 20 pixels; NaN is how a small scene's target is padded
    output = torch.full((1, 4, 32, 32), 0.75)
    output[..., 24:, :] = 100.0  # whatever the model says over the padding does not count
    loss = criterion(output, target)
    assert float(loss) == pytest.approx(0.25)
    metrics.update(output, target)
    expected = TaskMetrics(cfg)
    expected.update(output[..., :24, :20], target[..., :24, :20])
    assert metrics.compute() == pytest.approx(expected.compute())
    assert all(math.isfinite(v) for v in metrics.compute().values())
