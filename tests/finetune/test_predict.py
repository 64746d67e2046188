"""Sliding-window inference: georeferencing, blending without seams, windowed reads, streaming writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import rasterio
import rasterio.shutil
import torch
import torch.nn.functional as F
from rio_cogeo.cogeo import cog_validate

from finetune.predict import blend_weights, predict_scene, tile_origins
from geofm.data.block_stream import BlockStreamWriter, written_record
from geofm.data.finetune import BandNormaliser
from geofm.data.readers import WindowReader, read_raster
from geofm.data.writers import write_geotiff
from geofm.errors import ConfigError, DataMismatchError

TRANSFORM = (10.0, 0.0, 600_000.0, 0.0, -10.0, 4_000_000.0)
BANDS = ["blue", "green", "red"]
HEIGHT, WIDTH = 219, 301


def _normaliser(nodata: float | None = None) -> BandNormaliser:
    return BandNormaliser(BANDS, ["red", "green", "blue"], 0.001, [0.5, 0.4, 0.3], [0.2, 0.25, 0.3], nodata)


def _normalised(data: np.ndarray, norm: BandNormaliser) -> np.ndarray:
    x = (data[norm.keep].astype(np.float32) * np.float32(norm.scale) - norm.mean) / norm.std
    x[data[norm.keep] == 0] = 0
    return x


@pytest.fixture
def scene(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A 219 x 301 uint16 scene of three bands with a nodata corner."""
    data = np.random.default_rng(0).integers(1, 1000, (3, HEIGHT, WIDTH)).astype(np.uint16)
    data[:, 200:, :30] = 0
    path = tmp_path / "scene.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632", nodata=0)
    return path, data


WEIGHTS = torch.tensor([[1.0, -0.5, 0.2], [-0.3, 0.8, 0.1], [0.2, 0.3, -0.9], [0.05, 0.0, 0.4]])


def per_pixel(x: torch.Tensor) -> torch.Tensor:
    """Four class scores, each a linear function of the pixel's own bands."""
    return torch.einsum("kc,bchw->bkhw", WEIGHTS, x) + 0.1


def test_tiling_helpers():
    assert tile_origins(219, 64, 16) == [0, 48, 96, 144, 192], "every 48 px until a tile reaches the end"
    assert tile_origins(50, 64, 16) == [0]
    assert tile_origins(64, 64, 0) == [0] and tile_origins(65, 64, 0) == [0, 64]
    weights = blend_weights(8)
    assert weights.min() > 0 and np.allclose(weights, weights.T) and weights[3, 3] == weights.max()


def test_per_pixel_model_gives_its_own_output_everywhere(tmp_path, scene):
    path, data = scene
    out = predict_scene(
        per_pixel,
        path,
        tmp_path / "classes.tif",
        task="segmentation",
        normaliser=_normaliser(),
        tile=64,
        overlap=16,
        batch_size=3,
        progress=False,
    )
    result = read_raster(out, 1)
    assert result.crs == "EPSG:32632" and result.transform == TRANSFORM, "the input's georeferencing"
    assert result.data.shape == (1, HEIGHT, WIDTH) and result.dtype == "uint8" and result.nodata == 255
    scores = per_pixel(torch.from_numpy(_normalised(data, _normaliser()))[None])[0].numpy()
    expected = scores.argmax(axis=0)
    top2 = np.sort(scores, axis=0)[-2:]
    clear = top2[1] - top2[0] > 1e-4
    nodata = (data == 0).all(axis=0)
    assert (result.data[0][nodata] == 255).all(), "input nodata pixels are output nodata"
    assert nodata.sum() == 19 * 30
    agree = (result.data[0] == expected) | ~clear | nodata
    assert agree.all(), f"{(~agree).sum()} pixels differ from the per-pixel prediction (seams?)"


