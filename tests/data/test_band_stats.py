from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from geofm.config import SourceConfig
from geofm.data.stats import BandStats, compute_band_stats, compute_band_stats_for, format_stats_yaml
from geofm.errors import DatasetNotFoundError


def test_stats_match_numpy_over_valid_pixels(tmp_path: Path, write_tif) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1000, (2, 9, 7)).astype(np.uint16) for _ in range(3)]
    arrays[1][0, :4] = 0
    arrays[2][1, :, :2] = 0
    for i, a in enumerate(arrays):
        write_tif(tmp_path / f"{i}.tif", a, nodata=0)

    stats = compute_band_stats(root=tmp_path, pattern="*.tif", bands=["red", "nir"], scale=0.001)
    for b in range(2):
        values = np.concatenate([a[b][a[b] != 0] for a in arrays]).astype(np.float64) * 0.001
        assert stats.pixels[b] == values.size
        assert stats.mean[b] == pytest.approx(values.mean(), rel=1e-12)
        assert stats.std[b] == pytest.approx(values.std(), rel=1e-10)
    assert stats.files == 3
    assert stats.bands == ["red", "nir"]


def test_stats_known_values_and_nodata_override(tmp_path: Path, write_tif) -> None:
    write_tif(tmp_path / "a.tif", np.array([[[1.0, 3.0, -9.0, np.nan]]], dtype=np.float32))
    stats = compute_band_stats(root=tmp_path, pattern="*.tif", bands=["x"], nodata=-9.0)
    assert stats == BandStats(bands=["x"], mean=[2.0], std=[1.0], pixels=[2], files=1)


def test_stats_max_files_evenly_spaced(tmp_path: Path, write_tif) -> None:
    for i in range(10):
        write_tif(tmp_path / f"{i:02d}.tif", np.full((1, 2, 2), i, dtype=np.uint8))
    stats = compute_band_stats(root=tmp_path, pattern="*.tif", bands=["x"], max_files=3)
    assert stats.files == 3
    assert stats.mean[0] == pytest.approx((0 + 4 + 9) / 3) or stats.mean[0] == pytest.approx((0 + 5 + 9) / 3)
    assert compute_band_stats(root=tmp_path, pattern="*.tif", bands=["x"], max_files=50).files == 10
    with pytest.raises(ValueError, match="max_files"):
        compute_band_stats(root=tmp_path, pattern="*.tif", bands=["x"], max_files=0)


def test_stats_band_without_valid_pixel(tmp_path: Path, write_tif) -> None:
    write_tif(tmp_path / "a.tif", np.zeros((1, 3, 3), dtype=np.uint8), nodata=0)
    with pytest.raises(ValueError, match="no valid pixel"):
        compute_band_stats(root=tmp_path, pattern="*.tif", bands=["x"])


def test_stats_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError):
        compute_band_stats(root=tmp_path / "absent", pattern="*.tif", bands=["x"])


def test_stats_for_source_config_and_yaml(tmp_path: Path, write_tif) -> None:
    write_tif(tmp_path / "a.tif", np.array([[[10, 30]], [[255, 255]]], dtype=np.uint8))
    cfg = SourceConfig(
        name="s", root=tmp_path, pattern="*.tif", bands=["red", "green"], scale=0.1, mean=[0, 0], std=[1, 1]
    )
    stats = compute_band_stats_for(cfg)
    assert stats.mean == pytest.approx([2.0, 25.5])
    assert stats.std == pytest.approx([1.0, 0.0])

    text = format_stats_yaml(BandStats(["a", "b"], [0.123456789, 1234567.0], [2.0, 1e-7], [1, 1], 1))
    assert "mean: [0.123457, 1.23457e+06]" in text
    assert "std: [2, 1.0e-07]" in text
    parsed = yaml.safe_load(text)
    assert parsed["mean"] == pytest.approx([0.123457, 1.23457e6])
    assert parsed["std"] == pytest.approx([2.0, 1e-7])


def test_stats_of_a_product_source_are_of_its_reflectance_over_unflagged_pixels(tmp_path: Path) -> None:
    from geofm.data.products.synthetic import write_sentinel2_safe

    blue = np.full((8, 8), 1500, dtype=np.uint16)  # reflectance 0.05 at baseline 04.00
    blue[:, :4] = 3500  # 0.25, under cloud
    scl = np.full((4, 4), 4, dtype=np.uint8)
    scl[:, :2] = 9
    write_sentinel2_safe(tmp_path, "a", {"B02": (blue, 10)}, scl=scl)
    cfg = SourceConfig(name="s2", root=tmp_path, layout="sentinel2_safe", bands=["blue"], mean=[0], std=[1], quality={})
    stats = compute_band_stats_for(cfg)
    assert stats.mean == pytest.approx([0.05]) and stats.std == pytest.approx([0.0], abs=1e-7)
    assert stats.pixels == [32] and stats.files == 1
