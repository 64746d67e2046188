"""torchgeo datasets by class name, on tiny data written in each class's on-disk layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geofm.data.finetune import build_finetune_dataset
from geofm.errors import ConfigError, DataMismatchError, DatasetNotFoundError

RGB = ["red", "green", "blue"]


def test_ucmerced_classification(tmp_path, data_cfg, torchgeo_layouts):
    cfg = data_cfg(tmp_path, **torchgeo_layouts.ucmerced(tmp_path))
    train = build_finetune_dataset(cfg, "classification", "train", 32, train=True)
    assert len(train) == 4
    sample = train[2]
    assert (
        set(sample) == {"image", "label"}
        and sample["image"].shape == (3, 32, 32)
        and sample["image"].dtype == torch.float32
    )
    assert sample["label"].dtype == torch.int64 and sample["label"].shape == () and int(sample["label"]) == 1
    assert train.source.labels() == [0, 0, 1, 1], "labels for stratification come from the class's targets"
    val = build_finetune_dataset(cfg, "classification", "val", 32, train=False)
    assert len(val) == 2 and float(val[0]["image"].max()) <= 1.0, "scaled by 1/255"


def test_bigearthnet_multilabel(tmp_path, data_cfg, torchgeo_layouts):
    fields = torchgeo_layouts.bigearthnet(tmp_path)
    cfg = data_cfg(tmp_path, **{**fields, "scale": 1.0}, bands=["red", "nir"])
    ds = build_finetune_dataset(cfg, "multilabel", "val", 64, train=False)
    sample = ds[0]
    assert set(sample) == {"image", "label"} and sample["image"].shape == (2, 64, 64)
    assert sample["label"].dtype == torch.float32 and sample["label"].shape == (43,)
    assert torch.nonzero(sample["label"]).flatten().tolist() == [17, 23], "Pastures and Coniferous forest"
    assert torch.allclose(sample["image"][0], torch.tensor(400.0)) and torch.allclose(
        sample["image"][1], torch.tensor(800.0)
    ), "red is the 4th Sentinel-2 band file (B04), nir the 8th (B08)"


def test_loveda_segmentation(tmp_path, data_cfg, torchgeo_layouts):
    cfg = data_cfg(tmp_path, **torchgeo_layouts.loveda(tmp_path))
    train = build_finetune_dataset(cfg, "segmentation", "train", 32, train=True)
    sample = train[1]
    assert (
        set(sample) == {"image", "mask"} and sample["image"].shape == (3, 32, 32) and sample["mask"].shape == (32, 32)
    )
    assert sample["mask"].dtype == torch.int64 and int(sample["mask"].max()) <= 7
    evaluation = build_finetune_dataset(cfg, "segmentation", "train", 32, train=False)
    assert len(evaluation) == 8, "each 40 x 40 scene gives a 2 x 2 grid of 32 px tiles"


def test_vaihingen_delivers_nir_red_green(tmp_path, data_cfg, torchgeo_layouts):
    truth = np.arange(36 * 36).reshape(36, 36) % 6
    fields = torchgeo_layouts.vaihingen2d(tmp_path, truth)
    cfg = data_cfg(tmp_path, **fields, bands=["red", "green", "nir"])
    sample = build_finetune_dataset(cfg, "segmentation", "train", 36, train=False)[0]
    assert sample["image"][:, 0, 0].tolist() == [60.0, 30.0, 90.0], "model bands taken by name from IR-R-G"
    assert torch.equal(sample["mask"], torch.from_numpy(truth)), "colours become class ids"
    wrong = data_cfg(tmp_path, **{**fields, "dataset_bands": RGB})
    with pytest.raises(DataMismatchError, match=r"Vaihingen2D delivers the bands \['nir', 'red', 'green'\]"):
        build_finetune_dataset(wrong, "segmentation", "train", 36, train=False)


@pytest.mark.parametrize("train", [True, False])
def test_a_split_without_the_tasks_target_is_an_error_when_built(tmp_path, data_cfg, torchgeo_layouts, train):
    """LoveDA withholds its test masks: reading its test split fails before any training, saying what to do."""
    fields = torchgeo_layouts.loveda(tmp_path)
    cfg = data_cfg(tmp_path, **{**fields, "splits": {"train": "train", "val": "val", "test": "test"}})
    message = r"torchgeo LoveDA split 'test' delivers \['image'\] without the segmentation target 'mask'.*data\.splits"
    with pytest.raises(DataMismatchError, match=message):
        build_finetune_dataset(cfg, "segmentation", "test", 32, train=train)


@pytest.mark.parametrize("name", ["LEVIRCD", "LEVIRCDPlus"])
def test_levircd_change(tmp_path, data_cfg, torchgeo_layouts, name):
    write = torchgeo_layouts.levircd_plus if name == "LEVIRCDPlus" else torchgeo_layouts.levircd
    cfg = data_cfg(tmp_path, **write(tmp_path))
    sample = build_finetune_dataset(cfg, "change", "train", 32, train=False)[0]
    assert set(sample) == {"image1", "image2", "mask"}, "torchgeo's (2, C, H, W) image becomes image1 and image2"
    assert sample["image1"].shape == sample["image2"].shape == (3, 32, 32)
    assert torch.allclose(sample["image2"] - sample["image1"], torch.tensor(50 / 255)), "before is the first date"
    assert sample["mask"].shape == (32, 32) and sample["mask"].dtype == torch.int64 and int(sample["mask"].sum()) == 80


def test_spacenet2_superres_pairs_ms_with_ps_ms_chips(tmp_path, data_cfg, torchgeo_layouts):
    fields = torchgeo_layouts.spacenet2(tmp_path)
    ds = build_finetune_dataset(data_cfg(tmp_path, **fields), "superres", "train", 64, train=True)
    assert len(ds) == 2
    sample = ds.source.load(1)
    assert set(sample) == {"image", "target"}
    assert sample["image"].shape == (4, 162, 162) and sample["target"].shape == (4, 648, 648), (
        "163 / 650 px chips trimmed to 162 / 648"
    )
    assert torch.allclose(sample["target"], torch.tensor(7 / 2047)), (
        "chip 7's MS image is paired with chip 7's PS-MS image"
    )
    crop = ds[0]
    assert crop["image"].shape == (4, 64, 64) and crop["target"].shape == (4, 256, 256)
    untrimmed = data_cfg(tmp_path, **{**fields, "superres_trim": False})
    with pytest.raises(DataMismatchError, match="650x650 is not scale_factor 4 x low resolution 163x163"):
        build_finetune_dataset(untrimmed, "superres", "train", 64, train=True)[0]


def test_spacenet2_superres_pairs_multispectral_with_pan_sharpened_rgb_chips(tmp_path, data_cfg, torchgeo_layouts):
    """SpaceNet2's MUL chips (here 4 bands) to its RGB-PanSharpen chips (3 bands): each side its own bands."""
    from geofm.data.writers import write_geotiff

    fields = torchgeo_layouts.spacenet2(tmp_path)
    area = tmp_path / "SN2_buildings" / "train" / "AOI_2_Vegas_Train"
    for chip in (3, 7):
        rgb = np.stack([np.full((650, 650), 100 * chip + band, np.uint16) for band in (1, 2, 3)])
        sharp = (0.31, 0.0, 500_000.0, 0.0, -0.31, 4_000_000.0)
        write_geotiff(
            area / "RGB-PanSharpen" / f"RGB-PanSharpen_AOI_2_Vegas_img{chip}.tif", rgb, transform=sharp, crs=32611
        )
    hr = {"dataset_bands": RGB, "bands": ["blue", "red"], "mean": [0.0] * 3, "std": [1.0] * 3}
    fields = {**fields, "hr_kwargs": {"image": "RGB-PanSharpen"}, "hr": hr, "bands": ["nir", "red"]}
    sample = build_finetune_dataset(data_cfg(tmp_path, **fields), "superres", "train", 64, train=True).source.load(1)
    assert sample["image"].shape == (2, 162, 162) and sample["target"].shape == (2, 648, 648)
    expected = torch.tensor([703 / 2047, 701 / 2047]).reshape(2, 1, 1).expand(2, 648, 648)
    torch.testing.assert_close(sample["target"], expected)  # chip 7's blue and red, scaled as the low-resolution side
    wrong = {
        **fields,
        "hr": {**hr, "dataset_bands": ["red", "green", "blue", "nir"], "mean": [0.0] * 4, "std": [1.0] * 4},
    }
    with pytest.raises(DataMismatchError, match=r"has 3 bands; data\.hr\.dataset_bands declares 4"):
        build_finetune_dataset(data_cfg(tmp_path, **wrong), "superres", "train", 64, train=True).source.load(0)


