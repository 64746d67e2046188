"""Raster input and output: GeoTIFF, PNG and JPEG through rasterio.

This is the only module of geofm that imports :mod:`rasterio`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import rasterio
from affine import Affine
from rasterio.errors import NotGeoreferencedWarning, RasterioError
from rasterio.warp import transform_bounds

from geofm.errors import RasterReadError


@dataclass(frozen=True)
class Raster:
    """The pixels of one image file.

    Attributes:
        data: array of shape (bands, height, width) in the file's dtype.
        nodata: the file's own nodata value, or None if it declares none.
        dtype: name of the file's dtype, e.g. ``"uint16"``.
    """

    data: np.ndarray
    nodata: float | None
    dtype: str

    def valid(self, nodata: float | None = None) -> np.ndarray:
        """Bool mask of ``data``'s shape: finite pixels not equal to ``nodata`` (default: the file's own)."""
        missing = nodata if nodata is not None else self.nodata
        valid = np.isfinite(self.data)
        if missing is not None:
            valid &= self.data != missing
        return valid


def _describe(exc: Exception) -> str:
    """Message of a rasterio error, with the GDAL error that caused it when there is one."""
    message = str(exc)
    if exc.__cause__ is not None:
        message = f"{message} ({exc.__cause__})"
    return message


def read_raster(path: str | Path, expected_bands: int, band_names: Sequence[str] | None = None) -> Raster:
    """Read every band of an image file.

    Args:
        path: a GeoTIFF, PNG or JPEG file (anything GDAL reads).
        expected_bands: number of bands the file must hold.
        band_names: names of the declared bands, only used to word the error.

    Returns:
        The file's pixels, nodata value and dtype.

    Raises:
        RasterReadError: if the file is missing, corrupt or truncated, holds another number of
            bands than expected, or has a dtype that is neither integer nor float.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as src:
                if src.count != expected_bands:
                    declared = f" ({', '.join(band_names)})" if band_names else ""
                    raise RasterReadError(
                        path, f"has {src.count} bands, source declares {expected_bands}{declared}"
                    )
                kinds = {np.dtype(d).kind for d in src.dtypes}
                if not kinds <= {"i", "u", "f"}:
                    raise RasterReadError(
                        path, f"has dtype {', '.join(sorted(set(src.dtypes)))}; expected an integer or float type"
                    )
                data = src.read()
                nodata = src.nodata
    except RasterioError as exc:
        raise RasterReadError(path, f"cannot read raster: {_describe(exc)}") from exc
    return Raster(data=data, nodata=None if nodata is None else float(nodata), dtype=str(data.dtype))


def write_geotiff(
    path: str | Path,
    array: np.ndarray,
    *,
    transform: Sequence[float],
    crs: str | int,
    nodata: float | None = None,
) -> None:
    """Write a (bands, height, width) array to a GeoTIFF.

    Args:
        path: output file; its parent folder is created if needed.
        array: pixels of shape (bands, height, width), written in their own dtype.
        transform: affine coefficients ``(a, b, c, d, e, f)`` mapping pixel to map coordinates,
            e.g. ``(res, 0, x_min, 0, -res, y_max)``; an :class:`affine.Affine` works too.
        crs: coordinate reference system, e.g. ``"EPSG:32632"`` or ``32632``.
        nodata: value marking pixels without data, or None.

    Raises:
        ValueError: if ``array`` is not three-dimensional.
    """
    if array.ndim != 3:
        raise ValueError(f"expected an array of shape (bands, height, width), got shape {array.shape}")
    if isinstance(crs, int):
        crs = f"EPSG:{crs}"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bands, height, width = array.shape
    with rasterio.open(
        path,
        "w",
        driver="GTiff",
        width=width,
        height=height,
        count=bands,
        dtype=array.dtype,
        crs=crs,
        transform=Affine(*transform[:6]),
        nodata=nodata,
    ) as dst:
        dst.write(array)


def read_bounds_lonlat(path: str | Path) -> tuple[float, float, float, float]:
    """A georeferenced file's footprint in EPSG:4326.

    Args:
        path: a georeferenced raster (e.g. a GeoTIFF).

    Returns:
        ``(west, south, east, north)`` in degrees of longitude and latitude, from
        :func:`rasterio.warp.transform_bounds` of the file's bounds (edges densified, so the box
        encloses the footprint). A footprint across the antimeridian has ``west > east``.

    Raises:
        RasterReadError: if the file cannot be read or has no coordinate reference system.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as src:
                if src.crs is None:
                    raise RasterReadError(path, "has no coordinate reference system; cannot locate it on the globe")
                west, south, east, north = transform_bounds(src.crs, "EPSG:4326", *src.bounds)
    except RasterioError as exc:
        raise RasterReadError(path, f"cannot read raster bounds: {_describe(exc)}") from exc
    return float(west), float(south), float(east), float(north)
