from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from geofm.data.readers import read_bounds_lonlat, read_raster, write_geotiff
from geofm.errors import RasterReadError


def test_geotiff_roundtrip(tmp_path: Path, write_tif) -> None:
    data = np.arange(2 * 5 * 7, dtype=np.uint16).reshape(2, 5, 7)
    path = write_tif(tmp_path / "a.tif", data, nodata=0)
    raster = read_raster(path, 2)
    np.testing.assert_array_equal(raster.data, data)
    assert raster.dtype == "uint16"
    assert raster.data.dtype == np.uint16
    assert raster.nodata == 0.0


def test_geotiff_without_nodata(tmp_path: Path, write_tif) -> None:
    path = write_tif(tmp_path / "a.tif", np.ones((1, 4, 4), dtype=np.float32))
    raster = read_raster(path, 1)
    assert raster.nodata is None
    assert raster.dtype == "float32"


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_png_and_jpeg_without_georeferencing_warning(tmp_path: Path, suffix: str) -> None:
    rgb = np.random.default_rng(0).integers(0, 255, (12, 10, 3), dtype=np.uint8)
    path = tmp_path / f"photo{suffix}"
    Image.fromarray(rgb).save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raster = read_raster(path, 3)
    assert raster.data.shape == (3, 12, 10)
    assert raster.dtype == "uint8"
    if suffix == ".png":
        np.testing.assert_array_equal(raster.data, rgb.transpose(2, 0, 1))


def test_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.tif"
    path.write_bytes(np.random.default_rng(0).bytes(2048))
    with pytest.raises(RasterReadError, match="cannot read raster") as info:
        read_raster(path, 3)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


def test_truncated_geotiff(tmp_path: Path, write_tif) -> None:
    data = np.random.default_rng(0).integers(0, 255, (3, 128, 128), dtype=np.uint8)
    full = write_tif(tmp_path / "full.tif", data)
    cut = tmp_path / "cut.tif"
    blob = full.read_bytes()
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(RasterReadError) as info:
        read_raster(cut, 3)
    assert str(cut) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RasterReadError, match="nope.tif"):
        read_raster(tmp_path / "nope.tif", 1)


def test_wrong_band_count_names_bands(tmp_path: Path, write_tif) -> None:
    path = write_tif(tmp_path / "rgb.tif", np.zeros((3, 4, 4), dtype=np.uint8))
    with pytest.raises(RasterReadError) as info:
        read_raster(path, 4, band_names=["red", "green", "blue", "nir"])
    assert info.value.reason == "has 3 bands, source declares 4 (red, green, blue, nir)"
    assert str(path) in str(info.value)


def test_complex_dtype_rejected(tmp_path: Path, write_tif) -> None:
    path = write_tif(tmp_path / "c.tif", np.zeros((1, 4, 4), dtype=np.complex64))
    with pytest.raises(RasterReadError, match="complex64"):
        read_raster(path, 1)


def test_write_geotiff_needs_three_dimensions(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bands, height, width"):
        write_geotiff(tmp_path / "x.tif", np.zeros((4, 4)), transform=(1, 0, 0, 0, -1, 0), crs=32632)


def test_bounds_in_lonlat_from_a_projected_file(tmp_path: Path, write_tif) -> None:
    # 16 x 16 pixels of 10 m from (500000 E, 5000000 N) in UTM zone 32N: the zone's central meridian, 9 E.
    path = write_tif(tmp_path / "utm.tif", np.zeros((1, 16, 16), dtype=np.uint8))
    west, south, east, north = read_bounds_lonlat(path)
    assert west == pytest.approx(9.0, abs=1e-9)
    assert east == pytest.approx(9.0 + 160 / 78_600, abs=1e-4), "160 m east at 45 N is about 0.002 degrees"
    assert (south, north) == (pytest.approx(45.15204, abs=1e-5), pytest.approx(45.15348, abs=1e-5))


def test_bounds_need_a_crs(tmp_path: Path) -> None:
    path = tmp_path / "photo.png"
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(path)
    with pytest.raises(RasterReadError, match="no coordinate reference system"):
        read_bounds_lonlat(path)
