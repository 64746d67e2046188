"""How data lies on disk: the product layouts of pretraining sources and the folder layouts of
finetuning datasets, two registries users extend.

A source's ``layout`` names an entry of :data:`PRODUCT_LAYOUTS` (``geofm list product-layouts``).
An entry is a :class:`ProductLayout`: the default ``pattern`` of its files, whether each product's
own metadata gives its scaling and quality band, its own settings (``Options``, read from the
source's ``options``), the rules its source's fields must follow
(:meth:`ProductLayout.check`, run when the config is validated), and how a source's products are
listed and opened (:mod:`geofm.data.products` reads them onto one grid). A plug-in adds a layout
through the ``geofm.product_layouts`` entry-point group, naming an instance::

    [project.entry-points."geofm.product_layouts"]
    my_mission = "my_pkg.layout:MY_MISSION"

A finetuning dataset's split folder (a dataset without ``data.torchgeo``) has the parts of an entry
of :data:`FOLDER_LAYOUTS` (``geofm list folder-layouts``, group ``geofm.folder_layouts``):
``data.folder_layout``, by default the task family's own. An entry is a :class:`FolderLayout`
naming each part's default folder or file; its options, ``data.folders``, rename them.

This module imports no raster library: a config is checked without one, and the built-in layouts'
modules are imported when their products are first listed or opened.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from geofm.data.bands import BAND_ID_TABLES
from geofm.data.quality import GENERATIONS
from geofm.errors import DatasetNotFoundError
from geofm.registry import Registry, entry_options

if TYPE_CHECKING:
    from geofm.config import SourceConfig
    from geofm.config.sources import QualityConfig
    from geofm.data.products import Product


def where(cfg: SourceConfig) -> str:
    """How an error names a source and its layout."""
    return f"source {cfg.name!r} (layout {cfg.layout})"


def list_images(root: str | Path, pattern: str) -> list[Path]:
    """Files below ``root`` that match a glob pattern, sorted.

    Args:
        root: folder to search.
        pattern: glob relative to ``root``, e.g. ``"**/*.tif"``.

    Returns:
        The matching files (folders excluded), in sorted order.

    Raises:
        DatasetNotFoundError: if ``root`` is not a folder or no file matches.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotFoundError(f"image folder {root.resolve()} does not exist (pattern {pattern!r})")
    files = [p for p in sorted(root.glob(pattern)) if p.is_file()]
    if not files:
        raise DatasetNotFoundError(f"no file in {root.resolve()} matches the pattern {pattern!r}")
    return files


class ProductLayout:
    """Per-band products: their files, how a source's fields must fit them, how they are listed and opened.

    Attributes:
        pattern: the default ``pattern`` of a source: the glob below ``root`` of its files, or of
            the metadata files that mark its products.
        metadata: each product's own metadata gives the scale and offset of its bands and names its
            quality band and that band's generation (a source then leaves them out).
        quality_band: what ``quality.band`` names where the layout needs it told ("band id",
            "asset"), else None.
        reads: how a sample is read: ``products`` (per-band files onto one grid, by
            :meth:`open_product`), ``files`` (one multi-band raster) or ``chips`` (a chip store's shards).
        Options: the pydantic model of the layout's own settings, a source's ``options``; None: it
            takes none.
    """

    pattern: str = "**/*"
    metadata: bool = False
    quality_band: str | None = None
    reads: Literal["products", "files", "chips"] = "products"
    Options: ClassVar[type[BaseModel] | None] = None

    def options_of(self, cfg: SourceConfig) -> Any:
        """The layout's own settings: the source's ``options`` validated by :attr:`Options`.

        Raises:
            ValueError: naming the source, its layout and the bad field.
        """
        return entry_options(cfg.layout, self.Options, cfg.options, f"{where(cfg)} options")

    def defaults(self) -> dict[str, Any]:
        """Values of a source's fields it leaves unset (None) under this layout."""
        return {"pattern": self.pattern}

    def check(self, cfg: SourceConfig) -> None:
        """Refuse a source whose fields do not fit the layout.

        Raises:
            ValueError: naming the source, its layout and the fields.
        """
        self.options_of(cfg)
        if self.metadata and (cfg.scale != 1.0 or cfg.offset != 0.0):
            raise ValueError(f"{where(cfg)}: scale and offset come from each product's metadata; leave them out")
        if cfg.quality is not None:
            self.check_quality(cfg, cfg.quality)

    def check_quality(self, cfg: SourceConfig, quality: QualityConfig) -> None:
        """Refuse a source's ``quality`` that does not fit the layout.

        Raises:
            ValueError: naming the source, its layout and the fields.
        """
        if self.metadata and (quality.band is not None or quality.generation is not None):
            raise ValueError(
                f"{where(cfg)}: quality.band and quality.generation come from each product's metadata; leave them out"
            )
        if self.quality_band is not None and quality.band is None:
            raise ValueError(f"{where(cfg)}: quality.band must name the quality band's {self.quality_band}")

    def list_products(self, cfg: SourceConfig) -> list[Path]:
        """What identifies each sample of source ``cfg`` (a file, a product's folder, a shard), sorted.

        Raises:
            DatasetNotFoundError: the source's folder is missing or holds none.
        """
        raise NotImplementedError

    def open_product(self, cfg: SourceConfig, path: Path, bands: Collection[str]) -> Product:
        """The product identified by ``path`` with the files of ``bands`` (those it has) and its quality band.

        Raises:
            RasterReadError: its metadata cannot be read or lacks a field.
        """
        raise NotImplementedError

    def label(self, cfg: SourceConfig, path: Path) -> str:
        """A person's name for the sample identified by ``path``."""
        return path.name


