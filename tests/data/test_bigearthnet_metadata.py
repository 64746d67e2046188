"""BigEarthNet v2.0 patch metadata as decentralisation scenarios read it: country, and season from the name."""

from __future__ import annotations

import csv

import pandas as pd
import pytest

from geofm.cli import main
from geofm.data.finetune.bigearthnet import season_of

PATCHES = [
    ("S2A_MSIL2A_20170613T101031_N9999_R022_T33UUP_26_57", "train", "Austria"),  # June: summer
    ("S2B_MSIL2A_20180204T094159_N9999_R036_T35VNL_10_3", "train", "Finland"),  # February: winter
    ("S2A_MSIL2A_20171002T112111_N9999_R037_T29SNB_78_41", "validation", "Portugal"),  # October: autumn
    ("S2A_MSIL2A_20180417T102021_N9999_R065_T32TNR_1_2", "test", "Switzerland"),  # April: spring
    ("S2A_MSIL2A_20170717T113321_N9999_R080_T29UPU_49_70", "train", "Ireland"),  # July: summer
]


def test_seasons_are_meteorological_from_the_acquisition_month():
    assert [season_of(p) for p, _, _ in PATCHES] == ["summer", "winter", "autumn", "spring", "summer"]
    assert season_of("S2A_MSIL2A_20171201T101031_0_1") == "winter"  # v1.0 names carry the date alike
    with pytest.raises(ValueError, match="expected an acquisition time"):
        season_of("S2A_MSIL2A_patch_1")


def test_the_command_writes_one_row_per_sample_in_torchgeos_split_order(tmp_path, capsys):
    frame = pd.DataFrame(
        {
            "patch_id": [p for p, _, _ in PATCHES],
            "split": [s for _, s, _ in PATCHES],
            "country": [c for *_, c in PATCHES],
        }
    )
    frame.to_parquet(tmp_path / "metadata.parquet")
    out = tmp_path / "meta" / "bigearthnet.csv"
    assert main(["data", "bigearthnet-metadata", str(tmp_path), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["sample"], r["country"], r["season"]) for r in rows] == [
        ("train/0", "Austria", "summer"),
        ("train/1", "Finland", "winter"),
        ("train/2", "Ireland", "summer"),
        ("val/0", "Portugal", "autumn"),
        ("test/0", "Switzerland", "spring"),
    ]
    assert main(["data", "bigearthnet-metadata", str(tmp_path / "none"), "--out", str(out)]) != 0
    assert "none/metadata.parquet does not exist" in capsys.readouterr().err
