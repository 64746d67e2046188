"""A finetuned run as a function of normalised tiles, for whole-scene inference."""

from __future__ import annotations

import pytest
import torch

from finetune.predictor import load_predictor
from finetune.run import finetune
from geofm.errors import CheckpointNotFoundError


@pytest.mark.parametrize(
    ("task", "shape"), [("segmentation", (3, 3, 32, 32)), ("change", (3, 2, 32, 32)), ("superres", (3, 4, 64, 64))]
)
def test_predictor_maps_normalised_tiles_to_per_pixel_outputs(task, shape, task_config, random_datasets):
    cfg = task_config(task, task, train={"epochs": 1, "warmup_epochs": 0.5})
    run_dir = finetune(cfg)
    predictor = load_predictor(run_dir)
    model_fn, info = predictor.model_fn, predictor.info
    assert predictor.task == task and predictor.normaliser.bands == ["red", "green", "blue", "nir"]
    tiles = [torch.randn(3, 4, 32, 32) for _ in range(2 if task == "change" else 1)]
    out = model_fn(*tiles)
    assert tuple(out.shape) == shape and out.dtype == torch.float32 and out.device.type == "cpu"
    assert torch.equal(out, model_fn(*tiles)), "inference is deterministic (eval mode)"
    assert info["task"] == task and info["bands"] == ["red", "green", "blue", "nir"]
    assert info["dataset_bands"] == ["blue", "green", "red", "nir"] and info["mean"] == [0.25] * 4
    assert info["scale_factor"] == (2 if task == "superres" else 1) and info["img_size"] == 32
    assert info["selected"]["split"] == "val"


def test_a_run_without_kept_weights_is_reported(tmp_path, task_config, random_datasets):
    with pytest.raises(CheckpointNotFoundError, match="not a finetuning run directory"):
        load_predictor(tmp_path)
    run_dir = finetune(task_config("segmentation", "early", run={"stop_after_steps": 1}))
    with pytest.raises(CheckpointNotFoundError, match="has not kept weights yet"):
        load_predictor(run_dir)
