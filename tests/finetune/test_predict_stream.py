"""Predicting scenes in bounded memory: streamed output equals a whole-scene stitch, a killed prediction
continues to the same file, a finished one is kept, and memory holds a band of rows whatever the height."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import rasterio
import torch

from finetune.predict import _tile, add_tile, blend_weights, predict_scene, tile_origins
from geofm.data.block_stream import written_record
from geofm.data.finetune import BandNormaliser
from geofm.data.readers import read_raster
from geofm.data.writers import write_geotiff
from geofm.errors import OutputPathError

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRANSFORM = (10.0, 0.0, 600_000.0, 0.0, -10.0, 4_000_000.0)
NORM = {"dataset_bands": ["blue", "green", "red"], "bands": ["red", "green", "blue"], "scale": 0.001}
ARGS = {"task": "segmentation", "tile": 64, "overlap": 16, "batch_size": 4, "progress": False}


def _normaliser() -> BandNormaliser:
    return BandNormaliser(**NORM, mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3], nodata=0)


def _scene(path: Path, height: int, width: int, seed: int = 0) -> Path:
    data = np.random.default_rng(seed).integers(1, 1000, (3, height, width)).astype(np.uint16)
    data[:, 300:340, :50] = 0
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632", nodata=0)
    return path


def _conv() -> torch.nn.Conv2d:
    torch.manual_seed(0)
    return torch.nn.Conv2d(3, 5, 5, padding=2)


def test_streamed_output_equals_a_whole_scene_stitch(tmp_path):
    """The scene held whole, every tile's scores blended into one array: what geofm predict did in memory.
    Streamed in blocks, 3 strips of columns by 3 blocks of rows, the class map is the same to the pixel."""
    path = _scene(tmp_path / "scene.tif", 700, 600)
    conv = _conv()
    out = predict_scene(conv, path, tmp_path / "out.tif", normaliser=_normaliser(), strip=256, **ARGS)

    norm = _normaliser()
    image, valid = norm(read_raster(path, 3).data, 0.0)
    image = image.numpy()
    scores = np.zeros((5, 700, 600), dtype=np.float32)
    weight_sum = np.zeros((700, 600), dtype=np.float32)
    weights = blend_weights(64)
    for top in tile_origins(700, 64, 16):
        lefts = tile_origins(600, 64, 16)
        tiles = np.stack([_tile(image[:, top : top + 64], left, 64) for left in lefts])
        with torch.no_grad():
            outputs = conv(torch.from_numpy(tiles)).numpy()
        for output, left in zip(outputs, lefts, strict=True):
            add_tile(scores, weight_sum, output, weights, top, left, min(64, 700 - top), min(64, 600 - left))
    blended = scores / weight_sum
    expected = np.where(valid.numpy().any(axis=0), blended.argmax(axis=0), 255)
    result = read_raster(out, 1).data[0]
    assert (result[300:340, :50] == 255).all()
    assert np.array_equal(result, expected), f"{(result != expected).sum()} pixels differ"


CHILD = """
import sys, time
from pathlib import Path
import torch
from finetune.predict import predict_scene
from geofm.data.finetune import BandNormaliser
torch.manual_seed(0)
conv = torch.nn.Conv2d(3, 5, 5, padding=2)
calls = []
def stalls_after_16_batches(x):
    calls.append(1)
    while len(calls) > 16:  # killed here, once the first row of blocks is on disk
        time.sleep(0.05)
    with torch.no_grad():
        return conv(x)
