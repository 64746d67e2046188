"""The downstream data section: the fields that drive datasets, augmentation and subsets."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from geofm.config.finetune import FinetuneConfig, FinetuneDataConfig

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
