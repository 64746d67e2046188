from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from geofm.config import SourceConfig
from geofm.data.sources import ImageSource, list_images
from geofm.errors import DatasetNotFoundError, RasterReadError

MODEL_BANDS = ["blue", "green", "red", "nir", "swir"]


def _config(root: Path, bands: list[str], **kwargs) -> SourceConfig:
    defaults = dict(name="s", root=root, pattern="*.tif", bands=bands, mean=[0.0] * len(bands), std=[1.0] * len(bands))
    return SourceConfig(**(defaults | kwargs))


def test_reorders_bands_and_marks_missing_invalid(tmp_path: Path, write_tif) -> None:
    data = np.stack([np.full((3, 4), v, dtype=np.uint8) for v in (10, 20, 30)])  # red, green, blue
    write_tif(tmp_path / "a.tif", data)
    source = ImageSource(_config(tmp_path, ["red", "green", "blue"]), MODEL_BANDS)
    image, valid = source.load(0)
    assert image.shape == valid.shape == (5, 3, 4)
    assert image.dtype == torch.float32 and valid.dtype == torch.bool
    assert image[:, 0, 0].tolist() == [30.0, 20.0, 10.0, 0.0, 0.0]
    assert valid[:3].all()
    assert not valid[3:].any()


def test_normalisation(tmp_path: Path, write_tif) -> None:
    data = np.array([[[100, 200]], [[1000, 3000]]], dtype=np.uint16)
    write_tif(tmp_path / "a.tif", data)
    cfg = _config(tmp_path, ["red", "nir"], scale=0.01, mean=[1.0, 10.0], std=[0.5, 4.0])
    image, valid = ImageSource(cfg, ["red", "nir"]).load(0)
    expected = torch.tensor([[[0.0, 2.0]], [[0.0, 5.0]]])
    torch.testing.assert_close(image, expected)
    assert valid.all()


def test_file_nodata_is_invalid_and_zero(tmp_path: Path, write_tif) -> None:
    data = np.full((2, 3, 3), 50, dtype=np.uint16)
    data[:, 0, :] = 0
    write_tif(tmp_path / "a.tif", data, nodata=0)
    cfg = _config(tmp_path, ["red", "nir"], mean=[10.0, 10.0])
    image, valid = ImageSource(cfg, ["red", "nir"]).load(0)
    assert not valid[:, 0, :].any()
    assert valid[:, 1:, :].all()
    assert (image[:, 0, :] == 0).all()
    assert (image[:, 1:, :] == 40).all()


def test_config_nodata_overrides_file(tmp_path: Path, write_tif) -> None:
    data = np.array([[[0, 7, 9]]], dtype=np.int16)
    write_tif(tmp_path / "a.tif", data, nodata=9)
    _, valid = ImageSource(_config(tmp_path, ["red"], nodata=7), ["red"]).load(0)
    assert valid[0, 0].tolist() == [True, False, True]


def test_non_finite_pixels_are_invalid(tmp_path: Path, write_tif) -> None:
    data = np.array([[[1.0, np.nan, np.inf, -np.inf]]], dtype=np.float32)
    write_tif(tmp_path / "a.tif", data)
    image, valid = ImageSource(_config(tmp_path, ["red"]), ["red"]).load(0)
    assert valid[0, 0].tolist() == [True, False, False, False]
    assert torch.isfinite(image).all()
    assert image[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_files_sorted_and_folders_excluded(tmp_path: Path, write_tif) -> None:
    for name in ("b.tif", "a.tif", "sub/c.tif"):
        write_tif(tmp_path / name, np.zeros((1, 2, 2), dtype=np.uint8))
    (tmp_path / "folder.tif").mkdir()
    source = ImageSource(_config(tmp_path, ["red"], pattern="**/*.tif"), ["red"])
    assert [p.relative_to(tmp_path).as_posix() for p in source.files] == ["a.tif", "b.tif", "sub/c.tif"]
    assert len(source) == 3


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="does not exist") as info:
        ImageSource(_config(tmp_path / "absent", ["red"]), ["red"])
    assert str(tmp_path / "absent") in str(info.value)


def test_no_matching_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetNotFoundError, match=r"\*\.tif"):
        list_images(tmp_path, "*.tif")


def test_band_count_mismatch_raises(tmp_path: Path, write_tif) -> None:
    write_tif(tmp_path / "a.tif", np.zeros((3, 2, 2), dtype=np.uint8))
    source = ImageSource(_config(tmp_path, ["blue", "green", "red", "nir"]), MODEL_BANDS)
    with pytest.raises(RasterReadError, match=r"has 3 bands, source declares 4 \(blue, green, red, nir\)"):
        source.load(0)


def test_bands_the_model_does_not_use_are_dropped(tmp_path: Path, write_tif) -> None:
    data = np.stack([np.full((2, 2), v, dtype=np.uint16) for v in (1, 2, 3, 4)])  # blue, green, red, nir
    write_tif(tmp_path / "a.tif", data)
    cfg = _config(tmp_path, ["blue", "green", "red", "nir"], mean=[0.0, 0.0, 0.0, 1.0], std=[1.0, 1.0, 2.0, 1.0])
    image, valid = ImageSource(cfg, ["red", "green", "blue"]).load(0)
    assert image.shape == (3, 2, 2)
    assert image[:, 0, 0].tolist() == [1.5, 2.0, 1.0]
    assert valid.all()


def test_source_without_model_band_rejected(tmp_path: Path, write_tif) -> None:
    write_tif(tmp_path / "a.tif", np.zeros((1, 2, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="none of the model bands"):
        ImageSource(_config(tmp_path, ["pan"]), MODEL_BANDS)


def test_large_files_are_cut_into_chips_read_by_window(tmp_path: Path, write_tif) -> None:
    rng = np.random.default_rng(0)
    scene = rng.integers(1, 1000, size=(3, 70, 50), dtype=np.uint16)
    write_tif(tmp_path / "scene.tif", scene)
    write_tif(tmp_path / "small.tif", scene[:, :20, :20])
    cfg = _config(tmp_path, ["red", "green", "blue"], chip_size=32)
    source = ImageSource(cfg, ["red", "green", "blue"])
    # 70 x 50 -> rows at 0, 32, 38 and columns at 0, 18 (the last flush with the far edge); the small file stays whole
    assert [(c.file.name, c.window) for c in source.chips] == [
        ("scene.tif", (row, col, 32, 32)) for row in (0, 32, 38) for col in (0, 18)
    ] + [("small.tif", None)]
    assert len(source) == 7
    image, valid = source.load(3)  # rows 32:64, columns 18:50
    torch.testing.assert_close(image, torch.from_numpy(scene[:, 32:64, 18:50].astype(np.float32)))
    assert valid.all()
    whole, _ = ImageSource(_config(tmp_path, ["red", "green", "blue"]), ["red", "green", "blue"]).load(0)
    assert whole.shape == (3, 70, 50), "without chip_size a file is one sample"


def test_only_the_model_bands_are_read(tmp_path: Path, write_tif) -> None:
    data = np.stack([np.full((4, 4), v, dtype=np.uint16) for v in (1, 2, 3, 4)])  # blue, green, red, nir
    write_tif(tmp_path / "a.tif", data)
    source = ImageSource(_config(tmp_path, ["blue", "green", "red", "nir"]), ["nir", "red"])
    raw = source.read(0).data
    assert raw[:, 0, 0].tolist() == [3, 4], "the file's unused bands were read"
    image, _ = source.load(0)
    assert image[:, 0, 0].tolist() == [4.0, 3.0]
