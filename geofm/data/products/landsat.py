"""Landsat 8/9 Collection 1 and 2, Level-1 and Level-2 scenes in their folders.

A product is a scene folder: its metadata ``*_MTL.txt`` (or ``_MTL.json``, ``_MTL.xml``) names
the band files and how their values scale. ``COLLECTION_NUMBER`` tells the collection (a scene
without it is pre-collection: read those with the ``band_files`` layout). Physical values are
``DN * MULT + ADD`` with the MTL's factors: Level-2 surface reflectance
(``REFLECTANCE_MULT_BAND_n``, 2.75e-5, and ``REFLECTANCE_ADD_BAND_n``, -0.2) and surface
temperature in kelvin (``TEMPERATURE_MULT_BAND_ST_B10``/``ADD``); Level-1 top-of-atmosphere
reflectance for bands 1-9 (``REFLECTANCE_MULT/ADD_BAND_n``) and radiance for the thermal bands 10
and 11 (``RADIANCE_MULT/ADD_BAND_n``). DN 0 is fill. The quality band is QA_PIXEL with QA_RADSAT
(Collection 2) or BQA (Collection 1).
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofm.data.bands import BAND_ID_TABLES
from geofm.data.layouts import list_images
from geofm.data.products.base import BandFile, Product, QualityFiles, folders_of
from geofm.errors import RasterReadError

if TYPE_CHECKING:
    from geofm.config import SourceConfig

METADATA_SUFFIXES = ("_MTL.txt", "_MTL.json", "_MTL.xml")
SPACECRAFT = ("LANDSAT_8", "LANDSAT_9")
THERMAL = (10, 11)
_ASSIGNMENT = re.compile(r"^\s*(\w+)\s*=\s*(.*?)\s*$")

Tree = dict[str, Any]


def list_products(cfg: SourceConfig) -> list[Path]:
    """The scene folders below ``cfg.root``: the folders of the metadata files matching ``cfg.pattern``."""
    return folders_of(list_images(cfg.root, cfg.pattern))


def _parse_text(text: str, path: Path) -> Tree:
    """An MTL.txt (``GROUP = X`` ... ``END_GROUP = X``, ``KEY = VALUE``) as nested dicts."""
    root: Tree = {}
    stack = [root]
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.strip() == "END":
            continue
        match = _ASSIGNMENT.match(line)
        if match is None:
            raise RasterReadError(path, f"line {number} is not KEY = VALUE: {line.strip()!r}")
        key, value = match[1], match[2].strip('"')
        if key == "GROUP":
            stack[-1][value] = {}
            stack.append(stack[-1][value])
        elif key == "END_GROUP":
            if len(stack) == 1:
                raise RasterReadError(path, f"line {number} ends group {value} that was never opened")
            stack.pop()
        else:
            stack[-1][key] = value
    return root


def _parse_xml(element: ET.Element) -> Tree | str:
    children = list(element)
    if not children:
        return (element.text or "").strip()
    return {child.tag: _parse_xml(child) for child in children}


def read_mtl(path: Path) -> Tree:
    """A scene's MTL metadata (text, JSON or XML) as nested dicts of strings.

    Raises:
        RasterReadError: the file cannot be read or parsed.
    """
    try:
        if path.name.endswith(".json"):
            return json.loads(path.read_text())
        if path.name.endswith(".xml"):
            root = ET.parse(path).getroot()
            return {root.tag: _parse_xml(root)}
        return _parse_text(path.read_text(), path)
    except (OSError, ValueError, ET.ParseError) as exc:
        raise RasterReadError(path, f"cannot read the scene metadata: {exc}") from exc


def find_value(tree: Tree, key: str) -> str | None:
    """The value of ``key`` in any group of an MTL tree, or None."""
    if key in tree and not isinstance(tree[key], dict):
        return str(tree[key])
    for value in tree.values():
        if isinstance(value, dict) and (found := find_value(value, key)) is not None:
            return found
    return None


def find_group(tree: Tree, name: str) -> Tree | None:
    """The group ``name`` anywhere in an MTL tree, or None."""
    if isinstance(tree.get(name), dict):
        return tree[name]
    for value in tree.values():
        if isinstance(value, dict) and (found := find_group(value, name)) is not None:
            return found
    return None


class _Scene:
    """A scene's MTL: its collection, level, files and scaling factors."""

    def __init__(self, folder: Path) -> None:
        found = [p for suffix in METADATA_SUFFIXES for p in sorted(folder.glob(f"*{suffix}"))]
        if not found:
            raise RasterReadError(folder, f"holds no scene metadata (*{', *'.join(METADATA_SUFFIXES)})")
        stems = {p.name[: p.name.rindex("_MTL")] for p in found}
        if len(stems) > 1:
            raise RasterReadError(
                folder, f"holds the metadata of {len(stems)} scenes {sorted(stems)}; keep one per folder"
            )
        self.folder, self.path = folder, found[0]
        self.tree = read_mtl(self.path)
        collection = find_value(self.tree, "COLLECTION_NUMBER")
        if collection is None:
            raise RasterReadError(
                self.path,
                "has no COLLECTION_NUMBER: a pre-collection scene, whose BQA layout differs; read it with "
                "layout band_files and quality.generation landsat_pre_collection",
            )
        if collection.strip() not in ("01", "02", "1", "2"):
            raise RasterReadError(self.path, f"COLLECTION_NUMBER {collection!r}: expected 01 or 02")
        self.collection = int(collection)
        spacecraft = find_value(self.tree, "SPACECRAFT_ID")
        if spacecraft is not None and spacecraft not in SPACECRAFT:
            raise RasterReadError(self.path, f"SPACECRAFT_ID {spacecraft}: geofm reads Landsat 8 and 9 scenes")
        level = find_value(self.tree, "PROCESSING_LEVEL") or find_value(self.tree, "DATA_TYPE") or ""
        self.level2 = level.startswith("L2")
        self.files = self._group("PRODUCT_CONTENTS" if self.collection == 2 else "PRODUCT_METADATA")

    def _group(self, name: str) -> Tree:
        group = find_group(self.tree, name)
        if group is None:
            raise RasterReadError(self.path, f"has no group {name}")
        return group

    def _factor(self, group: Tree, group_name: str, key: str) -> float:
        if key not in group:
            raise RasterReadError(self.path, f"has no {key} in {group_name}")
        try:
            return float(group[key])
        except ValueError:
            raise RasterReadError(self.path, f"{key} {group[key]!r} is not a number") from None

    def file(self, key: str) -> Path | None:
        """The file the MTL names under ``key``, or None if it names none."""
        name = self.files.get(key)
        return self.folder / name if name else None

    def _scaling(self, number: int) -> tuple[str, str, str] | None:
        """Band ``number``'s file key, the group of its factors and their key (``{}`` for MULT or ADD)."""
        if self.level2:
            if number == 10:
                return "FILE_NAME_BAND_ST_B10", "LEVEL2_SURFACE_TEMPERATURE_PARAMETERS", "TEMPERATURE_{}_BAND_ST_B10"
            if number in THERMAL:
                return None
            return (
                f"FILE_NAME_BAND_{number}",
                "LEVEL2_SURFACE_REFLECTANCE_PARAMETERS",
                f"REFLECTANCE_{{}}_BAND_{number}",
            )
        group = "LEVEL1_RADIOMETRIC_RESCALING" if self.collection == 2 else "RADIOMETRIC_RESCALING"
        quantity = "RADIANCE" if number in THERMAL else "REFLECTANCE"
        return f"FILE_NAME_BAND_{number}", group, f"{quantity}_{{}}_BAND_{number}"

    def band(self, number: int) -> BandFile | None:
        """Band ``number``'s file and scaling, or None if the scene has no such band.

        Raises:
            RasterReadError: the MTL names the file but not its factors.
        """
        scaling = self._scaling(number)
        path = self.file(scaling[0]) if scaling else None
        if path is None:
            return None
        _, group_name, factor = scaling
        group = self._group(group_name)
        scale = self._factor(group, group_name, factor.format("MULT"))
        return BandFile(path, scale, self._factor(group, group_name, factor.format("ADD")), 0.0)

    def quality(self) -> QualityFiles | None:
        if self.collection == 1:
            path = self.file("FILE_NAME_BAND_QUALITY")
            return QualityFiles(path, "landsat_c1") if path else None
        path = self.file("FILE_NAME_QUALITY_L1_PIXEL")
        radsat = self.file("FILE_NAME_QUALITY_L1_RADIOMETRIC_SATURATION")
        return QualityFiles(path, "landsat_c2", radsat) if path else None


def open_product(cfg: SourceConfig, folder: Path, bands: Collection[str]) -> Product:
    """The scene in ``folder``, with the files of ``bands`` (those it has) and its quality band.

    Raises:
        RasterReadError: the folder holds no or several scenes' metadata, or the metadata lacks a
            field the scaling needs or names no collection.
    """
    scene = _Scene(folder)
    numbers = {name: int(band_id[1:]) for band_id, name in BAND_ID_TABLES["landsat8"].items()}
    product_bands = {}
    for name in bands:
        if name in numbers and (band := scene.band(numbers[name])) is not None:
            product_bands[name] = band
    return Product(folder, product_bands, scene.quality())
