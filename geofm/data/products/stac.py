"""STAC items whose assets are local single-band files (one COG per band).

A product is an item's JSON file. Each asset with exactly one band is a band: its name is the
band's ``eo:bands`` ``common_name`` (STAC 1.0) or ``eo:common_name`` (STAC 1.1) where the band
vocabulary knows it, else the band's ``name`` (``B05``); its scale, offset and nodata are
``raster:bands`` ``scale``/``offset``/``nodata`` (1.0) or ``raster:scale``/``raster:offset``/
``nodata`` (1.1) where present, else the source's ``scale`` and ``offset`` and the file's nodata.
Hrefs are paths relative to the JSON file (or absolute). The quality band is the asset
``quality.band`` names; its generation comes from the item's ``landsat:collection_number`` or an
``s2:product_type`` of S2MSI2A, else from ``quality.generation``.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from geofm.data.bands import UnknownBandError, canonical_band
from geofm.data.layouts import list_images
from geofm.data.products.base import BandFile, Product, QualityFiles
from geofm.errors import RasterReadError

if TYPE_CHECKING:
    from geofm.config import SourceConfig

COLLECTIONS = {"01": "landsat_c1", "02": "landsat_c2"}
RADSAT_ASSET = "qa_radsat"


def list_products(cfg: SourceConfig) -> list[Path]:
    """The item files below ``cfg.root`` matching ``cfg.pattern``."""
    return list_images(cfg.root, cfg.pattern)


def _band_entries(asset: dict) -> list[dict]:
    return asset.get("bands") or asset.get("eo:bands") or []


def _band_name(asset: dict, entry: dict, custom: Collection[str]) -> str | None:
    """The vocabulary name of an asset's band: its common name, else its name; None if neither is known."""
    common = entry.get("common_name") or entry.get("eo:common_name") or asset.get("eo:common_name")
    for candidate in (common, entry.get("name")):
        if candidate:
            try:
                return canonical_band(candidate, custom)
            except UnknownBandError:
                continue
    return None


def _number(item: Path, key: str, field: str, value: Any) -> float:
    """A number of an asset's metadata (``nodata`` may be the strings nan, inf and -inf)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    raise RasterReadError(item, f"asset {key}: {field} {value!r} is not a number")


def _local_file(item: Path, key: str, asset: dict) -> Path:
    href = asset.get("href")
    if not isinstance(href, str) or not href:
        raise RasterReadError(item, f"asset {key} has no href")
    scheme = urlparse(href).scheme
    if scheme not in ("", "file") and len(scheme) > 1:  # one letter: a Windows drive
        raise RasterReadError(item, f"asset {key}: href {href} is not a local file; download the item's assets first")
    return (item.parent / urlparse(href).path if scheme == "file" else item.parent / href).resolve()


def _generation(item: Path, properties: dict, configured: str | None) -> str:
    """The quality generation the item's properties give, else the configured one."""
    stated = None
    if "landsat:collection_number" in properties:
        number = str(properties["landsat:collection_number"]).zfill(2)
        if number not in COLLECTIONS:
            raise RasterReadError(item, f"landsat:collection_number {number!r}: expected 01 or 02")
        stated = COLLECTIONS[number]
    elif str(properties.get("s2:product_type", "")).upper() == "S2MSI2A":
        stated = "sentinel2_scl"
    if stated and configured and stated != configured:
        raise RasterReadError(
            item, f"the item's properties give quality generation {stated}, quality.generation {configured}"
        )
    if stated or configured:
        return stated or configured
    raise RasterReadError(
        item,
        "names no quality generation (properties landsat:collection_number or s2:product_type); set quality.generation",
    )


def open_product(cfg: SourceConfig, item: Path, bands: Collection[str]) -> Product:
    """The item in JSON file ``item``, with the assets of ``bands`` (those it has) and its quality band.

    Raises:
        RasterReadError: the file is not a STAC item, two assets hold the same band, an asset is
            not a local file, or the quality band or its generation is missing.
    """
    try:
        stac = json.loads(item.read_text())
    except (OSError, ValueError) as exc:
        raise RasterReadError(item, f"cannot read the STAC item: {exc}") from exc
    if not isinstance(stac, dict) or stac.get("type") != "Feature" or not isinstance(stac.get("assets"), dict):
        raise RasterReadError(item, "is not a STAC item (a JSON Feature with assets)")
    assets: dict[str, dict] = stac["assets"]
    product_bands: dict[str, BandFile] = {}
    owners: dict[str, str] = {}
    for key, asset in assets.items():
        entries = _band_entries(asset)
        if len(entries) != 1:
            continue
        name = _band_name(asset, entries[0], cfg.bands)
        if name is None or name not in bands:
            continue
        if name in owners:
            raise RasterReadError(item, f"assets {owners[name]} and {key} both hold band {name}")
        owners[name] = key
        raster = (asset.get("raster:bands") or [{}])[0]
        entry = entries[0]
        scale = raster.get("scale", entry.get("raster:scale", cfg.scale))
        offset = raster.get("offset", entry.get("raster:offset", cfg.offset))
        nodata = raster.get("nodata", entry.get("nodata", asset.get("nodata")))
        product_bands[name] = BandFile(
            _local_file(item, key, asset),
            _number(item, key, "scale", scale),
            _number(item, key, "offset", offset),
            None if nodata is None else _number(item, key, "nodata", nodata),
        )
    quality = None
    if cfg.quality is not None:
        by_key = {k.lower(): k for k in assets}
        key = by_key.get(cfg.quality.band.lower())
        if key is None:
            raise RasterReadError(
                item, f"has no asset {cfg.quality.band} (quality.band); its assets are {sorted(assets)}"
            )
        generation = _generation(item, stac.get("properties") or {}, cfg.quality.generation)
        radsat = by_key.get(RADSAT_ASSET)
        quality = QualityFiles(
            _local_file(item, key, assets[key]),
            generation,
            _local_file(item, radsat, assets[radsat]) if radsat and generation == "landsat_c2" else None,
        )
    return Product(item, product_bands, quality)
