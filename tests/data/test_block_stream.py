"""The streamed GeoTIFF: block by block in strips, continued after a kill, finished as a Cloud-Optimized GeoTIFF,
one writer per path, never over an input or a file it did not write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import rasterio
import rasterio.shutil
from rio_cogeo.cogeo import cog_validate

from geofm.data.block_stream import BlockStreamWriter, claim, discard_partial, resumable_blocks, written_record
from geofm.data.readers import read_raster
from geofm.data.writers import write_geotiff
from geofm.errors import OutputPathError

REPO = Path(__file__).resolve().parents[2]
GRID = {
    "width": 600,
    "height": 600,
    "count": 1,
    "dtype": "uint16",
    "crs": "EPSG:32632",
    "transform": (1, 0, 0, 0, -1, 0),
}


def test_block_stream_writer_writes_strips_block_by_block_and_continues(tmp_path: Path) -> None:
    path, record = tmp_path / "out.tif", {"model": "a", "tile": 64}
    pixels = np.arange(600 * 600).reshape(1, 600, 600).astype(np.uint16)
    flushed = []
    with pytest.raises(KeyboardInterrupt), BlockStreamWriter(path, **GRID, record=record, strip=512) as writer:
        for top in range(0, 600, 200):  # the first strip, columns 0-511
            writer.append(pixels[:, top : top + 200, :512], top, 0)
            flushed.append(writer.blocks_done)
        writer.append(pixels[:, :100, 512:], 0, 512)
        with pytest.raises(
            ValueError, match=r"rows 200:210 of the strip at column 512 handed over; the next are rows 100:"
        ):
            writer.append(pixels[:, 200:210, 512:], 200, 512)
        raise KeyboardInterrupt
    assert flushed == [0, 1, 3], "a block of 256 rows of the strip is written once it is complete"
    assert resumable_blocks(path, record, 512) == 3 and resumable_blocks(path, {**record, "tile": 32}, 512) == 0
    assert resumable_blocks(path, record, 256) == 0, "another strip width: not continued"
    with BlockStreamWriter(path, **GRID, record=record, strip=512) as writer:
        assert (writer.rows_done(0), writer.rows_done(512)) == (600, 0)
        writer.append(pixels[:, :, :512], 0, 0)  # on disk: skipped
        writer.append(pixels[:, :, 512:], 0, 512)
    assert np.array_equal(read_raster(path, 1).data, pixels) and written_record(path) == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif"], "partial file and sidecar gone"
    (tmp_path / "out.tif.partial").write_bytes(b"not a tiff")
    (tmp_path / "out.tif.partial.json").write_text(json.dumps({"record": record, "strip": 600, "blocks_done": 1}))
    with pytest.raises(OutputPathError, match=r"out\.tif\.partial cannot be continued"):
        BlockStreamWriter(path, **GRID, record=record)
    with BlockStreamWriter(path, **GRID, record=record, resume=False) as writer:
        writer.append(pixels, 0)
    assert np.array_equal(read_raster(path, 1).data, pixels)


@pytest.mark.parametrize(("resampling", "overview"), [("average", 1.0), ("nearest", 0.0)])
def test_the_finished_file_is_a_cloud_optimized_geotiff_that_keeps_what_it_carries(tmp_path, resampling, overview):
    path, record = tmp_path / "out.tif", {"model": "a"}
    grid = {**GRID, "count": 2, "dtype": "float32", "nodata": -9999.0, "descriptions": ["red", "nir"]}
    pixels = np.indices((600, 600)).sum(axis=0) % 2 * np.float32(2)  # a checkerboard of 0 and 2
    with BlockStreamWriter(path, **grid, record=record, strip=512, overview_resampling=resampling) as writer:
        for left in (0, 512):
            writer.append(np.stack([pixels, pixels])[:, :, left : left + 512], 0, left)
    assert cog_validate(path) == (True, [], []), "valid, no errors nor warnings"
    with rasterio.open(path) as src:
        structure = src.tags(ns="IMAGE_STRUCTURE")
        assert structure["LAYOUT"] == "COG" and structure["COMPRESSION"] == "DEFLATE"
        assert structure["PREDICTOR"] == "3", "the floating-point predictor for float32"
        assert src.block_shapes == [(256, 256)] * 2 and src.overviews(1) == [2, 4], "halved until one fits a tile"
        assert src.crs == "EPSG:32632" and src.transform[:6] == GRID["transform"] and src.nodata == -9999.0
        assert src.descriptions == ("red", "nir") and src.dtypes == ("float32", "float32")
        assert np.array_equal(src.read(), np.stack([pixels, pixels]))
    with rasterio.open(path, overview_level=0) as half:
        assert half.shape == (300, 300) and (half.read(1) == overview).all(), f"{resampling} overviews"
    assert written_record(path) == record and sorted(p.name for p in tmp_path.iterdir()) == ["out.tif"]
    with pytest.raises(ValueError, match=r"out\.tif: overview resampling 'max': expected one of nearest, mode, "):
        BlockStreamWriter(path, **GRID, record=record, overview_resampling="max")


def test_an_interrupted_copy_leaves_the_partial_file_to_continue_and_no_output(tmp_path, monkeypatch):
    path, record = tmp_path / "out.tif", {"model": "a"}
    pixels = np.arange(600 * 600).reshape(1, 600, 600).astype(np.uint16)
    copy = rasterio.shutil.copy

    def killed_while_copying(source, destination, **options):
        copy(source, destination, **options)
        Path(f"{destination}.ovr.tmp").write_bytes(b"GDAL's overviews")
        raise KeyboardInterrupt

    monkeypatch.setattr(rasterio.shutil, "copy", killed_while_copying)
    with pytest.raises(KeyboardInterrupt), BlockStreamWriter(path, **GRID, record=record) as writer:
        writer.append(pixels, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif.partial", "out.tif.partial.json"], (
        "no output, the temporary copy and GDAL's files beside it removed"
    )
    monkeypatch.setattr(rasterio.shutil, "copy", copy)
    (tmp_path / "out.tif.cog.tmp").write_bytes(b"half a COG")  # what a kill (no clean-up) leaves
    (tmp_path / "out.tif.cog.tmp.ovr.tmp").write_bytes(b"half its overviews")
    with BlockStreamWriter(path, **GRID, record=record) as writer:
        assert writer.rows_done() == 600, "every block on disk: only the copy is left to do"
        writer.append(pixels, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif"]
    assert cog_validate(path)[0] and np.array_equal(read_raster(path, 1).data, pixels)


def test_discard_partial_drops_only_a_partial_file_of_the_same_record(tmp_path: Path) -> None:
    path, sidecar = tmp_path / "out.tif", tmp_path / "out.tif.partial.json"
    for state, kept in (({"record": {"model": "b"}}, True), ([1], True), ({"record": {"model": ("a",)}}, False)):
        (tmp_path / "out.tif.partial").write_bytes(b"blocks")
        sidecar.write_text(json.dumps(state))
        discard_partial(path, {"model": ["a"]})
        assert sidecar.exists() == kept and (tmp_path / "out.tif.partial").exists() == kept


def _finished(path: Path) -> Path:
    """A finished streamed GeoTIFF at ``path``."""
    with BlockStreamWriter(path, **{**GRID, "width": 30, "height": 20}, record={"model": "a"}) as writer:
        writer.append(np.ones((1, 20, 30), np.uint16), 0)
    return path


def test_claim_refuses_an_input_in_any_guise_even_with_overwrite(tmp_path: Path) -> None:
    scene = tmp_path / "scene.tif"
    write_geotiff(scene, np.ones((4, 20, 30), np.uint16), transform=(1, 0, 0, 0, -1, 0), crs=32632)
    os.link(scene, tmp_path / "hardlink.tif")
    (tmp_path / "symlink.tif").symlink_to(scene)
    for output in ("scene.tif", "hardlink.tif", "symlink.tif"):
        for overwrite in (False, True):
            refused = pytest.raises(OutputPathError, match=rf"{output} is the input .*scene\.tif; write the output to")
            with refused, claim(tmp_path / output, [tmp_path / "missing.tif", scene], overwrite):
                pass
    assert read_raster(scene, 4).data.shape == (4, 20, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hardlink.tif", "scene.tif", "symlink.tif"], "no lock left"


def test_claim_replaces_only_its_own_files_unless_overwrite(tmp_path: Path) -> None:
    with claim(tmp_path / "new" / "out.tif", [], False):  # nothing there yet
        assert (tmp_path / "new" / "out.tif.lock").read_text().startswith(f"process {os.getpid()} on ")
    with claim(_finished(tmp_path / "mine.tif"), [], False):
        pass
    foreign = tmp_path / "theirs.tif"
    write_geotiff(foreign, np.ones((4, 20, 30), np.uint16), transform=(1, 0, 0, 0, -1, 0), crs=32632)
    (tmp_path / "notes.tif").write_text("not a raster")
    for name in ("theirs.tif", "notes.tif"):
        refused = pytest.raises(OutputPathError, match=rf"{name} exists and was not written by geofm \(no GEOFM_RECORD")
        with refused, claim(tmp_path / name, [], False):
            pass
        with claim(tmp_path / name, [], True):
            pass


HOLDER = """
import sys
from geofm.data.block_stream import claim
with claim(sys.argv[1], [], False):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.slow
def test_one_process_at_a_time_and_a_dead_holder_leaves_no_claim(tmp_path: Path) -> None:
    out = tmp_path / "out.tif"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def holder() -> subprocess.Popen:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert child.stdout.readline() == "held\n"
        return child

    child = holder()
    refused = pytest.raises(OutputPathError, match=rf"out\.tif is being written by process {child.pid} on .*\.lock")
    with refused, claim(out, [], False):
        pass
    child.communicate("\n")
    assert child.returncode == 0 and not (tmp_path / "out.tif.lock").exists(), "released and deleted on exit"
    child = holder()
    child.kill()
    child.wait()
    assert (tmp_path / "out.tif.lock").exists(), "a killed holder leaves its lock file"
    with claim(out, [], False):  # ... which locks no more
        pass