class _ModuleLayout(ProductLayout):
    """A built-in layout whose products a module of :mod:`geofm.data.products` lists and opens."""

    module: str

    def _module(self) -> Any:
        return importlib.import_module(f"geofm.data.products.{self.module}")

    def list_products(self, cfg: SourceConfig) -> list[Path]:
        return self._module().list_products(cfg)

    def open_product(self, cfg: SourceConfig, path: Path, bands: Collection[str]) -> Product:
        return self._module().open_product(cfg, path, bands)


class FileLayout(ProductLayout):
    """One multi-band raster file (GeoTIFF, PNG, JPEG) per sample, scaled by the source's scale and offset."""

    pattern = "**/*.tif"
    reads = "files"

    def check_quality(self, cfg: SourceConfig, quality: QualityConfig) -> None:
        raise ValueError(f"{where(cfg)}: quality applies to per-band product layouts")

    def list_products(self, cfg: SourceConfig) -> list[Path]:
        return list_images(cfg.root, cfg.pattern)


class ChipsLayout(ProductLayout):
    """A chip store written by `geofm data prepare` (root: its folder), its chips already scaled and masked."""

    pattern = "index.json"
    reads = "chips"

    def check(self, cfg: SourceConfig) -> None:
        super().check(cfg)
        fixed = [k for k in ("nodata", "chip_size", "quality") if getattr(cfg, k) is not None]
        fixed += [k for k, default in (("scale", 1.0), ("offset", 0.0)) if getattr(cfg, k) != default]
        if fixed:
            raise ValueError(
                f"{where(cfg)}: {', '.join(fixed)} were applied when the store was prepared (geofm data prepare); "
                "leave them out"
            )

    def list_products(self, cfg: SourceConfig) -> list[Path]:
        from geofm.data.chipstore import ChipStore  # imports torch: only where a store is listed

        return ChipStore(cfg.root).shard_paths()


class Sentinel2SafeLayout(_ModuleLayout):
    """Sentinel-2 L1C and L2A SAFE folders, scaled and masked (L2A's SCL) as their metadata says."""

    pattern = "**/MTD_MSIL*.xml"
    metadata = True
    module = "sentinel2"


class LandsatC2Layout(_ModuleLayout):
    """Landsat 8/9 Collection 1 and 2 scene folders, scaled and masked (QA_PIXEL, BQA) as their MTL says."""

    pattern = "**/*_MTL.txt"
    metadata = True
    module = "landsat"


class StacItemLayout(_ModuleLayout):
    """STAC items with one local COG per band asset; `quality.band` names the quality band's asset."""

    pattern = "**/*.json"
    quality_band = "asset"
    module = "stac"