def test_a_prediction_that_fails_midway_continues_where_it_stopped(tmp_path):
    data = np.random.default_rng(3).integers(1, 1000, (3, 700, 260)).astype(np.uint16)
    path = tmp_path / "tall.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632", nodata=0)
    calls = []

    def fails_on_the_14th_batch(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 14:
            raise RuntimeError("out of memory")
        return per_pixel(x)

    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    out = tmp_path / "out" / "classes.tif"
    with pytest.raises(RuntimeError, match="out of memory"):
        predict_scene(fails_on_the_14th_batch, path, out, batch_size=3, **args)
    assert not out.exists(), "no half-written GeoTIFF at the path"
    assert json.loads((tmp_path / "out" / "classes.tif.partial.json").read_text())["blocks_done"] == 1, (
        "the first block (rows 0-255) is finished and counted beside the partial file"
    )
    resumed = []
    predict_scene(lambda x: resumed.append(1) or per_pixel(x), path, out, batch_size=3, **args)
    whole = predict_scene(per_pixel, path, tmp_path / "whole.tif", batch_size=3, **args)
    assert np.array_equal(read_raster(out, 1).data, read_raster(whole, 1).data), "the same pixels as in one go"
    assert written_record(out)["tile"] == 64 and written_record(out) == written_record(whole), "its record"
    full = len(tile_origins(700, 64, 16)) * 2  # two batches of 3 (6 columns of tiles) per row of tiles
    assert len(resumed) == full - 2 * 5, "tile rows 0-4 (rows 0-255) are not redone"
    assert sorted(p.name for p in out.parent.iterdir()) == ["classes.tif"], "sidecar and partial file gone"


def test_a_prediction_stopped_in_its_second_strip_continues_there(tmp_path):
    data = np.random.default_rng(6).integers(1, 1000, (3, 600, 600)).astype(np.uint16)
    path = tmp_path / "wide.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632", nodata=0)
    calls = []

    def stops_in_the_second_strip(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 39:  # strip 0: 13 rows of 2 batches; strip 1: at its 7th row of tiles
            raise KeyboardInterrupt
        return per_pixel(x)

    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    args |= {"batch_size": 3, "strip": 256}
    out = tmp_path / "classes.tif"
    with pytest.raises(KeyboardInterrupt):
        predict_scene(stops_in_the_second_strip, path, out, **args)
    assert json.loads((tmp_path / "classes.tif.partial.json").read_text())["blocks_done"] == 4, (
        "the 3 blocks of the first strip and the first of the second"
    )
    resumed = []
    predict_scene(lambda x: resumed.append(1) or per_pixel(x), path, out, **args)
    whole = predict_scene(per_pixel, path, tmp_path / "whole.tif", **args)
    assert np.array_equal(read_raster(out, 1).data, read_raster(whole, 1).data), "the same pixels as in one go"
    assert len(resumed) == (13 - 5) * 2 + 13, "from the second strip's tile row 5 (rows 240-303) on"


def test_a_prediction_killed_before_its_file_was_closed_finishes_it(tmp_path, scene, monkeypatch):
    path, _ = scene
    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    close = BlockStreamWriter.close

    def killed_before_closing(self: BlockStreamWriter) -> None:
        self._dst.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(BlockStreamWriter, "close", killed_before_closing)
    with pytest.raises(KeyboardInterrupt):
        predict_scene(per_pixel, path, tmp_path / "out.tif", **args)
    monkeypatch.setattr(BlockStreamWriter, "close", close)
    calls = []
    out = predict_scene(lambda x: calls.append(1) or per_pixel(x), path, tmp_path / "out.tif", **args)
    whole = predict_scene(per_pixel, path, tmp_path / "whole.tif", **args)
    assert np.array_equal(read_raster(out, 1).data, read_raster(whole, 1).data)
    assert len(calls) == 1, "every block was on disk: the last row of tiles (one batch) is predicted to close the file"


def test_the_output_is_a_cloud_optimized_geotiff_on_the_inputs_grid(tmp_path, scene):
    path, _ = scene
    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    out = predict_scene(per_pixel, path, tmp_path / "classes.tif", model_id="m", **args)
    assert cog_validate(out) == (True, [], []), "valid, no errors nor warnings"
    with rasterio.open(path) as scene_file, rasterio.open(out) as src:
        assert src.tags(ns="IMAGE_STRUCTURE")["LAYOUT"] == "COG" and src.overviews(1) == [2]
        assert (src.crs, src.transform, src.shape) == (scene_file.crs, scene_file.transform, scene_file.shape)
        assert src.block_shapes == [(256, 256)] and src.compression.name == "deflate" and src.nodata == 255
        classes = src.read(1)
    with rasterio.open(out, overview_level=0) as half:
        assert half.shape == (109, 150) and set(np.unique(half.read(1))) <= set(np.unique(classes)), (
            "class ids (mode), never a blend of them"
        )
    assert written_record(out)["model"] == "m"


def test_a_prediction_killed_while_copying_its_output_finishes_on_a_rerun(tmp_path, scene, monkeypatch):
    path, _ = scene
    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    copy = rasterio.shutil.copy

    def killed_while_copying(source, destination, **options):
        copy(source, destination, **options)
        raise KeyboardInterrupt

    monkeypatch.setattr(rasterio.shutil, "copy", killed_while_copying)
    with pytest.raises(KeyboardInterrupt):
        predict_scene(per_pixel, path, tmp_path / "out.tif", **args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif.partial", "out.tif.partial.json", "scene.tif"]
    monkeypatch.setattr(rasterio.shutil, "copy", copy)
    calls = []
    out = predict_scene(lambda x: calls.append(1) or per_pixel(x), path, tmp_path / "out.tif", **args)
    assert len(calls) == 1, "every block was on disk: the last row of tiles (one batch) is predicted, then copied"
    whole = predict_scene(per_pixel, path, tmp_path / "whole.tif", **args)
    assert np.array_equal(read_raster(out, 1).data, read_raster(whole, 1).data) and cog_validate(out)[0]
    (tmp_path / "out.tif.partial").write_bytes(b"blocks")  # killed after the copy took the path, before clean-up
    (tmp_path / "out.tif.partial.json").write_text(json.dumps({"record": written_record(out), "blocks_done": 1}))
    predict_scene(lambda x: calls.append(1) or per_pixel(x), path, out, **args)
    assert len(calls) == 1, "the finished output is kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif", "scene.tif", "whole.tif"], "leftovers dropped"


def test_scene_within_one_tile_equals_a_single_pass(tmp_path):
    data = np.random.default_rng(1).integers(1, 1000, (3, 45, 57)).astype(np.uint16)
    path = tmp_path / "small.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632")
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 5, padding=2)

    def model(x: torch.Tensor) -> torch.Tensor:
        return conv(x)

    out = predict_scene(
        model,
        path,
        tmp_path / "out.tif",
        task="segmentation",
        normaliser=_normaliser(),
        tile=64,
        overlap=16,
        progress=False,
    )
    x = np.pad(_normalised(data, _normaliser()), ((0, 0), (0, 64 - 45), (0, 64 - 57)), mode="reflect")
    with torch.no_grad():
        single = model(torch.from_numpy(x)[None])[0, :, :45, :57].argmax(0).numpy()
    assert np.array_equal(read_raster(out, 1).data[0], single), "one reflect-padded pass, cropped back"
    assert cog_validate(out) == (True, [], []), "a COG of one block, smaller than the block, without overviews"


