"""One imagery source: its files, band layout, nodata and normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geofm.config import SourceConfig
from geofm.data.readers import read_raster
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


class ImageSource:
    """The images of one source, loaded in the model's band order and normalised.

    A sample is an image of shape (len(model_bands), H, W) and a valid mask of the same shape.
    Bands the source lacks are zero and invalid; nodata and non-finite pixels are zero and invalid;
    bands of the source that the model does not use are dropped.
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
            ValueError: if the source has none of ``model_bands``.
        """
        keep = [i for i, b in enumerate(cfg.bands) if b in model_bands]
        if not keep:
            raise ValueError(f"source {cfg.name!r} has none of the model bands {model_bands}: {cfg.bands}")
        self.cfg = cfg
        self.model_bands = list(model_bands)
        self.files = list_images(cfg.root, cfg.pattern) if files is None else list(files)
        self._keep = keep
        self._positions = torch.tensor([self.model_bands.index(cfg.bands[i]) for i in keep])
        self._mean = np.asarray(cfg.mean, dtype=np.float32)[keep, None, None]
        self._std = np.asarray(cfg.std, dtype=np.float32)[keep, None, None]

    @property
    def name(self) -> str:
        """The source's name."""
        return self.cfg.name

    def __len__(self) -> int:
        """Number of files of the source."""
        return len(self.files)

    def load(self, index: int) -> tuple[Tensor, Tensor]:
        """Read and normalise one file.

        Args:
            index: position of the file in :attr:`files`.

        Returns:
            The image (float32) and its valid mask (bool), both (len(model_bands), H, W).

        Raises:
            RasterReadError: if the file cannot be read or does not match the source's bands.
        """
        raster = read_raster(self.files[index], len(self.cfg.bands), band_names=self.cfg.bands)
        nodata = self.cfg.nodata if self.cfg.nodata is not None else raster.nodata
        raw = raster.data[self._keep]
        valid = np.isfinite(raw)
        if nodata is not None:
            valid &= raw != nodata
        pixels = (raw.astype(np.float32) * np.float32(self.cfg.scale) - self._mean) / self._std
        pixels[~valid] = 0.0

        _, height, width = raw.shape
        image = torch.zeros(len(self.model_bands), height, width, dtype=torch.float32)
        mask = torch.zeros(len(self.model_bands), height, width, dtype=torch.bool)
        image[self._positions] = torch.from_numpy(pixels)
        mask[self._positions] = torch.from_numpy(valid)
        return image, mask
