"""The demo archive's labelled downstream data and the demo finetuning configs that read it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from geofm.config.finetune import FinetuneConfig
from geofm.data.demo import FINETUNE_SPLITS, SR_FACTOR, make_demo_archive
from geofm.data.demo_scenes import LAND_COVER, SCENE_CLASSES, UNLABELED
from geofm.data.finetune import build_finetune_dataset
from geofm.data.readers import raster_info, read_raster
from geofm.data.stats import compute_band_stats

CONFIGS = Path(__file__).parents[2] / "configs" / "finetune"
FAMILIES = ("classification", "multilabel", "segmentation", "change", "superres")
STATS_FILES = {
    "classification": "train/*/*.tif",
    "multilabel": "train/images/*.tif",
    "segmentation": "train/images/*.tif",
    "change": "train/[AB]/*.tif",
    "superres": "train/lr/*.tif",
}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_demo_archive(tmp_path_factory.mktemp("demo"))


def _config(family: str, archive: dict[str, Path]) -> FinetuneConfig:
    return FinetuneConfig.from_file(CONFIGS / f"demo_{family}__swin_micro.yaml", [f"data.root={archive[family]}"])


@pytest.mark.parametrize("family", FAMILIES)
def test_demo_configs_read_every_split(archive: dict[str, Path], family: str) -> None:
    cfg = _config(family, archive)
    assert cfg.task == family and cfg.data.root == archive[family]
    for split, train in (("train", True), ("val", False), ("test", False)):
        dataset = build_finetune_dataset(cfg.data, cfg.task, split, cfg.model.img_size, train)
        scenes = FINETUNE_SPLITS[family][split] * (len(SCENE_CLASSES) if family == "classification" else 1)
        assert len(dataset.scenes) == scenes, f"{family} {split}: {len(dataset.scenes)} scenes"
        batch = torch.utils.data.default_collate([dataset[i] for i in range(min(len(dataset), 3))])
        for key, value in batch.items():
            assert torch.isfinite(value.float()).all(), f"{family} {split} {key}"


@pytest.mark.parametrize("family", FAMILIES)
def test_demo_configs_carry_the_archive_statistics(archive: dict[str, Path], family: str) -> None:
    data = _config(family, archive).data
    stats = compute_band_stats(
        root=archive[family],
        pattern=STATS_FILES[family],
        bands=data.dataset_bands,
        scale=data.scale,
        nodata=data.nodata,
    )
    assert np.allclose(stats.mean, data.mean, rtol=1e-4) and np.allclose(stats.std, data.std, rtol=1e-4), family


def test_demo_superres_config_carries_the_high_resolution_statistics(archive: dict[str, Path]) -> None:
    hr = _config("superres", archive).data.hr
    assert hr is not None and hr.bands == ["red", "green", "blue"] and hr.scale == pytest.approx(1 / 255)
    stats = compute_band_stats(
        root=archive["superres"], pattern="train/hr/*.tif", bands=hr.dataset_bands, scale=hr.scale
    )
    assert np.allclose(stats.mean, hr.mean, rtol=1e-4) and np.allclose(stats.std, hr.std, rtol=1e-4)


def test_scene_classes_look_different(archive: dict[str, Path]) -> None:
    colours = {}
    for name in SCENE_CLASSES:
        files = sorted((archive["classification"] / "train" / name).glob("*.tif"))
        assert len(files) == FINETUNE_SPLITS["classification"]["train"]
        colours[name] = np.mean([read_raster(f, 3).data.reshape(3, -1).mean(axis=1) for f in files], axis=0)
    assert colours["water"][2] > colours["water"][0] + 20, "water scenes are blue"
    assert colours["forest"].sum() < colours["farmland"].sum() - 60, "forest scenes are dark"
    assert np.abs(colours["residential"] - colours["farmland"]).max() > 10


def test_segmentation_masks_follow_the_land_cover(archive: dict[str, Path]) -> None:
    for i in range(FINETUNE_SPLITS["segmentation"]["train"]):
        image = read_raster(archive["segmentation"] / "train" / "images" / f"scene_{i:03d}.tif", 4)
        mask = read_raster(archive["segmentation"] / "train" / "masks" / f"scene_{i:03d}.tif", 1).data[0]
        assert set(np.unique(mask)) <= set(range(len(LAND_COVER))) | {UNLABELED}
        assert np.array_equal(mask == UNLABELED, (image.data == 0).all(axis=0)), "unlabeled exactly on nodata"
        water = mask == LAND_COVER.index("water")
        if water.any():
            assert image.data[3][water].mean() < image.data[2][water].mean(), "water: nir below red"


def test_change_masks_mark_new_buildings(archive: dict[str, Path]) -> None:
    folder = archive["change"] / "train"
    changed = 0
    for i in range(FINETUNE_SPLITS["change"]["train"]):
        before = read_raster(folder / "A" / f"scene_{i:03d}.tif", 3)
        after = read_raster(folder / "B" / f"scene_{i:03d}.tif", 3)
        mask = read_raster(folder / "label" / f"scene_{i:03d}.tif", 1).data[0]
        assert before.transform == after.transform and before.crs == after.crs
        assert set(np.unique(mask)) <= {0, 255}
        if mask.any():
            changed += 1
            difference = np.abs(after.data.astype(int) - before.data.astype(int)).sum(axis=0)
            assert difference[mask == 255].mean() > 3 * difference[mask == 0].mean(), (
                f"pair {i}: change where the mask says"
            )
    assert 0 < changed < FINETUNE_SPLITS["change"]["train"], "some pairs change, some do not"


def test_superres_pairs_are_area_averages_on_finer_grids(archive: dict[str, Path]) -> None:
    folder = archive["superres"] / "val"
    for i in range(FINETUNE_SPLITS["superres"]["val"]):
        high = read_raster(folder / "hr" / f"scene_{i:03d}.tif", 3)
        low = read_raster(folder / "lr" / f"scene_{i:03d}.tif", 4)
        bands, height, width = high.data.shape
        assert low.data.shape == (4, height // SR_FACTOR, width // SR_FACTOR), "red, green, blue and nir"
        average = high.data.reshape(bands, height // SR_FACTOR, SR_FACTOR, width // SR_FACTOR, SR_FACTOR).mean(
            axis=(2, 4)
        )
        assert np.abs(low.data[:3] - average).max() <= 0.5, "the low-resolution red, green, blue average the high"
        assert low.transform[0] == SR_FACTOR * high.transform[0] and low.transform[4] == SR_FACTOR * high.transform[4]
        assert low.transform[2] == high.transform[2] and low.transform[5] == high.transform[5]
        assert raster_info(folder / "lr" / f"scene_{i:03d}.tif").crs == "EPSG:32632"
