"""One imagery source: its files or products, band layout, nodata, quality and normalisation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from geofm.data.chipstore import ChipStore
from geofm.data.grid import Window, grid_windows
from geofm.data.layouts import PRODUCT_LAYOUTS
from geofm.data.pixels import RawPixels
from geofm.data.products import ProductReader, list_images, list_products
from geofm.data.readers import WindowReader, raster_info, read_raster
from geofm.errors import DataMismatchError

if TYPE_CHECKING:
    from geofm.config import SourceConfig

__all__ = ["Chip", "ImageSource", "chips_of", "list_images", "list_products"]


class Chip(NamedTuple):
    """One sample of a source: a file or product, a window ``(row, col, height, width)`` of a large one,
    or chip ``item`` of a chip store's shard."""

    file: Path
    window: Window | None = None
    item: int | None = None


def _file_size(path: Path) -> tuple[int, int]:
    info = raster_info(path)
    return info.height, info.width


def chips_of(
    files: Sequence[Path], chip_size: int | None, size_of: Callable[[Path], tuple[int, int]] = _file_size
) -> list[Chip]:
    """The samples of a source's files: each file whole, or with ``chip_size`` each file larger than
    that cut into a grid of ``chip_size`` windows (the last row and column flush with the far edges).

    ``size_of`` gives a file's ``(height, width)`` (default: from its header; for a product, its grid's).

    Raises:
        RasterReadError: if ``chip_size`` is set and a file's header cannot be read.
    """
    if chip_size is None:
        return [Chip(f) for f in files]
    chips = []
    for f in files:
        height, width = size_of(f)
        if height <= chip_size and width <= chip_size:
            chips.append(Chip(f))
            continue
        chips += [Chip(f, window) for window in grid_windows(Window(0, 0, height, width), chip_size)]
    return chips


def open_store(cfg: SourceConfig) -> ChipStore:
    """The chip store of a ``chips`` source, which must hold the source's bands in its order.

    Raises:
        DatasetNotFoundError: the store is missing, incomplete or lacks a shard file.
        DataMismatchError: the store holds other bands than the source's ``bands``.
    """
    store = ChipStore(cfg.root)
    if store.bands != list(cfg.bands):
        raise DataMismatchError(
            f"{store.index_path}: the store holds bands {store.bands}; source {cfg.name!r} lists bands {cfg.bands} "
            "(its bands must be the store's, in the store's order)"
        )
    return store


