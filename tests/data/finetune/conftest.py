"""Shared fixtures: downstream data sections and GeoTIFFs written into tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from geofm.config.finetune_data import FinetuneDataConfig
from geofm.data.writers import write_geotiff

CRS = "EPSG:32632"
TRANSFORM = (10.0, 0.0, 500_000.0, 0.0, -10.0, 5_000_000.0)


@pytest.fixture
def tif() -> Callable[..., Path]:
    """Write a (bands, H, W) GeoTIFF, by default georeferenced at 10 m in EPSG:32632."""

    def write(
        path: Path, array: np.ndarray, transform=TRANSFORM, crs: str | None = CRS, nodata: float | None = None
    ) -> Path:
        write_geotiff(path, array, transform=transform, crs=crs, nodata=nodata)
        return path

    return write


@pytest.fixture
def positions() -> Callable[..., np.ndarray]:
    """A uint16 image whose first band holds each pixel's index ``row * width + col``; other bands 1000, 2000..."""

    def make(height: int, width: int, bands: int = 1) -> np.ndarray:
        image = np.empty((bands, height, width), dtype=np.uint16)
        image[0] = np.arange(height * width).reshape(height, width)
        for b in range(1, bands):
            image[b] = 1000 * b
        return image

    return make


@pytest.fixture
def data_cfg() -> Callable[..., FinetuneDataConfig]:
    """A FinetuneDataConfig; one band (red), mean 0 and std 1 unless told otherwise."""

    def make(root: Path, **fields) -> FinetuneDataConfig:
        bands = fields.pop("dataset_bands", ["red"])
        values = {
            "root": root,
            "bands": fields.pop("bands", bands),
            "dataset_bands": bands,
            "mean": [0.0] * len(bands),
            "std": [1.0] * len(bands),
            **fields,
        }
        return FinetuneDataConfig(**values)

    return make
