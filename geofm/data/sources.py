"""One imagery source: its files, band layout, nodata and normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from geofm.config import SourceConfig
from geofm.data.grid import Window, grid_windows
from geofm.data.readers import WindowReader, normalise_pixels, raster_info, read_raster
from geofm.errors import DatasetNotFoundError


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


class Chip(NamedTuple):
    """One sample of a source: a file, or a window ``(row, col, height, width)`` of a large one."""

    file: Path
    window: Window | None = None


def chips_of(files: Sequence[Path], chip_size: int | None) -> list[Chip]:
    """The samples of a source's files: each file whole, or with ``chip_size`` each file larger than
    that cut into a grid of ``chip_size`` windows (the last row and column flush with the far edges).

    Raises:
        RasterReadError: if ``chip_size`` is set and a file's header cannot be read.
    """
    if chip_size is None:
        return [Chip(f) for f in files]
    chips = []
    for f in files:
        info = raster_info(f)
        if info.height <= chip_size and info.width <= chip_size:
            chips.append(Chip(f))
            continue
        chips += [Chip(f, window) for window in grid_windows(Window(0, 0, info.height, info.width), chip_size)]
    return chips


class ImageSource:
    """The samples of one source, loaded in the model's band order and normalised.

    A sample is a file, or with ``chip_size`` a window of a file larger than that (see
    :func:`chips_of`), read by window and never whole. It is an image of shape
    (len(model_bands), H, W) and a valid mask of the same shape. Bands the source lacks are zero
    and invalid; nodata and non-finite pixels are zero and invalid; bands of the source that the
    model does not use are neither read nor returned.
    """

    def __init__(self, cfg: SourceConfig, model_bands: list[str], files: Sequence[Path] | None = None) -> None:
        """Initialise a new ImageSource instance.

        Args:
            cfg: the source's configuration.
            model_bands: the model's input bands, in order.
            files: the source's files to use (a federated client's share), default every file
                matching the pattern.

        Raises:
            DatasetNotFoundError: if the source's folder is missing or no file matches its pattern.
            RasterReadError: with ``chip_size``, if a file's header cannot be read.
            ValueError: if the source has none of ``model_bands``.
        """
        keep = [i for i, b in enumerate(cfg.bands) if b in model_bands]
        if not keep:
            raise ValueError(f"source {cfg.name!r} has none of the model bands {model_bands}: {cfg.bands}")
        self.cfg = cfg
        self.model_bands = list(model_bands)
        self.files = list_images(cfg.root, cfg.pattern) if files is None else list(files)
        self.chips = chips_of(self.files, cfg.chip_size)
        self._keep = keep
        self._positions = torch.tensor([self.model_bands.index(cfg.bands[i]) for i in keep])
        self._mean = np.asarray(cfg.mean, dtype=np.float32)[keep, None, None]
        self._std = np.asarray(cfg.std, dtype=np.float32)[keep, None, None]
        self._in_order = self._positions.tolist() == list(range(len(self.model_bands)))

    @property
    def name(self) -> str:
        """The source's name."""
        return self.cfg.name

    def __len__(self) -> int:
        """Number of samples of the source: its files, or with ``chip_size`` their chips."""
        return len(self.chips)

    def read(self, index: int) -> tuple[np.ndarray, float | None]:
        """The raw pixels of sample ``index`` in the source's used bands, and the file's own nodata value.

        Raises:
            RasterReadError: if the file cannot be read or does not match the source's bands.
        """
        chip = self.chips[index]
        if chip.window is None:
            raster = read_raster(chip.file, len(self.cfg.bands), band_names=self.cfg.bands, bands=self._keep)
            return raster.data, raster.nodata
        with WindowReader(chip.file, len(self.cfg.bands), band_names=self.cfg.bands) as reader:
            return reader.read(*chip.window, bands=self._keep), reader.info.nodata

    def load(self, index: int) -> tuple[Tensor, Tensor]:
        """Read and normalise one sample.

        Args:
            index: position of the sample in :attr:`chips`.

        Returns:
            The image (float32) and its valid mask (bool), both (len(model_bands), H, W).

        Raises:
            RasterReadError: if the file cannot be read or does not match the source's bands.
        """
        raw, own_nodata = self.read(index)
        nodata = self.cfg.nodata if self.cfg.nodata is not None else own_nodata
        pixels, valid = normalise_pixels(raw, self.cfg.scale, self._mean, self._std, nodata)
        if self._in_order:  # the source holds every model band, in the model's order
            return torch.from_numpy(pixels), torch.from_numpy(valid)

        _, height, width = raw.shape
        image = torch.zeros(len(self.model_bands), height, width, dtype=torch.float32)
        mask = torch.zeros(len(self.model_bands), height, width, dtype=torch.bool)
        image[self._positions] = torch.from_numpy(pixels)
        mask[self._positions] = torch.from_numpy(valid)
        return image, mask
