"""Pixels as they are read: one file's array and its nodata (:class:`Raster`), raw values of several
bands with their scale and offset (:class:`RawPixels`), the valid-pixel mask and normalisation.
No file I/O: :mod:`geofm.data.readers` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Raster:
    """The pixels of one image file.

    Attributes:
        data: array of shape (bands, height, width) in the file's dtype.
        nodata: the file's own nodata value, or None if it declares none.
        dtype: name of the file's dtype, e.g. ``"uint16"``.
        crs: the file's coordinate reference system (e.g. ``"EPSG:32632"``), or None if it has none.
        transform: affine coefficients ``(a, b, c, d, e, f)`` from pixel to map coordinates
            (the identity for files without georeferencing).
    """

    data: np.ndarray
    nodata: float | None
    dtype: str
    crs: str | None = None
    transform: tuple[float, ...] = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)

    def valid(self, nodata: float | None = None) -> np.ndarray:
        """Bool mask of ``data``'s shape: finite pixels not equal to ``nodata`` (default: the file's own)."""
        return valid_pixels(self.data, nodata if nodata is not None else self.nodata)


def valid_pixels(data: np.ndarray, nodata: float | np.ndarray | None) -> np.ndarray:
    """Bool mask of ``data``'s shape: finite pixels not equal to ``nodata`` (None: every finite pixel).

    ``nodata`` may be an array broadcasting over ``data`` (one value per band, NaN for none).
    """
    valid = np.isfinite(data)
    if nodata is not None:
        valid &= data != nodata
    return valid


def normalise_pixels(
    raw: np.ndarray,
    scale: float | np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    nodata: float | np.ndarray | None,
    offset: float | np.ndarray = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``(raw * scale + offset - mean) / std`` as float32, with invalid pixels (see :func:`valid_pixels`) set to 0.

    ``scale``, ``offset``, ``mean`` and ``std`` are numbers or float32 arrays broadcasting over
    ``raw`` (one value per band). Returns the pixels and their valid mask.
    """
    valid = valid_pixels(raw, nodata)
    pixels = (raw.astype(np.float32) * np.float32(scale) + np.float32(offset) - mean) / std
    pixels[~valid] = 0.0
    return pixels, valid


@dataclass(frozen=True)
class RawPixels:
    """One sample's raw pixels and how they become physical values, and which pixels are unusable.

    Attributes:
        data: array of shape (bands, height, width) in the files' dtype.
        scale: per band, factor of the raw values (physical = raw * scale + offset).
        offset: per band, added after scaling.
        nodata: per band, the value marking pixels without data (NaN: none).
        invalid: (height, width) pixels a quality band marks unusable, or None without one.
        valid: (bands, height, width) mask of the pixels known valid (a chip store's), or None.
    """

    data: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    nodata: np.ndarray
    invalid: np.ndarray | None = None
    valid: np.ndarray | None = None

    def valid_mask(self) -> np.ndarray:
        """Bool mask of ``data``'s shape: finite pixels, not nodata, not marked by the quality band, and
        valid by :attr:`valid` where that is given."""
        valid = valid_pixels(self.data, self.nodata.reshape(-1, 1, 1))
        if self.invalid is not None:
            valid &= ~self.invalid
        if self.valid is not None:
            valid &= self.valid
        return valid

    def normalised(self, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pixels normalised by per-band ``mean`` and ``std`` (float32) and their valid mask, see
        :func:`normalise_pixels`; pixels the quality band marks are invalid in every band, and so are
        those :attr:`valid` does not hold."""
        column = (-1, 1, 1)
        pixels, valid = normalise_pixels(
            self.data, self.scale.reshape(column), mean, std, self.nodata.reshape(column), self.offset.reshape(column)
        )
        if self.invalid is not None or self.valid is not None:
            valid = self.valid_mask()
            pixels[~valid] = 0.0
        return pixels, valid


__all__ = ["Raster", "RawPixels", "normalise_pixels", "valid_pixels"]