def test_missing_data_says_what_was_expected_and_how_to_get_it(tmp_path, data_cfg):
    cfg = data_cfg(tmp_path / "nothing", torchgeo="UCMerced", dataset_bands=RGB, num_classes=21)
    with pytest.raises(DatasetNotFoundError) as info:
        build_finetune_dataset(cfg, "classification", "train", 32, train=True)
    text = str(info.value)
    assert "torchgeo UCMerced found no data in" in text and "nothing" in text
    assert "torchgeo.datasets.UCMerced(root=..., split=..., download=True)" in text and "http" in text, text
    cfg = data_cfg(tmp_path / "nothing", torchgeo="Vaihingen2D", dataset_bands=["nir", "red", "green"], num_classes=6)
    with pytest.raises(DatasetNotFoundError, match="torchgeo cannot download it"):
        build_finetune_dataset(cfg, "segmentation", "train", 32, train=True)


def test_unknown_class_split_and_download_are_config_errors(tmp_path, data_cfg):
    with pytest.raises(ConfigError, match="no dataset class 'UCMerce'; did you mean UCMerced"):
        build_finetune_dataset(
            data_cfg(tmp_path, torchgeo="UCMerce", dataset_bands=RGB), "classification", "train", 32, True
        )
    cfg = data_cfg(tmp_path, torchgeo="Vaihingen2D", dataset_bands=["nir", "red", "green"], num_classes=6)
    with pytest.raises(
        ConfigError, match=r"data.splits.val: Vaihingen2D has no split 'val'; its splits are \['train', 'test'\]"
    ):
        build_finetune_dataset(cfg, "segmentation", "val", 32, train=False)
    cfg = data_cfg(tmp_path, torchgeo="UCMerced", kwargs={"download": True}, dataset_bands=RGB)
    with pytest.raises(ConfigError, match="geofm never downloads"):
        build_finetune_dataset(cfg, "classification", "train", 32, True)


