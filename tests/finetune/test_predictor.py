"""A finetuned run as a function of normalised tiles, for whole-scene inference."""

from __future__ import annotations

import pytest
import torch

from finetune.predictor import load_predictor
from finetune.run import finetune
from geofm.errors import CheckpointNotFoundError, ConfigError


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("family", ["swin", "vit"])
def test_a_model_predicts_tiles_of_another_multiple_of_its_stride(family, task_config, random_datasets):
    cfg = task_config("segmentation", family=family, model={"img_size": 64}, train={"epochs": 1, "warmup_epochs": 0.5})
    run_dir = finetune(cfg)
    own = load_predictor(run_dir)
    assert own.tile == 64, "the default tile is the model's training size"
    larger = load_predictor(run_dir, tile=128)
    assert larger.tile == 128
    tiles = torch.randn(2, 4, 128, 128)
    assert tuple(larger.model_fn(tiles).shape) == (2, 3, 128, 128)
    assert tuple(load_predictor(run_dir, tile=32).model_fn(tiles[..., :32, :32]).shape) == (2, 3, 32, 32)


@pytest.mark.slow
def test_a_tile_the_model_cannot_take_is_refused_with_the_sizes_it_can(task_config, random_datasets):
    run_dir = finetune(task_config("superres", model={"img_size": 64}, train={"epochs": 1, "warmup_epochs": 0.5}))
    with pytest.raises(
        ConfigError,
        match=r"tile 100: .* trained on 64 px tiles, takes tiles whose side is a multiple of 32 px \(32, 64, 96, 128",
    ):
        load_predictor(run_dir, tile=100)
    assert tuple(load_predictor(run_dir, tile=96).model_fn(torch.randn(1, 4, 96, 96)).shape) == (1, 4, 192, 192)
