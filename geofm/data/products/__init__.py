"""Per-band satellite products as pretraining samples.

A source's ``layout`` names a registered product layout (:data:`geofm.data.layouts.PRODUCT_LAYOUTS`,
``geofm list product-layouts``), which lists a source's products and describes one
(:class:`~geofm.data.products.base.Product`: its band files with their scaling, and its quality
band). The built-in layouts' modules: :mod:`.sentinel2` (Sentinel-2 SAFE folders), :mod:`.landsat`
(Landsat 8/9 scene folders with their MTL), :mod:`.stac` (STAC items with one local COG per band)
and :mod:`.band_files` (single-band files grouped by a regular expression).

:class:`ProductReader` reads a product, or a window of it, onto one grid at the source's GSD;
:mod:`.synthetic` writes products in these layouts from given pixels (for tests and benchmarks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from geofm.data.grid import GridError, PixelGrid, common_grid
from geofm.data.layouts import PRODUCT_LAYOUTS, list_images
from geofm.data.pixels import RawPixels
from geofm.data.products.base import BandFile, Product, QualityFiles
from geofm.data.quality import RECORDED_CLASSES, invalid_pixels
from geofm.data.readers import BandFiles
from geofm.errors import InvalidChipError, RasterReadError

if TYPE_CHECKING:
    from geofm.config import SourceConfig

__all__ = ["BandFile", "Product", "ProductReader", "QualityFiles", "list_images", "list_products"]

CACHED_PRODUCTS = 256
"""Products whose parsed metadata a reader keeps (a worker meets a scene's chips many times)."""


def list_products(cfg: SourceConfig) -> list[Path]:
    """The samples' paths of a source: its files (``file`` layout), what identifies each product, or a chip store's shards.

    Raises:
        DatasetNotFoundError: the source's folder is missing or holds no product (or no complete chip store).
    """
    return PRODUCT_LAYOUTS.get(cfg.layout).list_products(cfg)


class ProductReader:
    """The products of one source read onto one grid each, at the source's GSD (default: its finest band).

    Args:
        cfg: the source (a product layout).
        bands: the source's bands to read, in the order :meth:`read` returns them.
    """

    def __init__(self, cfg: SourceConfig, bands: Sequence[str]) -> None:
        self.cfg, self.bands = cfg, list(bands)
        self._open: Callable[[SourceConfig, Path, Collection[str]], Product] = PRODUCT_LAYOUTS.get(
            cfg.layout
        ).open_product
        self._cache: OrderedDict[Path, Product] = OrderedDict()

    def product(self, path: Path) -> Product:
        """The product at ``path`` with the files of the bands read (the last few are kept: metadata is parsed once).

        Raises:
            RasterReadError: its metadata cannot be read or lacks a field.
        """
        path = Path(path)
        if path in self._cache:
            self._cache.move_to_end(path)
        else:
            self._cache[path] = self._open(self.cfg, path, self.bands)
            if len(self._cache) > CACHED_PRODUCTS:
                self._cache.popitem(last=False)
        return self._cache[path]

    def _files(self, product: Product) -> list[Path]:
        """The files a read opens: the bands', then the quality band and its QA_RADSAT where used."""
        files = [product.band(b).path for b in self.bands]
        quality = self.cfg.quality
        if quality is None:
            return files
        if product.quality is None:
            raise RasterReadError(product.path, "has no quality band (quality is configured for its source)")
        files.append(product.quality.path)
        if self._needs_radsat(product.quality):
            if product.quality.radsat is None:
                raise RasterReadError(product.path, "has no QA_RADSAT, which Collection 2 saturation is read from")
            files.append(product.quality.radsat)
        return files

    def _needs_radsat(self, quality: QualityFiles) -> bool:
        return quality.generation == "landsat_c2" and "saturation" in self._classes(quality)

    def _classes(self, quality: QualityFiles) -> list[str]:
        """The classes that make a pixel invalid: the configured ones, default all the generation records."""
        configured = self.cfg.quality.invalid
        return list(RECORDED_CLASSES[quality.generation] if configured is None else configured)

    def _grid(self, product: Product, stack: BandFiles) -> PixelGrid:
        try:
            return common_grid(stack.infos, self.cfg.gsd)
        except GridError as exc:
            raise RasterReadError(product.path, str(exc)) from None

    def grid(self, path: Path) -> PixelGrid:
        """The grid the product at ``path`` is read onto (its files' headers are read).

        Raises:
            RasterReadError: the product or one of its files cannot be read, or its bands share no grid.
        """
        product = self.product(path)
        with BandFiles(self._files(product)) as stack:
            return self._grid(product, stack)

    def read(self, path: Path, window: tuple[int, int, int, int] | None = None) -> RawPixels:
        """The bands of the product at ``path`` (or a window ``(row, col, height, width)`` of its grid).

        With a quality band, that is read first and a window with more than
        ``quality.max_invalid_fraction`` invalid pixels is refused before any other band is read.

        Raises:
            RasterReadError: the product cannot be read, lacks a band, or its bands share no grid.
            InvalidChipError: the quality band marks too many of the window's pixels invalid.
        """
        product = self.product(path)
        bands = [product.band(b) for b in self.bands]
        with BandFiles(self._files(product)) as stack:
            grid = self._grid(product, stack)
            window = window or (0, 0, grid.height, grid.width)
            invalid = self._quality(product, stack, grid, window)
            data = np.stack(
                [stack.read(i, grid, window, nodata=self._nodata(band, None)) for i, band in enumerate(bands)]
            )
            nodata = [self._nodata(band, info.nodata) for band, info in zip(bands, stack.infos, strict=False)]
        return RawPixels(
            data=data,
            scale=np.array([b.scale for b in bands], dtype=np.float32),
            offset=np.array([b.offset for b in bands], dtype=np.float32),
            nodata=np.array([np.nan if v is None else v for v in nodata], dtype=np.float64),
            invalid=invalid,
        )

    def _nodata(self, band: BandFile, own: float | None) -> float | None:
        """A band's nodata: the source's ``nodata``, else the product's metadata, else the file's own."""
        if self.cfg.nodata is not None:
            return self.cfg.nodata
        return band.nodata if band.nodata is not None else own

    def _quality(
        self, product: Product, stack: BandFiles, grid: PixelGrid, window: tuple[int, int, int, int]
    ) -> np.ndarray | None:
        """The window's pixels the quality band marks invalid (None without quality configured)."""
        quality = self.cfg.quality
        if quality is None:
            return None
        at = len(self.bands)
        qa = stack.read(at, grid, window, categorical=True)
        radsat = stack.read(at + 1, grid, window, categorical=True) if self._needs_radsat(product.quality) else None
        try:
            invalid = invalid_pixels(
                qa, product.quality.generation, self._classes(product.quality), quality.confidence, radsat
            )
        except ValueError as exc:
            raise RasterReadError(product.quality.path, str(exc)) from None
        fraction = float(invalid.mean())
        if fraction > quality.max_invalid_fraction:
            raise InvalidChipError(product.path, window, fraction, quality.max_invalid_fraction)
        return invalid
