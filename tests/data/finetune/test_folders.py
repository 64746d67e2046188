"""Folder datasets of every task family: the sample format, normalisation and evaluation views."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest
import torch
from PIL import Image

from geofm.data.finetune import build_finetune_dataset
from geofm.data.finetune.folders import folder_layout
from geofm.data.grid import grid_origins
from geofm.data.layouts import FOLDER_LAYOUTS, FolderLayout
from geofm.errors import ConfigError, RasterReadError


def _check_format(sample: dict, expected: dict) -> None:
    assert set(sample) == set(expected), f"keys {sorted(sample)} instead of {sorted(expected)}"
    for key, (shape, dtype) in expected.items():
        assert tuple(sample[key].shape) == shape, f"{key} has shape {tuple(sample[key].shape)}, expected {shape}"
        assert sample[key].dtype == dtype, f"{key} has dtype {sample[key].dtype}, expected {dtype}"


def test_classification_folders(tmp_path, tif, data_cfg):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ["beach", "forest", "harbor"]:
            for i in range(3):
                tif(tmp_path / split / name / f"{name}_{i}.tif", rng.integers(0, 200, (3, 40, 48)).astype(np.uint8))
    Image.fromarray(rng.integers(0, 200, (40, 48, 3), dtype=np.uint8)).save(tmp_path / "train" / "beach" / "extra.png")
    cfg = data_cfg(tmp_path, dataset_bands=["red", "green", "blue"], num_classes=3)
    train = build_finetune_dataset(cfg, "classification", "train", 32, train=True)
    assert len(train) == 10, "9 GeoTIFFs and one PNG"
    labels = [int(train[i]["label"]) for i in range(len(train))]
    assert labels == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2], "class ids follow the sorted folder names"
    _check_format(train[0], {"image": ((3, 32, 32), torch.float32), "label": ((), torch.int64)})
    val = build_finetune_dataset(cfg, "classification", "val", 32, train=False)
    _check_format(val[4], {"image": ((3, 32, 32), torch.float32), "label": ((), torch.int64)})
    assert torch.equal(val[4]["image"], val[4]["image"]), "evaluation views are deterministic"


def test_classification_normalisation_selects_model_bands_by_name(tmp_path, tif, data_cfg):
    raw = np.stack([np.full((8, 8), v, dtype=np.uint16) for v in (100, 200, 300)])
    raw[:, 0, 0] = 0
    tif(tmp_path / "val" / "a" / "x.tif", raw, nodata=0)
    cfg = data_cfg(
        tmp_path,
        dataset_bands=["blue", "green", "red"],
        bands=["red", "green"],
        scale=0.01,
        mean=[1.0, 2.0, 3.0],
        std=[0.5, 0.25, 2.0],
    )
    image = build_finetune_dataset(cfg, "classification", "val", 8, train=False)[0]["image"]
    assert image.shape == (2, 8, 8)
    np.testing.assert_allclose(
        image[0, 1:, 1:], (300 * 0.01 - 3.0) / 2.0, err_msg="red = third dataset band, its own statistics"
    )
    np.testing.assert_allclose(image[1, 1:, 1:], (200 * 0.01 - 2.0) / 0.25, err_msg="green = second dataset band")
    assert (image[:, 0, 0] == 0).all(), "nodata pixels are 0 after normalisation"


def test_class_names_fix_ids_and_allow_missing_classes(tmp_path, tif, data_cfg):
    tif(tmp_path / "val" / "water" / "a.tif", np.ones((1, 8, 8), dtype=np.uint8))
    cfg = data_cfg(tmp_path, num_classes=3, class_names=["crop", "urban", "water"])
    assert int(build_finetune_dataset(cfg, "classification", "val", 8, train=False)[0]["label"]) == 2


def test_multilabel_folder(tmp_path, tif, data_cfg):
    for i in range(3):
        tif(tmp_path / "train" / "images" / f"s{i}.tif", np.full((2, 20, 20), i + 1, dtype=np.uint16))
    (tmp_path / "train" / "labels.csv").write_text("image,water,urban,crop\ns0.tif,1,0,0\ns1.tif,0,1,1\ns2.tif,1,1,1\n")
    cfg = data_cfg(tmp_path, dataset_bands=["red", "nir"], num_classes=3)
    ds = build_finetune_dataset(cfg, "multilabel", "train", 16, train=True)
    _check_format(ds[1], {"image": ((2, 16, 16), torch.float32), "label": ((3,), torch.float32)})
    assert ds[1]["label"].tolist() == [0.0, 1.0, 1.0]
    assert ds.source.class_names == ["water", "urban", "crop"]


def test_segmentation_folders_and_evaluation_grid(tmp_path, tif, data_cfg, positions):
    image = positions(40, 48, bands=2)
    image[:, 0, :5] = 0
    mask = (image[:1] % 3).astype(np.uint8)
    mask[0, 0, :5] = 255
    tif(tmp_path / "val" / "images" / "tile_a.tif", image, nodata=0)
    tif(tmp_path / "val" / "masks" / "tile_a.png", mask, crs=None)
    cfg = data_cfg(
        tmp_path,
        dataset_bands=["red", "nir"],
        scale=0.5,
        mean=[1.0, 2.0],
        std=[2.0, 4.0],
        num_classes=3,
        ignore_index=255,
    )
    ds = build_finetune_dataset(cfg, "segmentation", "val", 32, train=False)
    assert grid_origins(40, 32) == [0, 8] and grid_origins(48, 32) == [0, 16]
    assert len(ds) == 4, "a 2 x 2 grid of 32 px tiles covers the 40 x 48 scene"
    for sample, (top, left) in zip(ds, [(0, 0), (0, 16), (8, 0), (8, 16)], strict=True):
        _check_format(sample, {"image": ((2, 32, 32), torch.float32), "mask": ((32, 32), torch.int64)})
        window = image[:, top : top + 32, left : left + 32].astype(np.float32)
        expected = (window * 0.5 - np.array([1.0, 2.0])[:, None, None]) / np.array([2.0, 4.0])[:, None, None]
        expected[:, window[0] == 0] = 0.0
        np.testing.assert_allclose(sample["image"].numpy(), expected, rtol=1e-6, err_msg=f"tile at {top}, {left}")
        assert torch.equal(sample["mask"], torch.from_numpy(mask[0, top : top + 32, left : left + 32].astype(np.int64)))
    assert (ds[0]["mask"][0, :5] == 255).all(), "ignore_index passes through"


def test_small_scenes_are_padded_with_ignore_index(tmp_path, tif, data_cfg):
    tif(tmp_path / "val" / "images" / "a.tif", np.ones((1, 20, 24), dtype=np.uint16))
    tif(tmp_path / "val" / "masks" / "a.tif", np.ones((1, 20, 24), dtype=np.uint8))
    cfg = data_cfg(tmp_path, num_classes=2, ignore_index=255)
    for train in (True, False):
        sample = build_finetune_dataset(cfg, "segmentation", "val", 32, train=train)[0]
        assert sample["mask"].shape == (32, 32)
        assert (sample["mask"] == 1).sum() == 20 * 24 and (sample["mask"] == 255).sum() == 32 * 32 - 20 * 24
        assert (sample["image"] == 1).sum() == 20 * 24 and (sample["image"] == 0).sum() == 32 * 32 - 20 * 24


@pytest.mark.parametrize("folders", [{}, {"before": "t1", "after": "t2", "mask": "mask"}])
def test_change_folders(tmp_path, tif, data_cfg, positions, folders):
    names = {"before": "A", "after": "B", "mask": "label", **folders}
    before = positions(36, 36)
    tif(tmp_path / "train" / names["before"] / "p1.tif", before)
    tif(tmp_path / "train" / names["after"] / "p1.tif", before * 2)
    change = np.zeros((1, 36, 36), dtype=np.uint8)
    change[0, 10:20, 5:9] = 255
    tif(tmp_path / "train" / names["mask"] / "p1.png", change, crs=None)
    cfg = data_cfg(tmp_path, num_classes=2, folders=folders)
    ds = build_finetune_dataset(cfg, "change", "train", 36, train=False)
    sample = ds[0]
    _check_format(
        sample, {k: ((1, 36, 36), torch.float32) for k in ("image1", "image2")} | {"mask": ((36, 36), torch.int64)}
    )
    assert torch.equal(sample["image2"], 2 * sample["image1"])
    assert int(sample["mask"].sum()) == 40 and set(sample["mask"].unique().tolist()) == {0, 1}, "255 means change: 1"


def test_superres_folders(tmp_path, tif, data_cfg):
    rng = np.random.default_rng(1)
    high = rng.integers(0, 255, (3, 96, 80)).astype(np.uint8)
    low = high.reshape(3, 24, 4, 20, 4).mean(axis=(2, 4)).astype(np.uint8)
    tif(tmp_path / "val" / "hr" / "a.tif", high, transform=(0.5, 0, 100.0, 0, -0.5, 200.0))
    tif(tmp_path / "val" / "lr" / "a.tif", low, transform=(2.0, 0, 100.0, 0, -2.0, 200.0))
    cfg = data_cfg(tmp_path, dataset_bands=["red", "green", "blue"], scale=1 / 255, scale_factor=4)
    ds = build_finetune_dataset(cfg, "superres", "val", 16, train=False)
    assert len(ds) == 4, "a 2 x 2 grid of 16 px low-resolution tiles"
    sample = ds[3]
    _check_format(sample, {"image": ((3, 16, 16), torch.float32), "target": ((3, 64, 64), torch.float32)})
    np.testing.assert_allclose(sample["target"].numpy(), high[:, 32:96, 16:80] / np.float32(255), rtol=1e-6)
    np.testing.assert_allclose(sample["image"].numpy(), low[:, 8:24, 4:20] / np.float32(255), rtol=1e-6)
    from_val = cfg.model_copy(update={"splits": {"train": "val", "val": "val", "test": "val"}})
    train = build_finetune_dataset(from_val, "superres", "train", 16, True)
    _check_format(train[0], {"image": ((3, 16, 16), torch.float32), "target": ((3, 64, 64), torch.float32)})


def test_superres_sides_have_their_own_bands_and_normalisation(tmp_path, tif, data_cfg):
    """4 low-resolution bands (blue, green, red, nir; uint16) to 1 high-resolution band (pan; uint8)."""
    rng = np.random.default_rng(2)
    low = rng.integers(1, 10000, (4, 16, 16)).astype(np.uint16)
    pan = rng.integers(0, 255, (1, 32, 32)).astype(np.uint8)
    tif(tmp_path / "val" / "lr" / "a.tif", low, transform=(2.0, 0, 100.0, 0, -2.0, 200.0))
    tif(tmp_path / "val" / "hr" / "a.tif", pan, transform=(1.0, 0, 100.0, 0, -1.0, 200.0))
    hr = {"dataset_bands": ["pan"], "scale": 1 / 255, "mean": [0.5], "std": [0.25]}
    cfg = data_cfg(
        tmp_path,
        dataset_bands=["blue", "green", "red", "nir"],
        bands=["red", "nir"],
        scale=1e-4,
        mean=[0.1, 0.2, 0.3, 0.4],
        std=[0.1, 0.1, 0.2, 0.2],
        scale_factor=2,
        hr=hr,
    )
    ds = build_finetune_dataset(cfg, "superres", "val", 16, train=False)
    sample = ds[0]
    _check_format(sample, {"image": ((2, 16, 16), torch.float32), "target": ((1, 32, 32), torch.float32)})
    expected_low = (low[[2, 3]] * np.float32(1e-4) - np.float32([[[0.3]], [[0.4]]])) / np.float32(0.2)
    np.testing.assert_allclose(sample["image"].numpy(), expected_low, rtol=1e-5, atol=1e-6)
    expected_pan = (pan / np.float32(255) - np.float32(0.5)) / np.float32(0.25)
    np.testing.assert_allclose(sample["target"].numpy(), expected_pan, rtol=1e-5, atol=1e-6)

    tif(tmp_path / "val" / "hr" / "a.tif", np.repeat(pan, 3, axis=0), transform=(1.0, 0, 100.0, 0, -1.0, 200.0))
    with pytest.raises(RasterReadError, match=r"hr/a\.tif: has 3 bands, source declares 1 \(pan\)"):
        build_finetune_dataset(cfg, "superres", "val", 16, train=False)[0]


def test_dataloader_workers_collate_samples_and_keep_error_types(tmp_path, tif, data_cfg):
    from torch.utils.data import DataLoader

    from geofm.errors import DataMismatchError

    for i in range(4):
        tif(tmp_path / "train" / "images" / f"{i}.tif", np.ones((1, 24, 24), dtype=np.uint16))
        tif(tmp_path / "train" / "masks" / f"{i}.tif", np.full((1, 24, 24), 9 if i == 3 else 1, dtype=np.uint8))
    ds = build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "segmentation", "train", 16, train=True)
    loader = DataLoader(ds, batch_size=3, num_workers=1)
    batches = iter(loader)
    batch = next(batches)
    assert batch["image"].shape == (3, 1, 16, 16) and batch["mask"].shape == (3, 16, 16)
    with pytest.raises(DataMismatchError, match=r"3\.tif: mask values 9"):
        next(batches)


class _ScoredFolders(FolderLayout):
    """`img/` and `scores.csv` (a plug-in task family's split folder)."""

    parts = MappingProxyType({"images": "img", "scores": "scores.csv"})


def test_a_registered_folder_layout_gives_its_parts_which_data_folders_renames(tmp_path, data_cfg):
    FOLDER_LAYOUTS.register("scored", _ScoredFolders())
    try:
        assert folder_layout(data_cfg(tmp_path), "scored") == {"images": "img", "scores": "scores.csv"}
        assert folder_layout(data_cfg(tmp_path, folders={"images": "tiles"}), "scored")["images"] == "tiles"
        with pytest.raises(
            ConfigError, match=r"\['masks'\] are not parts of a scored split folder; its parts are images"
        ):
            folder_layout(data_cfg(tmp_path, folders={"masks": "m"}), "scored")
    finally:
        FOLDER_LAYOUTS.unregister("scored")
    with pytest.raises(ConfigError, match="unknown folder layout 'scored'"):
        folder_layout(data_cfg(tmp_path), "scored")


class _TilesAndTruth(FolderLayout):
    """`tiles/` and `truth/`, a mask per tile with the same file stem (a plug-in's segmentation layout)."""

    parts = MappingProxyType({"images": "tiles", "masks": "truth"})


@pytest.fixture
def tiles_and_truth():
    """The layout registered as a plug-in's entry point would, removed after the test."""
    FOLDER_LAYOUTS.register("tiles_and_truth", _TilesAndTruth())
    yield
    FOLDER_LAYOUTS.unregister("tiles_and_truth")


def test_a_registered_folder_layout_is_chosen_by_the_config_and_read_by_the_tasks_reader(
    tmp_path, tif, data_cfg, tiles_and_truth
):
    tif(tmp_path / "val" / "tiles" / "a.tif", np.ones((1, 8, 8), dtype=np.uint8))
    tif(tmp_path / "val" / "ground" / "a.png", np.ones((1, 8, 8), dtype=np.uint8), crs=None)
    cfg = data_cfg(tmp_path, num_classes=2, folder_layout="tiles_and_truth", folders={"masks": "ground"})
    sample = build_finetune_dataset(cfg, "segmentation", "val", 8, train=False)[0]
    assert sample["image"].shape == (1, 8, 8) and (sample["mask"] == 1).all()
    with pytest.raises(ConfigError, match=r"data\.folders\.masks: String should have at least 1 character"):
        folder_layout(data_cfg(tmp_path, folder_layout="tiles_and_truth", folders={"masks": ""}), "segmentation")
    with pytest.raises(ConfigError, match=r"data\.folder_layout tiles_and_truth has no part after, before, mask"):
        folder_layout(data_cfg(tmp_path, folder_layout="tiles_and_truth"), "change")
    with pytest.raises(ValueError, match="unknown folder layout 'tiles_and_trut'; did you mean 'tiles_and_truth'"):
        data_cfg(tmp_path, folder_layout="tiles_and_trut")