def test_torchgeo_class_without_the_model_bands(tmp_path, data_cfg, torchgeo_layouts):
    fields = torchgeo_layouts.ucmerced(tmp_path, classes=("a",), per_split={"train": 1}, size=8)
    cfg = data_cfg(tmp_path, **{**fields, "dataset_bands": [*RGB, "nir"]}, bands=["red", "nir"])
    message = r"UCMerced delivers the bands \['red', 'green', 'blue'\].*cannot provide the model bands \['nir'\]"
    with pytest.raises(DataMismatchError, match=message):
        build_finetune_dataset(cfg, "classification", "train", 8, True)


def test_oscd_change_with_a_band_choice(tmp_path, data_cfg, torchgeo_layouts):
    fields = torchgeo_layouts.oscd(tmp_path)
    kwargs = {"bands": ["B04", "B03", "B02", "B08"]}
    cfg = data_cfg(tmp_path, **fields, kwargs=kwargs, dataset_bands=["red", "green", "blue", "nir"], bands=["nir"])
    sample = build_finetune_dataset(cfg, "change", "train", 24, train=False)[0]
    assert sample["image1"][0, 0, 0] == 701 and sample["image2"][0, 0, 0] == 702, "nir is B08 of each date"
    assert int(sample["mask"].sum()) == 3 * 24
    wrong = data_cfg(tmp_path, **fields, kwargs=kwargs, dataset_bands=["blue", "green", "red", "nir"])
    with pytest.raises(DataMismatchError, match=r"OSCD delivers the bands \['red', 'green', 'blue', 'nir'\]"):
        build_finetune_dataset(wrong, "change", "train", 24, train=False)
