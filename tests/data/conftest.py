"""Shared fixtures: small GeoTIFF sources written into tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from geofm.config import SourceConfig
from geofm.data.writers import write_geotiff

TRANSFORM = (10.0, 0.0, 500_000.0, 0.0, -10.0, 5_000_000.0)
CRS = "EPSG:32632"


@pytest.fixture
def write_tif() -> Callable[..., Path]:
    """Write a (bands, H, W) array as a georeferenced GeoTIFF."""

    def write(path: Path, array: np.ndarray, nodata: float | None = None) -> Path:
        write_geotiff(path, array, transform=TRANSFORM, crs=CRS, nodata=nodata)
        return path

    return write


@pytest.fixture
def make_source(tmp_path: Path, write_tif: Callable[..., Path]) -> Callable[..., SourceConfig]:
    """Create a folder of random GeoTIFFs and return its SourceConfig."""

    def make(
        name: str,
        bands: list[str],
        files: int = 4,
        size: int = 16,
        dtype: str = "uint16",
        nodata: float | None = None,
        weight: float = 1.0,
        seed: int = 0,
    ) -> SourceConfig:
        rng = np.random.default_rng(seed)
        root = tmp_path / name
        for i in range(files):
            data = rng.integers(1, 200, (len(bands), size, size)).astype(dtype)
            write_tif(root / f"img_{i:02d}.tif", data, nodata=nodata)
        return SourceConfig(
            name=name,
            root=root,
            pattern="*.tif",
            bands=bands,
            scale=0.01,
            nodata=nodata,
            mean=[1.0] * len(bands),
            std=[0.5] * len(bands),
            weight=weight,
        )

    return make