norm = BandNormaliser(**{norm!r}, mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3], nodata=0)
predict_scene(stalls_after_16_batches, {scene!r}, {out!r}, normaliser=norm, model_id="conv", **{args!r})
"""


@pytest.mark.timeout(120)
def test_a_killed_prediction_continues_and_gives_the_same_file(tmp_path):
    path = _scene(tmp_path / "scene.tif", 700, 290)
    out = tmp_path / "out.tif"
    script = CHILD.format(norm=NORM, scene=str(path), out=str(out), args=ARGS)
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)})
    sidecar = tmp_path / "out.tif.partial.json"
    try:
        while not sidecar.exists():  # the first block is written and counted
            assert child.poll() is None, "the prediction ended before it was killed"
            time.sleep(0.05)
        with pytest.raises(OutputPathError, match=rf"out\.tif is being written by process {child.pid} on "):
            predict_scene(_conv(), path, out, normaliser=_normaliser(), model_id="conv", **ARGS)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert json.loads(sidecar.read_text())["blocks_done"] == 1 and not out.exists()

    conv, calls = _conv(), []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return conv(x)

    predict_scene(counted, path, out, normaliser=_normaliser(), model_id="conv", **ARGS)
    whole = predict_scene(conv, path, tmp_path / "whole.tif", normaliser=_normaliser(), **ARGS)
    assert np.array_equal(read_raster(out, 1).data, read_raster(whole, 1).data), "the same pixels as in one go"
    assert written_record(out) == {**written_record(whole), "model": "conv"}
    assert len(calls) == (len(tile_origins(700, 64, 16)) - 5) * 2, "rows 0-255 (tile rows 0-4) are not redone"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif", "scene.tif", "whole.tif"]


def test_a_finished_prediction_is_kept_unless_overwritten_or_another(tmp_path):
    path = _scene(tmp_path / "scene.tif", 100, 90)
    conv, calls = _conv(), []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return conv(x)

    out = tmp_path / "out.tif"
    model_a = {"run": Path("runs/a"), "weights": ("epoch", 3)}  # kept as JSON keeps it: strings and lists
    predict_scene(counted, path, out, normaliser=_normaliser(), model_id=model_a, **ARGS)
    first = len(calls)
    predict_scene(counted, path, out, normaliser=_normaliser(), model_id=model_a, **ARGS)
    assert len(calls) == first, "the same prediction again: the finished output is kept"
    predict_scene(counted, path, out, normaliser=_normaliser(), model_id=model_a, overwrite=True, **ARGS)
    assert len(calls) == 2 * first, "overwrite: predicted again"
    predict_scene(counted, path, out, normaliser=_normaliser(), model_id="b", **ARGS)
    assert len(calls) == 3 * first and written_record(out)["model"] == "b", "another model: replaced"
    assert written_record(out)["inputs"][0]["path"] == str(path.resolve())


def _traced_peak(path: Path, out: Path, cache: list) -> int:
    def per_pixel(x: torch.Tensor) -> torch.Tensor:
        cache.append(int(rasterio.env.getenv()["GDAL_CACHEMAX"]))
        return x.sum(1, keepdim=True).repeat(1, 5, 1, 1)

    tracemalloc.start()
    try:
        predict_scene(per_pixel, path, out, normaliser=_normaliser(), **ARGS)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_holds_a_band_of_rows_whatever_the_height(tmp_path):
    """The arrays of the prediction (numpy's, traced) and GDAL's block cache do not grow with the scene's rows."""
    cache: list[int] = []
    short = _traced_peak(_scene(tmp_path / "short.tif", 400, 300), tmp_path / "short_out.tif", cache)
    tall_scene = _scene(tmp_path / "tall.tif", 3200, 300)
    tall = _traced_peak(tall_scene, tmp_path / "tall_out.tif", cache)
    scene_bytes = 3 * 3200 * 300 * 4  # the tall scene's normalised pixels
    assert tall < 1.1 * short and tall < scene_bytes / 4, f"peaks {short} and {tall} bytes"
    assert max(cache) <= 64 * 2**20, "GDAL's block cache held to a few rows of blocks (default: 5% of memory)"


def test_an_interrupted_superres_prediction_continues_at_the_output_resolution(tmp_path):
    data = np.random.default_rng(4).uniform(100, 900, (3, 200, 150)).astype(np.float32)
    path = tmp_path / "lowres.tif"
    write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32632")
    norm = BandNormaliser(**NORM, mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3])
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Upsample(scale_factor=2, mode="bilinear"), torch.nn.Conv2d(3, 3, 3, padding=1))
    args = {"task": "superres", "normaliser": norm, "tile": 32, "overlap": 8, "scale_factor": 2, "progress": False}
    calls = []

    def fails_once_a_row_of_blocks_is_written(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if (tmp_path / "sr.tif.partial.json").exists():
            raise KeyboardInterrupt
        return conv(x)

    with pytest.raises(KeyboardInterrupt):
        predict_scene(fails_once_a_row_of_blocks_is_written, path, tmp_path / "sr.tif", **args)
    assert json.loads((tmp_path / "sr.tif.partial.json").read_text())["blocks_done"] == 1
    resumed, full = [], []
    out = predict_scene(lambda x: resumed.append(1) or conv(x), path, tmp_path / "sr.tif", **args)
    whole = predict_scene(lambda x: full.append(1) or conv(x), path, tmp_path / "whole.tif", **args)
    assert read_raster(out, 3).data.shape == (3, 400, 300) and len(resumed) < len(full), "continued"
    assert np.array_equal(read_raster(out, 3).data, read_raster(whole, 3).data), "the same pixels as in one go"
