"""Folders of single-band files, grouped into one product per scene by a regular expression.

As torchgeo's ``RasterDataset`` with ``separate_files``: ``filename_regex`` (of the source's
``options``, :class:`~geofm.data.layouts.BandFilesOptions`) is matched against
each file's path relative to the source's root and names two groups, ``scene`` (which files form
one product) and ``band`` (the band id, e.g. ``B8A``). ``band_ids`` names the table mapping band
ids to vocabulary names (:data:`geofm.data.bands.BAND_ID_TABLES`, or ``vocabulary`` where the ids
are band names); files whose id maps to no band are not read. A scene's files lie in one folder;
its product is identified by its first file. Values scale by the source's ``scale`` and
``offset``; the quality band is the file whose id is ``quality.band``, with the generation that
``quality.generation`` names, and Collection 2's QA_RADSAT the file of id ``QA_RADSAT``.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from geofm.data.bands import band_of_id
from geofm.data.layouts import list_images
from geofm.data.products.base import BandFile, Product, QualityFiles
from geofm.errors import DataMismatchError, DatasetNotFoundError, RasterReadError

if TYPE_CHECKING:
    from geofm.config import SourceConfig

RADSAT_ID = "QA_RADSAT"


def _ids(cfg: SourceConfig, files: list[Path]) -> dict[tuple[Path, str], dict[str, Path]]:
    """The band files of each ``(folder, scene)``, by upper-case band id.

    Raises:
        DataMismatchError: two files of one scene have the same band id.
    """
    regex = re.compile(cfg.layout_options.filename_regex)
    root = Path(cfg.root)
    scenes: dict[tuple[Path, str], dict[str, Path]] = {}
    for path in files:
        match = regex.fullmatch(path.relative_to(root).as_posix())
        if match is None:
            continue
        band = match["band"].upper()
        scene = scenes.setdefault((path.parent, match["scene"]), {})
        if band in scene:
            raise DataMismatchError(
                f"source {cfg.name!r}: {scene[band]} and {path} are both band {band} of scene {match['scene']!r} "
                f"(filename_regex {regex.pattern!r})"
            )
        scene[band] = path
    return scenes


def list_products(cfg: SourceConfig) -> list[Path]:
    """The first file of each scene below ``cfg.root`` (files matching ``cfg.pattern`` and ``cfg.filename_regex``).

    Raises:
        DatasetNotFoundError: no file matches both.
    """
    scenes = _ids(cfg, list_images(cfg.root, cfg.pattern))
    if not scenes:
        raise DatasetNotFoundError(
            f"no file in {Path(cfg.root).resolve()} matching {cfg.pattern!r} matches filename_regex "
            f"{cfg.layout_options.filename_regex!r}"
        )
    return sorted(min(files.values()) for files in scenes.values())


def scene_name(cfg: SourceConfig, first: Path) -> str:
    """The scene id (``filename_regex``'s ``scene`` group) of the scene whose first file is ``first``."""
    match = re.compile(cfg.layout_options.filename_regex).fullmatch(first.relative_to(Path(cfg.root)).as_posix())
    return first.name if match is None else match["scene"]


def open_product(cfg: SourceConfig, first: Path, bands: Collection[str]) -> Product:
    """The scene whose first file is ``first``, with the files of ``bands`` (those it has) and its quality band.

    Raises:
        RasterReadError: ``first`` matches no scene, or the configured quality band is missing.
    """
    options = cfg.layout_options
    scenes = _ids(cfg, sorted(p for p in first.parent.iterdir() if p.is_file()))
    ids = next((files for files in scenes.values() if first in files.values()), None)
    if ids is None:
        raise RasterReadError(first, f"matches no scene of filename_regex {options.filename_regex!r}")
    product_bands = {}
    for band_id, path in ids.items():
        name = band_of_id(band_id, options.band_ids, cfg.bands)
        if name is not None and name in bands:
            product_bands[name] = BandFile(path, cfg.scale, cfg.offset)
    quality = None
    if cfg.quality is not None:
        band_id = cfg.quality.band.upper()
        if band_id not in ids:
            raise RasterReadError(
                first, f"its scene has no quality band {cfg.quality.band} (quality.band); it has {sorted(ids)}"
            )
        quality = QualityFiles(ids[band_id], cfg.quality.generation, ids.get(RADSAT_ID))
    return Product(first, product_bands, quality)