def test_superres_output_is_finer_and_larger(tmp_path):
    data = np.random.default_rng(2).uniform(100, 900, (3, 37, 53)).astype(np.float32)
    data[:, :4, :6] = -9999
    path = tmp_path / "lowres.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632", nodata=-9999)
    norm = BandNormaliser(BANDS, ["red", "green", "blue"], 0.001, [0.5, 0.4, 0.3], [0.2, 0.25, 0.3])

    def upsample(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=3, mode="nearest")

    out = predict_scene(
        upsample,
        path,
        tmp_path / "sr.tif",
        task="superres",
        normaliser=norm,
        tile=16,
        overlap=6,
        batch_size=4,
        scale_factor=3,
        progress=False,
    )
    result = read_raster(out, 3)
    assert result.data.shape == (3, 37 * 3, 53 * 3) and result.dtype == "float32"
    assert np.allclose(result.transform, (10.0 / 3, 0.0, 600_000.0, 0.0, -10.0 / 3, 4_000_000.0), rtol=1e-12), (
        "pixel size / 3, same corner"
    )
    assert result.crs == "EPSG:32632" and result.nodata == -9999
    expected = data[[2, 1, 0]].repeat(3, axis=1).repeat(3, axis=2)
    assert (result.data[:, :12, :18] == -9999).all(), "high-resolution pixels of nodata input are nodata"
    valid = expected != -9999
    np.testing.assert_allclose(result.data[valid], expected[valid], rtol=1e-4, err_msg="de-normalised, no seams")


