"""The downstream data section: the fields that drive datasets, augmentation and subsets."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from geofm.config.finetune import FinetuneConfig
from geofm.config.finetune_data import FinetuneDataConfig

BASE = {"root": "data/x", "bands": ["red"], "dataset_bands": ["b04"], "mean": [0.0], "std": [1.0]}


def test_defaults_and_band_aliases():
    cfg = FinetuneDataConfig(**BASE)
    assert cfg.dataset_bands == ["red"], "aliases resolve to canonical names"
    assert cfg.folders == {} and cfg.crop_scale == (0.5, 1.0) and cfg.hflip and cfg.vflip
    assert cfg.subset_seed == 0 and cfg.suffixes[0] == ".tif" and not cfg.superres_trim


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"crop_scale": (0.8, 0.5)}, "crop_scale must satisfy"),
        ({"suffixes": ["tif"]}, "suffixes must be file name endings"),
        ({"lr_kwargs": {"image": "MUL"}}, "lr_kwargs and data.hr_kwargs configure torchgeo classes"),
        ({"torchgeo": "LEVIRCD", "folders": {"before": "t1"}}, "a torchgeo class reads its own layout"),
        ({"class_names": ["a", "a"]}, "repeats names"),
        ({"splits": {"train": "t", "validation": "v"}}, "splits.validation"),
        ({"folder": {"images": "x"}}, "folder"),
    ],
)
def test_invalid_fields(fields, message):
    with pytest.raises(ValidationError, match=message):
        FinetuneDataConfig(**{**BASE, **fields})


def test_splits_not_given_keep_their_own_names():
    cfg = FinetuneDataConfig(**BASE, splits={"val": "test"})
    assert cfg.splits == {"train": "train", "val": "test", "test": "test"}, f"splits {cfg.splits}"


def test_a_split_override_changes_that_split_only():
    config = Path(__file__).parents[2] / "configs/finetune/demo_segmentation__swin_micro.yaml"
    cfg = FinetuneConfig.from_file(config, ["data.splits.test=val"])
    assert cfg.data.splits == {"train": "train", "val": "val", "test": "val"}, f"splits {cfg.data.splits}"


HR = {"dataset_bands": ["b04", "b03", "b02"], "mean": [0.3] * 3, "std": [0.1] * 3}


def test_the_high_resolution_side_has_its_own_bands_and_normalisation():
    cfg = FinetuneDataConfig(**{**BASE, "scale": 0.5, "hr": HR})
    assert cfg.hr is not None and cfg.hr.dataset_bands == ["red", "green", "blue"], "aliases resolve"
    assert cfg.hr.bands == ["red", "green", "blue"], "its model bands default to all it delivers"
    assert cfg.hr.scale == 0.5 and cfg.hr.nodata is None, "the scale defaults to the low-resolution side's"
    assert FinetuneDataConfig(**BASE).hr is None, "without it, both sides share the low-resolution side's spec"
    custom = FinetuneDataConfig(
        **{**BASE, "custom_bands": ["pan2"], "hr": {**HR, "dataset_bands": ["pan2"], "mean": [0], "std": [1]}}
    )
    assert custom.hr.bands == ["pan2"], "custom bands name either side's bands"


@pytest.mark.parametrize(
    ("hr", "message"),
    [
        (
            {**HR, "bands": ["nir"]},
            r"data\.hr\.bands \['nir'\] are not among the dataset's bands \['red', 'green', 'blue'\]",
        ),
        ({**HR, "mean": [0.3]}, r"data\.hr\.mean and data\.hr\.std need one value per dataset band \(3\), got 1 and 3"),
        ({**HR, "std": [0.1, 0.0, 0.1]}, r"data\.hr\.std values must be positive"),
        ({**HR, "dataset_bands": ["red", "rouge"]}, r"data\.hr\.dataset_bands"),
        ({**HR, "kwargs": {}}, r"hr\.kwargs"),
    ],
)
def test_invalid_high_resolution_sides(hr, message):
    with pytest.raises(ValidationError, match=message):
        FinetuneDataConfig(**{**BASE, "hr": hr})