class BandFilesOptions(BaseModel):
    """The settings of layout ``band_files``: a source's ``options``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    filename_regex: str = Field(
        description="regular expression matched against each file's path below root, with groups scene and band, "
        "e.g. (?P<scene>.+)_(?P<band>B\\w+)\\.(tif|jp2)"
    )
    band_ids: Literal[(*BAND_ID_TABLES, "vocabulary")] = Field(  # type: ignore[valid-type]
        default="vocabulary",
        description="the table of band ids: sentinel2 (B01..B12, B8A), landsat8 (B1..B11) or vocabulary (ids are "
        "band names)",
    )


LAYOUT_KEYS_MOVED = {"filename_regex": None, "band_ids": "vocabulary"}
"""Keys of a source in configs written before each product layout kept its settings in the source's
``options`` (layout ``band_files``'s), and what a run saved for each where the source left it out
(null, or the default table); a config that still sets one is told where it went."""


class BandFilesLayout(_ModuleLayout):
    """Single-band files grouped into one product per scene by `options.filename_regex` (groups scene and band)."""

    quality_band = "band id"
    module = "band_files"
    Options = BandFilesOptions

    def check(self, cfg: SourceConfig) -> None:
        super().check(cfg)
        regex = self.options_of(cfg).filename_regex
        try:
            groups = re.compile(regex).groupindex
        except re.error as err:
            raise ValueError(
                f"{where(cfg)}: options.filename_regex {regex!r} is not a regular expression: {err}"
            ) from None
        missing = [g for g in ("scene", "band") if g not in groups]
        if missing:
            raise ValueError(f"{where(cfg)}: options.filename_regex {regex!r} has no group {' or '.join(missing)}")

    def check_quality(self, cfg: SourceConfig, quality: QualityConfig) -> None:
        super().check_quality(cfg, quality)
        if quality.generation is None:
            raise ValueError(
                f"{where(cfg)}: quality.generation must name the quality band's layout ({', '.join(GENERATIONS)}); "
                "single files carry no metadata that tells it"
            )

    def label(self, cfg: SourceConfig, path: Path) -> str:
        """The scene, by its id (not by its first band's file)."""
        return f"scene {self._module().scene_name(cfg, path)}"


PRODUCT_LAYOUTS: Registry[ProductLayout] = Registry("product layout", "geofm.product_layouts")
"""How a pretraining source's samples lie on disk (``data.sources[].layout``).

Entries are :class:`ProductLayout` instances."""
PRODUCT_LAYOUTS.register("file", FileLayout())
PRODUCT_LAYOUTS.register("chips", ChipsLayout())
PRODUCT_LAYOUTS.register("sentinel2_safe", Sentinel2SafeLayout())
PRODUCT_LAYOUTS.register("landsat_c2", LandsatC2Layout())
PRODUCT_LAYOUTS.register("stac_item", StacItemLayout())
PRODUCT_LAYOUTS.register("band_files", BandFilesLayout())


class FolderLayout:
    """The parts of a split folder of finetuning data.

    Attributes:
        parts: each part's default name below the split folder (a folder, or a file such as
            ``labels.csv``), by the part's name; ``data.folders`` renames them.
    """

    parts: Mapping[str, str] = MappingProxyType({})

    @property
    def Options(self) -> type[BaseModel] | None:
        """The layout's own settings, ``data.folders``: each part's name (default :attr:`parts`'); None without parts."""
        return _parts_model(type(self).__name__, tuple(self.parts.items())) if self.parts else None

    def check(self, folders: Mapping[str, str], name: str, needs: Collection[str]) -> None:
        """Refuse ``data.folders`` naming a part the layout does not have, and a layout without a part the
        task family reads.

        Args:
            folders: ``data.folders``.
            name: the layout's registered name, for messages.
            needs: the parts the task family's reader reads.

        Raises:
            ValueError: naming the parts.
        """
        unknown = sorted(set(folders) - set(self.parts))
        if unknown:
            parts = ", ".join(self.parts) or "none (one sub-folder per class)"
            raise ValueError(f"data.folders: {unknown} are not parts of a {name} split folder; its parts are {parts}")
        missing = sorted(set(needs) - set(self.parts))
        if missing:
            raise ValueError(
                f"data.folder_layout {name} has no part {', '.join(missing)}, which the task reads "
                f"(it has {', '.join(self.parts) or 'none'})"
            )


@functools.cache
def _parts_model(layout: str, parts: tuple[tuple[str, str], ...]) -> type[BaseModel]:
    """The options model of a folder layout of ``parts``: one string field per part, its default name as default."""
    fields: dict[str, Any] = {
        part: (str, Field(default=default, min_length=1, description=f"the {part} part's name below a split folder"))
        for part, default in parts
    }
    return create_model(f"{layout}Options", __config__=ConfigDict(extra="forbid", frozen=True), **fields)


class ClassFolders(FolderLayout):
    """One sub-folder of images per class (UC Merced, AID layout)."""


class MultilabelFolders(FolderLayout):
    """`images/` and `labels.csv`: header `image,<class>,...`, a row per image (its file name, then 0 or 1 per class)."""

    parts = MappingProxyType({"images": "images", "labels": "labels.csv"})


class SegmentationFolders(FolderLayout):
    """`images/` and `masks/`, a mask per image with the same file stem."""

    parts = MappingProxyType({"images": "images", "masks": "masks"})


class ChangeFolders(FolderLayout):
    """`A/` (before), `B/` (after), `label/` (LEVIR-CD layout), same file stems; DSIFN-style data: `folders: {before:
    t1, after: t2, mask: mask}`."""

    parts = MappingProxyType({"before": "A", "after": "B", "mask": "label"})


class SuperresFolders(FolderLayout):
    """`lr/` (low resolution) and `hr/` (high resolution), same file stems."""

    parts = MappingProxyType({"lr": "lr", "hr": "hr"})


FOLDER_LAYOUTS: Registry[FolderLayout] = Registry("folder layout", "geofm.folder_layouts")
"""The parts of a finetuning split folder (a dataset without ``data.torchgeo``), by task family.

Entries are :class:`FolderLayout` instances."""
FOLDER_LAYOUTS.register("classification", ClassFolders())
FOLDER_LAYOUTS.register("multilabel", MultilabelFolders())
FOLDER_LAYOUTS.register("segmentation", SegmentationFolders())
FOLDER_LAYOUTS.register("change", ChangeFolders())
FOLDER_LAYOUTS.register("superres", SuperresFolders())


__all__ = ["FOLDER_LAYOUTS", "LAYOUT_KEYS_MOVED", "PRODUCT_LAYOUTS", "FolderLayout", "ProductLayout", "where"]
