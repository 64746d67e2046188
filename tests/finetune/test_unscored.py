"""Finetuning end to end on dense data with unscored pixels: padding of small scenes and wholly ignored batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from finetune.best import load_finetuned
from finetune.run import finetune
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune import build_finetune_dataset
from geofm.errors import DataMismatchError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRUTH = np.array([[1, 2, 3, 4], [5, 1, 2, 3]])
"""A 2 x 4 Vaihingen scene without class 0: 8 real pixels, under 1% of a 32 px tile."""
TRAIN = {"epochs": 1, "warmup_epochs": 0.5, "micro_batch_size": 2}


def _vaihingen_tree(root, torchgeo_layouts, finetune_tree, output_dir) -> dict:
    fields = torchgeo_layouts.vaihingen2d(root, TRUTH, areas=("area1", "area3", "area2", "area4"))
    data = {
        **fields,
        "root": str(root),
        "bands": fields["dataset_bands"],
        "splits": {"val": "test"},
        "scale": 1 / 255,
        "mean": [0.3] * 3,
        "std": [0.2] * 3,
        "ignore_index": None,
    }
    return finetune_tree("segmentation", output_dir, data=data, train=TRAIN)


def test_scenes_smaller_than_img_size_are_scored_on_their_real_pixels(tmp_path, torchgeo_layouts, finetune_tree):
    cfg = FinetuneConfig.from_tree(
        _vaihingen_tree(tmp_path / "data", torchgeo_layouts, finetune_tree, tmp_path / "run")
    )
    run_dir = finetune(cfg)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["scored_pixels"] == 2 * TRUTH.size, "the two 2 x 4 test scenes, not their 32 x 32 tiles"

    model, cfg, _ = load_finetuned(run_dir)
    test = build_finetune_dataset(cfg.data, "segmentation", "test", cfg.model.img_size, train=False)
    with torch.no_grad():
        predicted = [model(sample["image"][None]).argmax(dim=1)[0, :2, :4].numpy() for sample in test]
    accuracy = float(np.mean([p == TRUTH for p in predicted]))
    assert evaluation["metrics"]["accuracy"] == pytest.approx(accuracy), "pixel accuracy over the real pixels alone"


def test_a_split_without_a_labelled_pixel_stops_the_run_before_training(tmp_path, torchgeo_layouts, finetune_tree):
    fields = torchgeo_layouts.loveda(tmp_path / "data", per_split={"train": 2, "val": 1}, size=8)
    for mask in (tmp_path / "data" / "Val" / "Urban" / "masks_png").iterdir():
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(mask)  # 0: LoveDA's no-data, the ignore_index
    data = {**fields, "root": str(tmp_path / "data"), "bands": fields["dataset_bands"], "mean": [0.3] * 3}
    tree = finetune_tree("segmentation", tmp_path / "run", data={**data, "std": [0.2] * 3}, train=TRAIN)
    with pytest.raises(
        DataMismatchError, match=r"torchgeo LoveDA at .*data, split val \('val'\): none of its 1 scenes"
    ):
        finetune(FinetuneConfig.from_tree(tree))
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "no training step was taken"


def test_batches_without_a_labelled_pixel_train_on_with_a_loss_of_0(task_config, random_datasets, monkeypatch):
    def unlabelled_train_split(data_cfg, task, split, img_size, train):
        dataset = random_datasets(data_cfg, task, split, img_size, train)
        if split == "train":
            for sample in dataset.samples:
                sample["mask"][:] = data_cfg.ignore_index
        return dataset

    monkeypatch.setattr("finetune.splits.build_finetune_dataset", unlabelled_train_split)
    run_dir = finetune(task_config("segmentation"))
    losses = [json.loads(line).get("loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [loss for loss in losses if loss is not None] == [0.0] * 4, "4 steps of batches wholly at ignore_index"
    assert json.loads((run_dir / "eval.json").read_text())["scored_pixels"] == 4 * 28 * 32, "test masks: rows 4+"
