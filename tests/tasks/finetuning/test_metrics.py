"""Task metrics against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from geofm.config.finetune_data import PADDING_LABEL
from geofm.tasks.finetuning.metrics import TaskMetrics


def _compute(cfg, outputs, target, batches: int = 1) -> dict[str, float]:
    metrics = TaskMetrics(cfg)
    for out, tgt in zip(outputs.chunk(batches), target.chunk(batches), strict=True):
        metrics.update(out, tgt)
    return metrics.compute()


def test_overall_accuracy(task_config):
    logits = torch.tensor([[2.0, 0.1, 0.0], [0.0, 1.0, 0.5], [0.3, 0.2, 0.1], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
    labels = torch.tensor([0, 1, 2, 2, 0])  # argmax 0, 1, 0, 2, 1: three right of five
    result = _compute(task_config("classification"), logits, labels, batches=2)
    assert result == {"accuracy": pytest.approx(3 / 5)}, "accumulated over batches"


def test_micro_and_macro_average_precision(task_config):
    scores = torch.tensor([[0.9, 0.2, 0.6], [0.8, 0.7, 0.1], [0.1, 0.4, 0.3]])
    labels = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 0, 0]])
    logits = torch.logit(scores)
    result = _compute(task_config("multilabel"), logits, labels)
    # micro: all 9 pairs ranked by score: .9+ .8- .7+ .6+ .4- .3- .2- .1+ .1-(tie)
    # precision at each positive: 1/1, 2/3, 3/4 and, for the tied 0.1 pair, 4/9 (ties share a threshold)
    assert result["map_micro"] == pytest.approx((1 + 2 / 3 + 3 / 4 + 4 / 9) / 4)
    # per label: [1,0,1] by .9 .8 .1 -> (1 + 2/3)/2; [0,1,0] by .2 .7 .4 -> 1; [1,0,0] by .6 .1 .3 -> 1
    assert result["map_macro"] == pytest.approx(((1 + 2 / 3) / 2 + 1 + 1) / 3)
    # at 0.5: predicted positives (0,0) (0,2) (1,0) (1,1): tp 3, fp 1, fn 1 -> f1 = 6 / 8
    assert result["f1_micro"] == pytest.approx(6 / 8)


def test_miou_leaves_out_ignored_pixels_and_absent_classes(task_config):
    cfg = task_config("segmentation", data={"num_classes": 4, "class_names": ["road", "roof", "tree", "car"]})
    target = torch.tensor([[[0, 1, 255], [2, 2, 1]]])
    pred = torch.tensor([[[0, 1, 2], [2, 1, 1]]])
    logits = torch.nn.functional.one_hot(pred, 4).permute(0, 3, 1, 2).float()
    result = _compute(cfg, logits, target)
    # road 1/1; roof tp 2 (0,1)(1,2), fp (1,1) -> 2/3; tree tp (1,0), fn (1,1) -> 1/2 (the 255 pixel is ignored);
    # car absent from both: 0 and left out of the mean
    assert result["iou/road"] == 1.0 and result["iou/roof"] == pytest.approx(2 / 3)
    assert result["iou/tree"] == pytest.approx(0.5) and result["iou/car"] == 0.0
    assert result["miou"] == pytest.approx((1 + 2 / 3 + 1 / 2) / 3)
    assert result["accuracy"] == pytest.approx(4 / 5), "4 of the 5 labelled pixels"


def test_change_precision_recall_f1_of_the_change_class(task_config):
    target = torch.tensor([[[1, 1, 0, 0], [1, 0, 0, 1]]])
    pred = torch.tensor([[[1, 0, 1, 0], [1, 0, 0, 0]]])
    logits = torch.nn.functional.one_hot(pred, 2).permute(0, 3, 1, 2).float()
    result = _compute(task_config("change"), logits, target)
    tp, fp, fn = 2, 1, 2
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    assert result["precision"] == pytest.approx(precision) and result["recall"] == pytest.approx(recall)
    assert result["f1"] == pytest.approx(2 * precision * recall / (precision + recall))
    assert result["iou"] == pytest.approx(tp / (tp + fp + fn))


def test_psnr_in_scaled_units_is_the_mean_over_images(task_config):
    cfg = task_config("superres", data={"mean": [0.5] * 4, "std": [0.25] * 4}, finetune={"superres_data_range": 1.0})
    target = torch.zeros(2, 4, 16, 16)  # normalised 0 -> scaled 0.5
    outputs = target.clone()
    outputs[0] += 0.4  # scaled error 0.1 everywhere
    outputs[1] += 0.8  # scaled error 0.2
    result = _compute(cfg, outputs, target)
    expected = (10 * math.log10(1 / 0.1**2) + 10 * math.log10(1 / 0.2**2)) / 2
    assert result["psnr"] == pytest.approx(expected, rel=1e-5)
    assert 0 < result["ssim"] <= 1


def test_psnr_of_other_high_resolution_bands_is_in_their_own_units(task_config):
    hr = {"dataset_bands": ["pan", "red"], "bands": ["pan"], "mean": [0.5, 0.0], "std": [0.2, 1.0]}
    cfg = task_config("superres", data={"hr": hr}, finetune={"superres_data_range": 1.0})
    target = torch.zeros(2, 1, 16, 16)  # normalised 0 -> scaled 0.5
    outputs = target + 1.0  # scaled error 0.2 (pan's std), not 0.1 (the inputs' std)
    assert _compute(cfg, outputs, target)["psnr"] == pytest.approx(10 * math.log10(1 / 0.2**2), rel=1e-5)


def test_segmentation_without_ignore_index_scores_the_real_pixels_only(task_config):
    cfg = task_config("segmentation", data={"ignore_index": None})
    real = torch.tensor([[0, 1, 2, 0], [1, 1, 0, 2]])
    pred = torch.tensor([[0, 1, 1, 0], [2, 1, 0, 0]])
    target = torch.full((1, 8, 8), PADDING_LABEL)
    target[0, :2, :4] = real
    logits = torch.zeros(1, 3, 8, 8)  # padding predicted as class 0, which it must not be credited for
    logits[0, :, :2, :4] = torch.nn.functional.one_hot(pred, 3).permute(2, 0, 1).float()
    metrics = TaskMetrics(cfg)
    metrics.update(logits, target)
    alone = _compute(cfg, torch.nn.functional.one_hot(pred, 3).permute(2, 0, 1)[None].float(), real[None])
    assert metrics.compute() == pytest.approx(alone) and alone["accuracy"] == pytest.approx(5 / 8)
    assert metrics.scored_pixels() == 8


def test_superres_metrics_score_the_unpadded_part_of_each_image(task_config):
    cfg = task_config("superres", data={"mean": [0.5] * 4, "std": [0.25] * 4})
    torch.manual_seed(0)
    target, outputs = torch.rand(2, 4, 24, 24) - 0.5, torch.rand(2, 4, 24, 24) - 0.5
    padded = target.clone()
    padded[0, :, 12:] = float("nan")  # image 0: a 12 x 24 scene padded at the bottom
    metrics = TaskMetrics(cfg)
    metrics.update(outputs, padded)
    parts = TaskMetrics(cfg)
    parts.update(outputs[:1, :, :12], target[:1, :, :12])
    parts.update(outputs[1:], target[1:])
    assert metrics.compute() == pytest.approx(parts.compute()), "each image scored on its own pixels"
    assert metrics.scored_pixels() == 12 * 24 + 24 * 24
