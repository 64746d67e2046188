"""Bad downstream input is a clear error naming the file at fault."""

from __future__ import annotations

import numpy as np
import pytest

from geofm.config.finetune_data import FinetuneDataConfig
from geofm.data.finetune import build_finetune_dataset
from geofm.errors import ConfigError, DataMismatchError, DatasetNotFoundError, RasterReadError


def _segmentation(tmp_path, tif, image_hw=(16, 16), mask_hw=(16, 16), mask_value=1):
    tif(tmp_path / "train" / "images" / "a.tif", np.ones((1, *image_hw), dtype=np.uint16))
    tif(tmp_path / "train" / "masks" / "a.tif", np.full((1, *mask_hw), mask_value, dtype=np.uint8))
    return tmp_path / "train" / "masks" / "a.tif"


def test_mask_of_another_size(tmp_path, tif, data_cfg):
    _segmentation(tmp_path, tif, mask_hw=(16, 12))
    with pytest.raises(DataMismatchError, match=r"a\.tif: the mask a\.tif is 16x12 pixels, the image 16x16"):
        build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "segmentation", "train", 16, train=True)


def test_class_ids_outside_the_classes(tmp_path, tif, data_cfg):
    mask = _segmentation(tmp_path, tif, mask_value=7)
    with pytest.raises(DataMismatchError) as info:  # found when the split is built: its first scene is read
        build_finetune_dataset(data_cfg(tmp_path, num_classes=5, ignore_index=255), "segmentation", "train", 16, True)
    assert str(mask) in str(info.value) and "values 7 are outside the classes 0..4 or ignore_index 255" in str(
        info.value
    )


def test_ignore_index_is_allowed_but_a_split_without_a_labelled_pixel_is_refused(tmp_path, tif, data_cfg):
    mask = np.full((1, 16, 16), 255, dtype=np.uint8)
    mask[0, :2, :2] = 3
    tif(tmp_path / "train" / "images" / "a.tif", np.ones((1, 16, 16), dtype=np.uint16))
    tif(tmp_path / "train" / "masks" / "a.tif", mask)
    cfg = data_cfg(tmp_path, num_classes=5, ignore_index=255)
    sample = build_finetune_dataset(cfg, "segmentation", "train", 16, train=False)[0]
    assert int((sample["mask"] == 255).sum()) == 252 and int((sample["mask"] == 3).sum()) == 4
    tif(tmp_path / "train" / "masks" / "a.tif", np.full((1, 16, 16), 255, dtype=np.uint8))
    with pytest.raises(DataMismatchError) as info:
        build_finetune_dataset(cfg, "segmentation", "train", 16, train=True)
    text = str(info.value)
    assert f"the folders at {tmp_path}, split train" in text and "none of its 1 scenes has a labelled pixel" in text


def test_classification_label_outside_the_classes_from_torchgeo_style_labels():
    from geofm.data.finetune.checks import class_label

    with pytest.raises(DataMismatchError, match=r"sample.png: class id 4 is outside the classes 0..3"):
        class_label(4, 4, "sample.png")


def test_change_mask_with_other_values(tmp_path, tif, data_cfg):
    for part in ("A", "B"):
        tif(tmp_path / "train" / part / "a.tif", np.ones((1, 8, 8), dtype=np.uint8))
    tif(tmp_path / "train" / "label" / "a.tif", np.full((1, 8, 8), 2, dtype=np.uint8))
    with pytest.raises(DataMismatchError, match=r"label/a\.tif: change mask values 2 are none of 0"):
        build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "change", "train", 8, train=False)


@pytest.mark.parametrize(
    ("after", "message"),
    [
        ({"crs": "EPSG:32633"}, "CRS EPSG:32632 vs EPSG:32633"),
        ({"transform": (10.0, 0.0, 500_010.0, 0.0, -10.0, 5_000_000.0)}, "transform"),
        ({"shape": (1, 8, 9)}, "size 8x8 vs 8x9 pixels"),
    ],
)
def test_before_and_after_on_different_grids(tmp_path, tif, data_cfg, after, message):
    tif(tmp_path / "train" / "A" / "a.tif", np.ones((1, 8, 8), dtype=np.uint8))
    shape = after.pop("shape", (1, 8, 8))
    tif(tmp_path / "train" / "B" / "a.tif", np.ones(shape, dtype=np.uint8), **after)
    tif(tmp_path / "train" / "label" / "a.tif", np.zeros((1, 8, 8), dtype=np.uint8))
    with pytest.raises(DataMismatchError) as info:
        build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "change", "train", 8, train=True)
    text = str(info.value)
    assert "A/a.tif" in text and "B/a.tif" in text and message in text, text


def test_superres_pair_off_the_scale_factor(tmp_path, tif, data_cfg):
    tif(tmp_path / "train" / "lr" / "a.tif", np.ones((1, 10, 10), dtype=np.uint8))
    tif(tmp_path / "train" / "hr" / "a.tif", np.ones((1, 30, 30), dtype=np.uint8))
    ds = build_finetune_dataset(data_cfg(tmp_path, scale_factor=4), "superres", "train", 8, train=True)
    with pytest.raises(DataMismatchError) as info:
        ds[0]
    text = str(info.value)
    assert "lr/a.tif" in text and "hr/a.tif" in text and "30x30 is not scale_factor 4 x low resolution 10x10" in text, (
        text
    )


