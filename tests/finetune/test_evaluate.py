"""Evaluation of dense tasks on scenes larger than the model's input: each scene blended and scored once."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from finetune.evaluate import eval_loader, evaluate, format_metrics
from finetune.predict import blend_weights
from geofm.data.finetune import build_finetune_dataset
from geofm.data.writers import write_geotiff
from geofm.tasks.finetuning.model import build_finetune_model
from tests.finetune.conftest import TRANSFORM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPES = [(48, 48), (40, 56), (20, 36)]
"""Test scenes: 4, 4 and 2 tiles of 32 px, overlapping along every side longer than 32."""
IGNORE = 9


def _scene_folders(root, task: str) -> None:
    """Test scenes of :data:`SHAPES` in the task's folder layout, 4 bands, a quarter of each mask ignored."""
    rng = np.random.default_rng(0)
    images = {"segmentation": ["images"], "change": ["A", "B"]}[task]
    mask_folder = {"segmentation": "masks", "change": "label"}[task]
    classes = {"segmentation": 3, "change": 2}[task]
    for i, (height, width) in enumerate(SHAPES):
        for folder in images:
            pixels = rng.normal(2500, 800, (4, height, width)).clip(1, 60000).astype(np.uint16)
            write_geotiff(root / "test" / folder / f"{i}.tif", pixels, transform=TRANSFORM, crs=32632)
        mask = rng.integers(0, classes, (height, width)).astype(np.uint8)
        mask[: height // 4] = IGNORE
        write_geotiff(root / "test" / mask_folder / f"{i}.tif", mask[None], transform=TRANSFORM, crs=32632)


def _stitched_by_hand(model, dataset, task: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each scene's prediction (argmax of its tiles' logits averaged with the blend weights) and mask."""
    inputs = {"segmentation": ["image"], "change": ["image1", "image2"]}[task]
    weights = blend_weights(dataset.img_size)
    scenes = []
    for region, (height, width) in enumerate(dataset.extents):
        scores, total = np.zeros((2 if task == "change" else 3, height, width)), np.zeros((height, width))
        for index, (r, top, left) in enumerate(dataset.tiles):
            if r != region:
                continue
            with torch.no_grad():
                logits = model(*(dataset[index][key][None] for key in inputs))[0].numpy()
            rows, cols = min(32, height - top), min(32, width - left)
            scores[:, top : top + rows, left : left + cols] += logits[:, :rows, :cols] * weights[:rows, :cols]
            total[top : top + rows, left : left + cols] += weights[:rows, :cols]
        scenes.append(((scores / total).argmax(axis=0), dataset.read_region(region)["mask"].numpy()))
    return scenes


@pytest.mark.parametrize("task", ["segmentation", "change"])
def test_scenes_larger_than_the_model_input_are_blended_and_scored_once(task, task_config, tmp_path):
    _scene_folders(tmp_path / "data", task)
    cfg = task_config(task, data={"root": str(tmp_path / "data"), "ignore_index": IGNORE})
    dataset = build_finetune_dataset(cfg.data, task, "test", cfg.model.img_size, train=False)
    assert len(dataset) == 10, "the scenes' tiles"
    torch.manual_seed(0)
    model = build_finetune_model(cfg)[0].eval()

    evaluation = evaluate(model, dataset, cfg, torch.device("cpu"))

    scenes = _stitched_by_hand(model, dataset, task)
    predicted = np.concatenate([p[m != IGNORE] for p, m in scenes])
    truth = np.concatenate([m[m != IGNORE] for _, m in scenes])
    assert evaluation.scored_pixels == truth.size == sum(3 * h * w // 4 for h, w in SHAPES), "each labelled pixel once"
    if task == "segmentation":
        ious = []
        for k in range(3):
            union = np.sum((predicted == k) | (truth == k))
            ious.append(np.sum((predicted == k) & (truth == k)) / union if union else np.nan)
        assert evaluation.metrics["miou"] == pytest.approx(np.nanmean(ious), abs=1e-6)
        assert evaluation.metrics["accuracy"] == pytest.approx(np.mean(predicted == truth), abs=1e-6)
    else:
        tp = np.sum((predicted == 1) & (truth == 1))
        assert evaluation.metrics["f1"] == pytest.approx(2 * tp / (np.sum(predicted == 1) + np.sum(truth == 1)))
        assert evaluation.metrics["recall"] == pytest.approx(tp / np.sum(truth == 1))


def test_processes_evaluate_whole_scenes(task_config, tmp_path):
    _scene_folders(tmp_path / "data", "segmentation")
    cfg = task_config("segmentation", data={"root": str(tmp_path / "data"), "ignore_index": IGNORE})
    dataset = build_finetune_dataset(cfg.data, "segmentation", "test", cfg.model.img_size, train=False)
    shares = [list(eval_loader(dataset, cfg, torch.device("cpu"), rank, 2).sampler) for rank in (0, 1)]
    regions = [{dataset.tiles[i][0] for i in share} for share in shares]
    assert regions == [{0, 2}, {1}], "every second scene, each with all of its tiles"
    assert sorted(shares[0] + shares[1]) == list(range(len(dataset)))


def test_central_and_federated_finetuning_log_validation_alike(task_tree, random_datasets, caplog):
    from finetune.run import finetune
    from geofm.config.federated import read_federated_config
    from geofm.config.finetune import FinetuneConfig
    from geofm.tasks import federated_task
    from tests.finetune.test_federated import _federated

    with caplog.at_level(logging.INFO, logger="geofm.finetune"):
        run_dir = finetune(FinetuneConfig.from_tree(task_tree("classification", "central")))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [r["val"] for r in records if "val" in r]
    central = [r.getMessage() for r in caplog.records if r.name == "geofm.finetune" and " val " in r.getMessage()]
    assert central[-1] == f"step 4 (epoch 2): val {format_metrics(validations[-1])}"

    cfg = read_federated_config(_federated(task_tree("classification", "federated")))
    program = federated_task(cfg)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="geofm.fl"):
        values = program.evaluate_round(program.build_model(initial_weights=False), 1)
    assert [r.getMessage() for r in caplog.records] == [f"round 1: val {format_metrics(values)}"]
    assert format_metrics({"miou": 0.14295542240142822, "accuracy": 0.5}) == "miou 0.1430, accuracy 0.5000"
