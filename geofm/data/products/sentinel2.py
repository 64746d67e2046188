"""Sentinel-2 Level-1C and Level-2A products in their SAFE folders.

A product is a ``*.SAFE`` folder: its metadata ``MTD_MSIL1C.xml`` or ``MTD_MSIL2A.xml`` and one
granule's JPEG 2000 band files, ``GRANULE/*/IMG_DATA/*_B02.jp2`` (L1C) or
``GRANULE/*/IMG_DATA/R10m/*_B02_10m.jp2`` (L2A, each band at its native and coarser
resolutions). Reflectance is ``(DN + offset) / quantification``: the quantification value
(``QUANTIFICATION_VALUE``, L2A ``BOA_QUANTIFICATION_VALUE``) and, from processing baseline 04.00
on, the band's offset (``RADIO_ADD_OFFSET``, L2A ``BOA_ADD_OFFSET``, -1000), so products of either
side of that baseline give the same reflectance. DN 0 is no data. An L2A product's scene
classification (``SCL``) is its quality band.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from geofm.data.bands import BAND_ID_TABLES
from geofm.data.layouts import list_images
from geofm.data.products.base import BandFile, Product, QualityFiles, folders_of
from geofm.errors import RasterReadError

if TYPE_CHECKING:
    from geofm.config import SourceConfig

METADATA = {"MTD_MSIL1C.xml": "L1C", "MTD_MSIL2A.xml": "L2A"}
BAND_IDS = ("B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12")
"""The band of each ``band_id``/``bandId`` index of the metadata, when it has no Spectral_Information."""
OFFSETS_FROM_BASELINE = 4.0
_IMAGE = re.compile(r"_(B\d\d|B8A|SCL)(?:_(\d+)m)?\.jp2$", re.IGNORECASE)


def list_products(cfg: SourceConfig) -> list[Path]:
    """The SAFE folders below ``cfg.root``: the folders of the metadata files matching ``cfg.pattern``."""
    return folders_of(list_images(cfg.root, cfg.pattern))


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _band_id(name: str) -> str:
    """``B1`` (as the metadata spells it) -> ``B01`` (as the files do)."""
    name = name.strip().upper()
    return f"B{int(name[1:]):02d}" if name[1:].isdigit() else name


class _Metadata:
    """The fields of a product's MTD file that turn its DN into reflectance."""

    def __init__(self, path: Path) -> None:
        self.path, self.level = path, METADATA[path.name]
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError) as exc:
            raise RasterReadError(path, f"cannot read the product metadata: {exc}") from exc
        elements: dict[str, list[ET.Element]] = {}
        for element in root.iter():
            elements.setdefault(_local(element.tag), []).append(element)
        self._elements = elements
        baseline = self._text("PROCESSING_BASELINE")
        try:
            self.baseline = float(baseline)
        except ValueError:
            raise RasterReadError(path, f"PROCESSING_BASELINE {baseline!r} is not a number such as 04.00") from None
        quantification = "BOA_QUANTIFICATION_VALUE" if self.level == "L2A" else "QUANTIFICATION_VALUE"
        self.quantification = self._number(quantification)
        names = {
            e.get("bandId"): _band_id(e.get("physicalBand", ""))
            for e in elements.get("Spectral_Information", [])
            if e.get("bandId") is not None
        }
        offset_tag = "BOA_ADD_OFFSET" if self.level == "L2A" else "RADIO_ADD_OFFSET"
        self.offset_field = offset_tag
        self.offsets: dict[str, float] = {}
        for element in elements.get(offset_tag, []):
            index = element.get("band_id", "")
            band = names.get(index) or (
                BAND_IDS[int(index)] if index.isdigit() and int(index) < len(BAND_IDS) else None
            )
            if band is None:
                raise RasterReadError(path, f"{offset_tag} band_id {index!r} names no Sentinel-2 band")
            self.offsets[band] = self._float(element, offset_tag)
        self.nodata = 0.0
        for special in elements.get("Special_Values", []):
            values = {_local(c.tag): (c.text or "").strip() for c in special}
            if values.get("SPECIAL_VALUE_TEXT") == "NODATA":
                self.nodata = float(values.get("SPECIAL_VALUE_INDEX", 0))

    def _text(self, tag: str) -> str:
        found = self._elements.get(tag)
        if not found or not (found[0].text or "").strip():
            raise RasterReadError(self.path, f"has no {tag}")
        return found[0].text.strip()

    def _float(self, element: ET.Element, tag: str) -> float:
        try:
            return float((element.text or "").strip())
        except ValueError:
            raise RasterReadError(self.path, f"{tag} {element.text!r} is not a number") from None

    def _number(self, tag: str) -> float:
        value = self._float(self._elements[tag][0], tag) if tag in self._elements else None
        if value is None or value <= 0:
            raise RasterReadError(self.path, f"has no positive {tag}")
        return value

    def band(self, band_id: str, path: Path) -> BandFile:
        """Band ``band_id``'s file with its reflectance scaling.

        Raises:
            RasterReadError: a product of baseline 04.00 or later without the band's offset.
        """
        offset = self.offsets.get(band_id)
        if offset is None:
            if self.baseline >= OFFSETS_FROM_BASELINE:
                raise RasterReadError(
                    self.path,
                    f"processing baseline {self.baseline:05.2f} has no {self.offset_field} for band {band_id}; "
                    f"products from baseline 04.00 on give one per band",
                )
            offset = 0.0
        return BandFile(path, 1.0 / self.quantification, offset / self.quantification, self.nodata)


def _pick(by_resolution: dict[int, Path], gsd: float | None) -> Path:
    """The file of a band to read at ``gsd``: the coarsest not coarser than ``gsd``, else the finest."""
    fine_enough = [r for r in by_resolution if gsd is not None and r <= gsd]
    return by_resolution[max(fine_enough) if fine_enough else min(by_resolution)]


def open_product(cfg: SourceConfig, safe: Path, bands: Collection[str]) -> Product:
    """The product in SAFE folder ``safe``, with the files of ``bands`` (those it has) and its SCL.

    Raises:
        RasterReadError: the folder lacks its metadata or holds several granules, or the metadata
            lacks a field the reflectance needs.
    """
    found = [safe / name for name in METADATA if (safe / name).is_file()]
    if len(found) != 1:
        raise RasterReadError(
            safe, f"holds {len(found)} of the product metadata files {', '.join(METADATA)}; expected one"
        )
    metadata = _Metadata(found[0])
    files: dict[str, dict[int, Path]] = {}
    granules = set()
    for path in sorted((safe / "GRANULE").glob("*/IMG_DATA/**/*.jp2")):
        match = _IMAGE.search(path.name)
        if match is None:
            continue
        granules.add(path.relative_to(safe / "GRANULE").parts[0])
        files.setdefault(match[1].upper(), {})[int(match[2] or 0)] = path
    if len(granules) > 1:
        raise RasterReadError(safe, f"holds {len(granules)} granules; geofm reads single-tile products")
    names = BAND_ID_TABLES["sentinel2"]
    product_bands = {
        names[band_id]: metadata.band(band_id, _pick(by_resolution, cfg.gsd))
        for band_id, by_resolution in files.items()
        if band_id in names and names[band_id] in bands
    }
    quality = None
    if "SCL" in files and metadata.level == "L2A":
        quality = QualityFiles(_pick(files["SCL"], cfg.gsd), "sentinel2_scl")
    return Product(safe, product_bands, quality)