def test_superres_trim_crops_near_misses_to_the_exact_fit(tmp_path, tif, data_cfg):
    tif(
        tmp_path / "train" / "lr" / "a.tif", np.ones((1, 41, 41), dtype=np.uint8), transform=(4.0, 0, 0.0, 0, -4.0, 0.0)
    )
    tif(
        tmp_path / "train" / "hr" / "a.tif",
        np.ones((1, 162, 162), dtype=np.uint8),
        transform=(1.0, 0, 0.0, 0, -1.0, 0.0),
    )
    with pytest.raises(DataMismatchError, match=r"data.superres_trim crops such pairs"):
        build_finetune_dataset(data_cfg(tmp_path, scale_factor=4), "superres", "train", 40, train=False)
    trimmed = build_finetune_dataset(
        data_cfg(tmp_path, scale_factor=4, superres_trim=True), "superres", "train", 40, train=False
    )
    assert trimmed.source.load(0)["image"].shape == (1, 40, 40) and trimmed.source.load(0)["target"].shape == (
        1,
        160,
        160,
    )


def test_superres_pair_of_other_areas(tmp_path, tif, data_cfg):
    tif(tmp_path / "train" / "lr" / "a.tif", np.ones((1, 4, 4), dtype=np.uint8), transform=(4.0, 0, 0.0, 0, -4.0, 0.0))
    tif(tmp_path / "train" / "hr" / "a.tif", np.ones((1, 8, 8), dtype=np.uint8), transform=(2.0, 0, 50.0, 0, -2.0, 0.0))
    ds = build_finetune_dataset(data_cfg(tmp_path, scale_factor=2), "superres", "train", 4, train=True)
    with pytest.raises(
        DataMismatchError, match=r"high-resolution transform .* is not the low-resolution one at scale_factor 2"
    ):
        ds[0]


def test_files_without_partners_are_named_when_built(tmp_path, tif, data_cfg):
    for stem in ("a", "b", "c"):
        tif(tmp_path / "train" / "images" / f"{stem}.tif", np.ones((1, 4, 4), dtype=np.uint8))
    for stem in ("a", "d"):
        tif(tmp_path / "train" / "masks" / f"{stem}.tif", np.ones((1, 4, 4), dtype=np.uint8))
    with pytest.raises(DataMismatchError) as info:
        build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "segmentation", "train", 4, train=True)
    text = str(info.value)
    assert "masks lacks b, c" in text and "images lacks d" in text, text


def test_image_with_other_bands_than_declared(tmp_path, tif, data_cfg):
    path = tif(tmp_path / "train" / "x" / "a.tif", np.ones((3, 4, 4), dtype=np.uint8))
    ds = build_finetune_dataset(
        data_cfg(tmp_path, dataset_bands=["red", "green", "blue", "nir"]), "classification", "train", 4, True
    )
    with pytest.raises(RasterReadError) as info:
        ds[0]
    assert str(path) in str(info.value) and "has 3 bands, source declares 4 (red, green, blue, nir)" in str(info.value)


def test_dataset_without_the_model_bands_names_the_missing_ones(tmp_path):
    with pytest.raises(
        ValueError, match=r"data.bands \['nir'\] are not among the dataset's bands \['red', 'green', 'blue'\]"
    ):
        FinetuneDataConfig(
            root=tmp_path, bands=["red", "nir"], dataset_bands=["red", "green", "blue"], mean=[0, 0, 0], std=[1, 1, 1]
        )


def test_missing_split_folder_and_unknown_layout_part(tmp_path, data_cfg):
    with pytest.raises(DatasetNotFoundError, match=r"the val split folder .*/val does not exist"):
        build_finetune_dataset(data_cfg(tmp_path), "segmentation", "val", 8, train=False)
    (tmp_path / "val").mkdir()
    with pytest.raises(ConfigError, match=r"data.folders: \['labels'\] are not parts of a change split folder"):
        build_finetune_dataset(data_cfg(tmp_path, folders={"labels": "gt"}), "change", "val", 8, train=False)


def test_class_folders_against_the_config(tmp_path, tif, data_cfg):
    for name in ("a", "b", "c"):
        tif(tmp_path / "train" / name / "x.tif", np.ones((1, 4, 4), dtype=np.uint8))
    with pytest.raises(DataMismatchError, match=r"3 class folders \['a', 'b', 'c'\] for data.num_classes 2"):
        build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "classification", "train", 4, True)
    with pytest.raises(DataMismatchError, match=r"class folders \['c'\] are not in data.class_names"):
        build_finetune_dataset(data_cfg(tmp_path, class_names=["a", "b"]), "classification", "train", 4, True)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("image,a,b\nx.tif,1,2\n", "line 2: expected an image name and 2 values 0 or 1"),
        ("image,a,b\ny.tif,1,0\n", "names images missing from"),
        ("file,a,b\nx.tif,1,0\n", "expected a header 'image,<class 1>"),
        ("image,a,c\nx.tif,1,0\n", r"classes \['a', 'c'\] differ from data.class_names \['a', 'b'\]"),
    ],
)
def test_malformed_label_tables(tmp_path, tif, data_cfg, table, message):
    tif(tmp_path / "train" / "images" / "x.tif", np.ones((1, 4, 4), dtype=np.uint8))
    (tmp_path / "train" / "labels.csv").write_text(table)
    with pytest.raises(DataMismatchError, match=message) as info:
        build_finetune_dataset(data_cfg(tmp_path, class_names=["a", "b"]), "multilabel", "train", 4, True)
    assert "labels.csv" in str(info.value)
