from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from geofm.data.readers import WindowReader, raster_info, read_bounds_lonlat, read_raster, same_grid, scaled_transform
from geofm.data.writers import GeoTiffWriter, write_geotiff
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
    with pytest.raises(RasterReadError, match=r"nope.tif"):
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


def test_georeferencing_is_read(tmp_path: Path, write_tif) -> None:
    raster = read_raster(write_tif(tmp_path / "a.tif", np.zeros((1, 3, 4), dtype=np.uint8)), 1)
    assert raster.crs == "EPSG:32632"
    assert raster.transform == (10.0, 0.0, 500_000.0, 0.0, -10.0, 5_000_000.0)
    info = raster_info(tmp_path / "a.tif")
    assert (info.height, info.width, info.count, info.dtype, info.crs) == (3, 4, 1, "uint8", "EPSG:32632")


def test_window_reader_reads_windows_and_refuses_leaving_the_raster(tmp_path: Path, write_tif) -> None:
    data = np.arange(2 * 30 * 40, dtype=np.uint16).reshape(2, 30, 40)
    path = write_tif(tmp_path / "scene.tif", data, nodata=7)
    with WindowReader(path, 2) as reader:
        assert reader.info.nodata == 7.0 and (reader.info.height, reader.info.width) == (30, 40)
        np.testing.assert_array_equal(reader.read(5, 10, 8, 12), data[:, 5:13, 10:22])
        with pytest.raises(RasterReadError, match="window rows 25:35, columns 0:4 leaves the 30x40 raster"):
            reader.read(25, 0, 10, 4)
    with pytest.raises(RasterReadError, match="has 2 bands, source declares 3"):
        WindowReader(path, 3)


def test_geotiff_writer_writes_blocks(tmp_path: Path) -> None:
    transform = (2.0, 0.0, 100.0, 0.0, -2.0, 50.0)
    grid = {"width": 300, "height": 270, "count": 1, "dtype": "uint8", "crs": "EPSG:32632", "transform": transform}
    with GeoTiffWriter(tmp_path / "out.tif", **grid, nodata=255) as writer:
        writer.write(np.full((1, 100, 300), 1, dtype=np.uint8), 0)
        writer.write(np.full((1, 170, 300), 2, dtype=np.uint8), 100)
        with pytest.raises(ValueError, match="leaves the 270x300 raster"):
            writer.write(np.zeros((1, 10, 300), dtype=np.uint8), 265)
    raster = read_raster(tmp_path / "out.tif", 1)
    assert raster.nodata == 255 and raster.transform == transform and raster.crs == "EPSG:32632"
    assert (raster.data[0, :100] == 1).all() and (raster.data[0, 100:] == 2).all()


def test_an_interrupted_geotiff_write_leaves_the_earlier_file_and_no_partial_one(tmp_path: Path) -> None:
    grid = {
        "width": 40,
        "height": 30,
        "count": 1,
        "dtype": "uint8",
        "crs": "EPSG:32632",
        "transform": (1, 0, 0, 0, -1, 0),
    }
    path = tmp_path / "scene_pred.tif"
    with GeoTiffWriter(path, **grid) as writer:
        writer.write(np.full((1, 30, 40), 1, dtype=np.uint8), 0)
        assert not path.exists(), "the path is taken only once the file is whole"
    with pytest.raises(KeyboardInterrupt), GeoTiffWriter(path, **grid) as writer:
        writer.write(np.full((1, 10, 40), 2, dtype=np.uint8), 0)
        raise KeyboardInterrupt
    assert (read_raster(path, 1).data == 1).all(), "the earlier prediction is intact"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scene_pred.tif"], "no partial file is left behind"


def test_same_grid_and_scaled_transform(tmp_path: Path, write_tif) -> None:
    a = raster_info(write_tif(tmp_path / "a.tif", np.zeros((1, 4, 4), dtype=np.uint8)))
    assert same_grid(a, raster_info(write_tif(tmp_path / "b.tif", np.ones((1, 4, 4), dtype=np.uint8)))) is None
    write_geotiff(tmp_path / "c.tif", np.zeros((1, 4, 4), dtype=np.uint8), transform=(10, 0, 0, 0, -10, 0), crs=32632)
    assert "transform" in same_grid(a, raster_info(tmp_path / "c.tif"))
    assert scaled_transform((10.0, 0.0, 500.0, 0.0, -10.0, 900.0), 4) == (2.5, 0.0, 500.0, 0.0, -2.5, 900.0)


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
