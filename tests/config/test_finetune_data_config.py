"""The downstream data section: the fields that drive datasets, augmentation and subsets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from geofm.config.finetune import FinetuneDataConfig

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
