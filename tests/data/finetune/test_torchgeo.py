"""torchgeo datasets by class name, on tiny data written in each class's on-disk layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from geofm.data.finetune import build_finetune_dataset
from geofm.errors import ConfigError, DataMismatchError, DatasetNotFoundError

RGB = ["red", "green", "blue"]


def _png(path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_ucmerced_classification(tmp_path, data_cfg):
    rng = np.random.default_rng(0)
    images = tmp_path / "UCMerced_LandUse" / "Images"
    names = {"train": [], "val": [], "test": []}
    for c, name in enumerate(["agricultural", "beach"]):
        for i, split in enumerate(["train", "train", "val", "test"]):
            file = f"{name}{i:02d}.tif"
            _png(images / name / file, rng.integers(0, 255, (24, 24, 3), dtype=np.uint8))
            names[split].append(file)
    for split, files in names.items():
        (tmp_path / f"uc_merced-{split}.txt").write_text("\n".join(files) + "\n")
    cfg = data_cfg(tmp_path, torchgeo="UCMerced", dataset_bands=RGB, scale=1 / 255, num_classes=2)
    train = build_finetune_dataset(cfg, "classification", "train", 32, train=True)
    assert len(train) == 4
    sample = train[2]
    assert set(sample) == {"image", "label"} and sample["image"].shape == (3, 32, 32) and sample["image"].dtype == torch.float32
    assert sample["label"].dtype == torch.int64 and sample["label"].shape == () and int(sample["label"]) == 1
    assert train.source.labels() == [0, 0, 1, 1], "labels for stratification come from the class's targets"
    val = build_finetune_dataset(cfg, "classification", "val", 32, train=False)
    assert len(val) == 2 and float(val[0]["image"].max()) <= 1.0, "scaled by 1/255"


def test_bigearthnet_multilabel(tmp_path, data_cfg):
    bands = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B11", "B12"]
    root = tmp_path / "BigEarthNet-v1.0"
    patches = ["S2A_patch_0", "S2A_patch_1"]
    for p, patch in enumerate(patches):
        (root / patch).mkdir(parents=True)
        for b, band in enumerate(bands):
            Image.fromarray(np.full((20, 20), 100 * (b + 1) + p, dtype=np.uint16)).save(root / patch / f"{patch}_{band}.tif")
        labels = ["Pastures", "Coniferous forest"] if p == 0 else ["Sea and ocean"]
        (root / patch / f"{patch}_labels_metadata.json").write_text(json.dumps({"labels": labels}))
    for split in ("train", "val", "test"):
        (tmp_path / f"bigearthnet-{split}.csv").write_text("".join(f"{patch},S1_{patch}\n" for patch in patches))
    s2 = ["coastal", "blue", "green", "red", "rededge1", "rededge2", "rededge3", "nir", "nir08", "water_vapour", "swir16", "swir22"]
    cfg = data_cfg(
        tmp_path, torchgeo="BigEarthNet", kwargs={"bands": "s2", "num_classes": 43}, dataset_bands=s2, bands=["red", "nir"], num_classes=43
    )
    ds = build_finetune_dataset(cfg, "multilabel", "val", 64, train=False)
    sample = ds[0]
    assert set(sample) == {"image", "label"} and sample["image"].shape == (2, 64, 64)
    assert sample["label"].dtype == torch.float32 and sample["label"].shape == (43,)
    assert torch.nonzero(sample["label"]).flatten().tolist() == [17, 23], "Pastures and Coniferous forest"
    assert torch.allclose(sample["image"][0], torch.tensor(400.0)) and torch.allclose(sample["image"][1], torch.tensor(800.0)), (
        "red is the 4th Sentinel-2 band file (B04), nir the 8th (B08)"
    )


def test_loveda_segmentation(tmp_path, data_cfg):
    rng = np.random.default_rng(1)
    for i in range(2):
        _png(tmp_path / "Train" / "Urban" / "images_png" / f"{i}.png", rng.integers(0, 255, (40, 40, 3), dtype=np.uint8))
        _png(tmp_path / "Train" / "Urban" / "masks_png" / f"{i}.png", rng.integers(0, 8, (40, 40), dtype=np.uint8))
    cfg = data_cfg(tmp_path, torchgeo="LoveDA", kwargs={"scene": ["urban"]}, dataset_bands=RGB, num_classes=8, ignore_index=0)
    train = build_finetune_dataset(cfg, "segmentation", "train", 32, train=True)
    sample = train[1]
    assert set(sample) == {"image", "mask"} and sample["image"].shape == (3, 32, 32) and sample["mask"].shape == (32, 32)
    assert sample["mask"].dtype == torch.int64 and int(sample["mask"].max()) <= 7
    evaluation = build_finetune_dataset(cfg, "segmentation", "train", 32, train=False)
    assert len(evaluation) == 8, "each 40 x 40 scene gives a 2 x 2 grid of 32 px tiles"


def test_vaihingen_delivers_nir_red_green(tmp_path, data_cfg):
    colours = np.array([(255, 0, 0), (255, 255, 255), (0, 0, 255), (0, 255, 255), (0, 255, 0), (255, 255, 0)], dtype=np.uint8)
    truth = np.arange(36 * 36).reshape(36, 36) % 6
    for area in ("area1", "area3"):
        _png(tmp_path / "top" / f"top_mosaic_09cm_{area}.tif", np.full((36, 36, 3), (90, 60, 30), dtype=np.uint8))
        _png(tmp_path / f"top_mosaic_09cm_{area}.tif", colours[truth])
    cfg = data_cfg(tmp_path, torchgeo="Vaihingen2D", dataset_bands=["nir", "red", "green"], bands=["red", "green", "nir"], num_classes=6)
    sample = build_finetune_dataset(cfg, "segmentation", "train", 36, train=False)[0]
    assert sample["image"][:, 0, 0].tolist() == [60.0, 30.0, 90.0], "model bands taken by name from IR-R-G"
    assert torch.equal(sample["mask"], torch.from_numpy(truth)), "colours become class ids"
    wrong = data_cfg(tmp_path, torchgeo="Vaihingen2D", dataset_bands=RGB, num_classes=6)
    with pytest.raises(DataMismatchError, match=r"Vaihingen2D delivers the bands \['nir', 'red', 'green'\]"):
        build_finetune_dataset(wrong, "segmentation", "train", 36, train=False)


@pytest.mark.parametrize("name", ["LEVIRCD", "LEVIRCDPlus"])
def test_levircd_change(tmp_path, data_cfg, name):
    root = tmp_path / "LEVIR-CD+" / "train" if name == "LEVIRCDPlus" else tmp_path
    prefix = "" if name == "LEVIRCDPlus" else "train_"
    if name == "LEVIRCDPlus":
        (tmp_path / "LEVIR-CD+" / "test").mkdir(parents=True)
    before = np.zeros((32, 32, 3), dtype=np.uint8)
    change = np.zeros((32, 32), dtype=np.uint8)
    change[4:12, 20:30] = 255
    _png(root / "A" / f"{prefix}1.png", before)
    _png(root / "B" / f"{prefix}1.png", before + 50)
    _png(root / "label" / f"{prefix}1.png", change)
    cfg = data_cfg(tmp_path, torchgeo=name, dataset_bands=RGB, scale=1 / 255, num_classes=2)
    sample = build_finetune_dataset(cfg, "change", "train", 32, train=False)[0]
    assert set(sample) == {"image1", "image2", "mask"}, "torchgeo's (2, C, H, W) image becomes image1 and image2"
    assert sample["image1"].shape == sample["image2"].shape == (3, 32, 32)
    assert torch.allclose(sample["image2"] - sample["image1"], torch.tensor(50 / 255)), "before is the first date"
    assert sample["mask"].shape == (32, 32) and sample["mask"].dtype == torch.int64 and int(sample["mask"].sum()) == 80


def test_spacenet2_superres_pairs_ms_with_ps_ms_chips(tmp_path, data_cfg, tif):
    area = tmp_path / "SN2_buildings" / "train" / "AOI_2_Vegas_Train"
    rng = np.random.default_rng(2)
    for chip in (3, 7):
        tif(area / "MUL" / f"MUL_AOI_2_Vegas_img{chip}.tif", rng.integers(1, 2000, (4, 163, 163)).astype(np.uint16))
        tif(area / "MUL-PanSharpen" / f"MUL-PanSharpen_AOI_2_Vegas_img{chip}.tif", np.full((4, 650, 650), chip, dtype=np.uint16))
        geojson = area / "geojson" / "buildings" / f"buildings_AOI_2_Vegas_img{chip}.geojson"
        geojson.parent.mkdir(parents=True, exist_ok=True)
        geojson.write_text(json.dumps({"type": "FeatureCollection", "features": []}))
    fields = dict(
        torchgeo="SpaceNet2",
        kwargs={"aois": [2]},
        lr_kwargs={"image": "MUL"},
        hr_kwargs={"image": "MUL-PanSharpen"},
        dataset_bands=["blue", "green", "red", "nir"],
        scale_factor=4,
    )
    ds = build_finetune_dataset(data_cfg(tmp_path, superres_trim=True, **fields), "superres", "train", 64, train=True)
    assert len(ds) == 2
    sample = ds.source.load(1)
    assert set(sample) == {"image", "target"}
    assert sample["image"].shape == (4, 162, 162) and sample["target"].shape == (4, 648, 648), "163 / 650 px chips trimmed to 162 / 648"
    assert (sample["target"] == 7).all(), "chip 7's MS image is paired with chip 7's PS-MS image"
    crop = ds[0]
    assert crop["image"].shape == (4, 64, 64) and crop["target"].shape == (4, 256, 256)
    with pytest.raises(DataMismatchError, match="650x650 is not scale_factor 4 x low resolution 163x163"):
        build_finetune_dataset(data_cfg(tmp_path, **fields), "superres", "train", 64, train=True)[0]


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
        build_finetune_dataset(data_cfg(tmp_path, torchgeo="UCMerce", dataset_bands=RGB), "classification", "train", 32, True)
    cfg = data_cfg(tmp_path, torchgeo="Vaihingen2D", dataset_bands=["nir", "red", "green"], num_classes=6)
    with pytest.raises(ConfigError, match="refuses split='val'"):
        build_finetune_dataset(cfg, "segmentation", "val", 32, train=False)
    cfg = data_cfg(tmp_path, torchgeo="UCMerced", kwargs={"download": True}, dataset_bands=RGB)
    with pytest.raises(ConfigError, match="geofm never downloads"):
        build_finetune_dataset(cfg, "classification", "train", 32, True)


def test_torchgeo_class_without_the_model_bands(tmp_path, data_cfg):
    (tmp_path / "UCMerced_LandUse" / "Images" / "a").mkdir(parents=True)
    _png(tmp_path / "UCMerced_LandUse" / "Images" / "a" / "x.tif", np.zeros((8, 8, 3), dtype=np.uint8))
    (tmp_path / "uc_merced-train.txt").write_text("x.tif\n")
    cfg = data_cfg(tmp_path, torchgeo="UCMerced", dataset_bands=[*RGB, "nir"], bands=["red", "nir"])
    message = r"UCMerced delivers the bands \['red', 'green', 'blue'\].*cannot provide the model bands \['nir'\]"
    with pytest.raises(DataMismatchError, match=message):
        build_finetune_dataset(cfg, "classification", "train", 8, True)


def test_oscd_change_with_a_band_choice(tmp_path, data_cfg):
    images = tmp_path / "Onera Satellite Change Detection dataset - Images" / "paris"
    bands = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12"]
    for date in (1, 2):
        (images / f"imgs_{date}_rect").mkdir(parents=True)
        for b, band in enumerate(bands):
            Image.fromarray(np.full((24, 24), 100 * b + date, dtype=np.uint16)).save(images / f"imgs_{date}_rect" / f"{band}.tif")
    (images / "dates.txt").write_text("date_1: 20160101\ndate_2: 20180101\n")
    change = np.zeros((24, 24), dtype=np.uint8)
    change[:3] = 255
    _png(tmp_path / "Onera Satellite Change Detection dataset - Train Labels" / "paris" / "cm" / "cm.png", change)
    kwargs = {"bands": ["B04", "B03", "B02", "B08"]}
    cfg = data_cfg(tmp_path, torchgeo="OSCD", kwargs=kwargs, dataset_bands=["red", "green", "blue", "nir"], bands=["nir"], num_classes=2)
    sample = build_finetune_dataset(cfg, "change", "train", 24, train=False)[0]
    assert sample["image1"][0, 0, 0] == 701 and sample["image2"][0, 0, 0] == 702, "nir is B08 of each date"
    assert int(sample["mask"].sum()) == 3 * 24
    wrong = data_cfg(tmp_path, torchgeo="OSCD", kwargs=kwargs, dataset_bands=["blue", "green", "red", "nir"], num_classes=2)
    with pytest.raises(DataMismatchError, match=r"OSCD delivers the bands \['red', 'green', 'blue', 'nir'\]"):
        build_finetune_dataset(wrong, "change", "train", 24, train=False)