def test_change_needs_two_scenes_on_one_grid(tmp_path):
    before = np.full((3, 70, 90), 100, dtype=np.uint16)
    after = before.copy()
    after[:, 10:30, 40:80] = 900
    write_geotiff(tmp_path / "a.tif", before, transform=TRANSFORM, crs="EPSG:32632")
    write_geotiff(tmp_path / "b.tif", after, transform=TRANSFORM, crs="EPSG:32632")

    def difference(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return (x2 - x1).abs().sum(1, keepdim=True) - 1.0

    pair = (tmp_path / "a.tif", tmp_path / "b.tif")
    out = predict_scene(
        difference,
        pair,
        tmp_path / "change.tif",
        task="change",
        normaliser=_normaliser(),
        tile=32,
        overlap=8,
        progress=False,
    )
    result = read_raster(out, 1).data[0]
    assert result.sum() == 20 * 40 and (result[10:30, 40:80] == 1).all(), (
        "one logit channel: change where it is above 0"
    )
    write_geotiff(
        tmp_path / "c.tif", after, transform=(10.0, 0.0, 600_010.0, 0.0, -10.0, 4_000_000.0), crs="EPSG:32632"
    )
    shifted = (tmp_path / "a.tif", tmp_path / "c.tif")
    with pytest.raises(
        DataMismatchError, match=r"a\.tif and .*c\.tif: the before and after scenes differ in transform"
    ):
        predict_scene(difference, shifted, tmp_path / "x.tif", task="change", normaliser=_normaliser(), progress=False)
    with pytest.raises(ConfigError, match="takes a before and an after scene"):
        predict_scene(
            difference, tmp_path / "a.tif", tmp_path / "x.tif", task="change", normaliser=_normaliser(), progress=False
        )


def _count_windows(monkeypatch) -> tuple[list, list]:
    """The windows predict_scene reads (row, column, rows, columns) and the rows it hands over (row, column, rows, columns)."""
    reads, writes = [], []
    read, append = WindowReader.read, BlockStreamWriter.append

    def counting_read(self, row_off, col_off, height, width):
        reads.append((row_off, col_off, height, width))
        return read(self, row_off, col_off, height, width)

    def counting_append(self, array, row_off, col_off=0):
        writes.append((row_off, col_off, *array.shape[1:]))
        return append(self, array, row_off, col_off)

    monkeypatch.setattr(WindowReader, "read", counting_read)
    monkeypatch.setattr(BlockStreamWriter, "append", counting_append)
    return reads, writes


def test_reads_windows_and_writes_rows_as_they_complete(tmp_path, scene, monkeypatch):
    path, _ = scene
    reads, writes = _count_windows(monkeypatch)
    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    predict_scene(per_pixel, path, tmp_path / "out.tif", **args)
    assert [(r, h) for r, _, h, _ in reads] == [(0, 64), (48, 64), (96, 64), (144, 64), (192, 27)], (
        "one strip of tile rows per row of tiles"
    )
    assert [(r, h) for r, _, h, _ in writes] == [(0, 48), (48, 48), (96, 48), (144, 48), (192, 27)], (
        "rows handed over once no later tile reaches them"
    )


def test_a_wide_scene_is_predicted_in_strips_of_columns_as_in_one(tmp_path, monkeypatch):
    """Windows of rows and columns: tiles reaching across a strip's edge are predicted for both strips, and the
    blended scores are those of one pass over the whole width, to the bit."""
    data = np.random.default_rng(5).integers(1, 1000, (3, 600, 700)).astype(np.uint16)
    path = tmp_path / "wide.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632", nodata=0)
    args = {"task": "segmentation", "normaliser": _normaliser(), "tile": 64, "overlap": 16, "progress": False}
    conv = torch.nn.Conv2d(3, 4, 5, padding=2)
    whole = predict_scene(conv, path, tmp_path / "whole.tif", **args)
    reads, writes = _count_windows(monkeypatch)
    strips = predict_scene(conv, path, tmp_path / "strips.tif", strip=256, **args)
    assert np.array_equal(read_raster(strips, 1).data, read_raster(whole, 1).data)
    assert {c for _, c, _, _ in writes} == {0, 256, 512} and max(w for *_, w in writes) == 256, "3 strips"
    assert {(c, w) for _, c, _, w in reads} == {(0, 304), (240, 304), (480, 220)}, "the tiles touching each strip"
    with pytest.raises(ConfigError, match="strip 100: expected a positive multiple of 256 output columns"):
        predict_scene(conv, path, tmp_path / "x.tif", strip=100, **args)


def test_invalid_arguments_and_model_outputs(tmp_path, scene):
    path, _ = scene
    with pytest.raises(ConfigError, match="0 <= overlap < tile"):
        predict_scene(
            per_pixel, path, tmp_path / "x.tif", task="segmentation", normaliser=_normaliser(), tile=32, overlap=32
        )
    with pytest.raises(ConfigError, match="not 'classification'"):
        predict_scene(per_pixel, path, tmp_path / "x.tif", task="classification", normaliser=_normaliser())
    with pytest.raises(
        ConfigError, match=r"returned shape \(2, 4, 16, 16\) for 2 tiles; task segmentation expects \(2, K, 32, 32\)"
    ):
        predict_scene(
            lambda x: per_pixel(x)[..., ::2, ::2],
            path,
            tmp_path / "x.tif",
            task="segmentation",
            normaliser=_normaliser(),
            tile=32,
            overlap=0,
            batch_size=2,
            progress=False,
        )