class ImageSource:
    """The samples of one source, loaded in the model's band order and normalised.

    A sample is a file or a product (its ``layout``: one multi-band file, or per-band files read
    onto one grid, see :mod:`geofm.data.products`), or with ``chip_size`` a window of one larger
    than that (see :func:`chips_of`), read by window and never whole; or a chip of a chip store
    (``layout: chips``, see :mod:`geofm.data.chipstore`), whose files are the store's shards. It is
    an image of shape (len(model_bands), H, W) and a valid mask of the same shape. Bands the source lacks are zero
    and invalid; nodata, non-finite pixels and those the quality band marks are zero and invalid;
    bands of the source that the model does not use are neither read nor returned.
    """

    def __init__(self, cfg: SourceConfig, model_bands: list[str], files: Sequence[Path] | None = None) -> None:
        """Initialise a new ImageSource instance.

        Args:
            cfg: the source's configuration.
            model_bands: the model's input bands, in order.
            files: the source's files or products to use (a federated client's share), default
                all of them (:func:`list_products`).

        Raises:
            DatasetNotFoundError: if the source's folder is missing or holds no file or product.
            RasterReadError: with ``chip_size``, if a file's header cannot be read.
            DataMismatchError: if a chip store holds other bands than the source's.
            ValueError: if the source has none of ``model_bands``.
        """
        keep = [i for i, b in enumerate(cfg.bands) if b in model_bands]
        if not keep:
            raise ValueError(f"source {cfg.name!r} has none of the model bands {model_bands}: {cfg.bands}")
        self.cfg = cfg
        self.model_bands = list(model_bands)
        self.files = list_products(cfg) if files is None else list(files)
        used = [cfg.bands[i] for i in keep]
        self._layout = PRODUCT_LAYOUTS.get(cfg.layout)
        self._products = ProductReader(cfg, used) if self._layout.reads == "products" else None
        self._store = open_store(cfg) if self._layout.reads == "chips" else None
        if self._store is not None:
            self.chips = [Chip(f, None, k) for f in self.files for k in range(self._store.shard(f).chips)]
        else:
            self.chips = chips_of(self.files, cfg.chip_size, self._product_size if self._products else _file_size)
        self._keep = keep
        self._positions = torch.tensor([self.model_bands.index(cfg.bands[i]) for i in keep])
        self._mean = np.asarray(cfg.mean, dtype=np.float32)[keep, None, None]
        self._std = np.asarray(cfg.std, dtype=np.float32)[keep, None, None]
        self._in_order = self._positions.tolist() == list(range(len(self.model_bands)))

    @property
    def name(self) -> str:
        """The source's name."""
        return self.cfg.name

    def chip_label(self, chip: Chip) -> str:
        """A person's name for ``chip``: its file, or its product (a per-band scene by its scene id, not by
        its first band's file), and the window it covers."""
        if chip.item is not None:
            label = f"{chip.file.name} chip {chip.item}"
        else:
            label = self._layout.label(self.cfg, chip.file)
        if chip.window is None:
            return label
        row, col, height, width = chip.window
        return f"{label} [{row}:{row + height}, {col}:{col + width}]"

    def __len__(self) -> int:
        """Number of samples of the source: its files, or with ``chip_size`` their chips."""
        return len(self.chips)

    def _product_size(self, path: Path) -> tuple[int, int]:
        grid = self._products.grid(path)
        return grid.height, grid.width

    def read(self, index: int) -> RawPixels:
        """The raw pixels of sample ``index`` in the source's used bands, with their scaling and nodata.

        Raises:
            RasterReadError: if the file cannot be read or does not match the source's bands.
            InvalidChipError: if its quality band marks too many pixels invalid.
        """
        chip = self.chips[index]
        if self._store is not None:
            pixels, valid, scale, offset = self._store.read(chip.file, chip.item, self._keep)
            return RawPixels(pixels, scale, offset, np.full(len(self._keep), np.nan), valid=valid)
        if self._products is not None:
            return self._products.read(chip.file, chip.window)
        if chip.window is None:
            raster = read_raster(chip.file, len(self.cfg.bands), band_names=self.cfg.bands, bands=self._keep)
            data, own_nodata = raster.data, raster.nodata
        else:
            with WindowReader(chip.file, len(self.cfg.bands), band_names=self.cfg.bands) as reader:
                data, own_nodata = reader.read(*chip.window, bands=self._keep), reader.info.nodata
        nodata = self.cfg.nodata if self.cfg.nodata is not None else own_nodata
        bands = len(self._keep)
        return RawPixels(
            data=data,
            scale=np.full(bands, self.cfg.scale, dtype=np.float32),
            offset=np.full(bands, self.cfg.offset, dtype=np.float32),
            nodata=np.full(bands, np.nan if nodata is None else nodata, dtype=np.float64),
        )

    def load(self, index: int) -> tuple[Tensor, Tensor]:
        """Read and normalise one sample.

        Args:
            index: position of the sample in :attr:`chips`.

        Returns:
            The image (float32) and its valid mask (bool), both (len(model_bands), H, W).

        Raises:
            RasterReadError: if the file cannot be read or does not match the source's bands.
            InvalidChipError: if its quality band marks too many pixels invalid.
        """
        raw = self.read(index)
        pixels, valid = raw.normalised(self._mean, self._std)
        if self._in_order:  # the source holds every model band, in the model's order
            return torch.from_numpy(pixels), torch.from_numpy(valid)

        _, height, width = raw.data.shape
        image = torch.zeros(len(self.model_bands), height, width, dtype=torch.float32)
        mask = torch.zeros(len(self.model_bands), height, width, dtype=torch.bool)
        image[self._positions] = torch.from_numpy(pixels)
        mask[self._positions] = torch.from_numpy(valid)
        return image, mask

    def denormalise(self, image: Tensor) -> Tensor:
        """Scaled values (raw x ``scale``: reflectance for most products) of a normalised image of this
        source, (len(model_bands), H, W); bands the source lacks, invalid in its samples, are left as they are."""
        image = image.float().clone()
        mean = torch.from_numpy(self._mean).to(image.device)
        std = torch.from_numpy(self._std).to(image.device)
        positions = self._positions.to(image.device)
        image[positions] = image[positions] * std + mean
        return image
