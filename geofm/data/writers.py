"""Raster output: GeoTIFFs written whole (:func:`write_geotiff`) or window by window (:class:`GeoTiffWriter`),
lossless JPEG 2000 (:func:`write_jpeg2000`, as Sentinel-2 products hold their bands), and a GeoTIFF copied
as a Cloud-Optimized GeoTIFF (:func:`write_cog`); written block by block and continued after a kill,
:mod:`geofm.data.block_stream`.

With :mod:`geofm.data.readers` and :mod:`geofm.data.block_stream`, the only modules of geofm that import
:mod:`rasterio`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import rasterio
import rasterio.shutil
from affine import Affine
from rasterio.io import DatasetWriter
from rasterio.windows import Window

BLOCK = 256  # side of the blocks of the GeoTIFFs written here
# GDAL's overview resamplings that suit a raster's pixels: class ids (nearest, mode) or measurements (the rest)
OVERVIEW_RESAMPLINGS = ("nearest", "mode", "average", "rms", "bilinear", "cubic", "cubicspline", "lanczos", "gauss")


def _create(
    path: str | Path,
    shape: tuple[int, int, int],
    dtype: str | np.dtype,
    crs: str | None,
    transform: Sequence[float],
    nodata: float | None,
    driver: str = "GTiff",
    **options: object,
) -> DatasetWriter:
    """Open a new raster of ``shape`` (bands, height, width) for writing, creating its folder.

    ``options`` are GDAL creation options (compression, tiling...).
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    count, height, width = shape
    return rasterio.open(
        path,
        "w",
        driver=driver,
        width=width,
        height=height,
        count=count,
        dtype=dtype,
        crs=crs,
        transform=Affine(*transform[:6]),
        nodata=nodata,
        **options,
    )


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
    _write(path, array, transform, crs, nodata, "GTiff")


def write_jpeg2000(
    path: str | Path,
    array: np.ndarray,
    *,
    transform: Sequence[float],
    crs: str | int,
    nodata: float | None = None,
) -> None:
    """Write a (bands, height, width) array to a lossless JPEG 2000 file; arguments as :func:`write_geotiff`.

    Raises:
        ValueError: if ``array`` is not three-dimensional.
    """
    _write(path, array, transform, crs, nodata, "JP2OpenJPEG", QUALITY=100, REVERSIBLE="YES")


def _write(
    path: str | Path,
    array: np.ndarray,
    transform: Sequence[float],
    crs: str | int,
    nodata: float | None,
    driver: str,
    **options: object,
) -> None:
    if array.ndim != 3:
        raise ValueError(f"expected an array of shape (bands, height, width), got shape {array.shape}")
    if isinstance(crs, int):
        crs = f"EPSG:{crs}"
    with _create(path, array.shape, array.dtype, crs, transform, nodata, driver, **options) as dst:
        dst.write(array)


def block_options(width: int, height: int) -> dict[str, object]:
    """Creation options of a deflate-compressed GeoTIFF in BLOCK x BLOCK tiles (strips when smaller than a
    block), a BigTIFF when it needs to be."""
    blocked = width >= BLOCK and height >= BLOCK
    return {
        "compress": "deflate",
        "tiled": blocked,
        **({"blockxsize": BLOCK, "blockysize": BLOCK} if blocked else {}),
        "BIGTIFF": "IF_SAFER",
    }


def check_overview_resampling(resampling: str, named: str | Path) -> None:
    """Check that ``resampling`` is one of :data:`OVERVIEW_RESAMPLINGS` (``named``: the output the error names).

    Raises:
        ValueError: if it is not.
    """
    if resampling not in OVERVIEW_RESAMPLINGS:
        raise ValueError(
            f"{named}: overview resampling {resampling!r}: expected one of {', '.join(OVERVIEW_RESAMPLINGS)}"
        )


def write_cog(source: str | Path, path: str | Path, resampling: str) -> None:
    """Copy the raster ``source`` to ``path`` as a Cloud-Optimized GeoTIFF, with GDAL's COG driver.

    The copy has ``BLOCK`` x ``BLOCK`` tiles, DEFLATE compression with the predictor that suits its dtype
    (horizontal differencing for integers, floating point for floats), overviews halving the size
    until one fits in a tile, made with ``resampling``, and the COG layout (the ghost header, then the
    directories and overviews before the full-resolution tiles); it keeps the georeferencing, nodata,
    band descriptions and metadata of ``source``. GDAL streams the copy through its block cache, so
    memory does not hold the raster. It is written as ``NAME.cog.tmp`` beside ``path`` and renamed
    when whole: ``path`` is never half-written, and what an interrupted copy left is removed by the next.

    Raises:
        ValueError: if ``resampling`` is not one of :data:`OVERVIEW_RESAMPLINGS`.
    """
    path = Path(path)
    check_overview_resampling(resampling, path)
    temporary = path.with_name(path.name + ".cog.tmp")
    _remove_cog_leftovers(temporary)
    try:
        rasterio.shutil.copy(
            source,
            temporary,
            driver="COG",
            blocksize=BLOCK,
            compress="DEFLATE",
            predictor="YES",
            overview_resampling=resampling,
            bigtiff="IF_SAFER",
        )
        os.replace(temporary, path)
    finally:
        _remove_cog_leftovers(temporary)


def _remove_cog_leftovers(temporary: Path) -> None:
    """Delete ``temporary`` and the files GDAL's COG driver writes beside it (its overviews, ``NAME.ovr.tmp``)."""
    for leftover in glob.glob(glob.escape(str(temporary)) + "*"):
        Path(leftover).unlink(missing_ok=True)


def create_tiled(
    path: Path,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    crs: str | None,
    transform: Sequence[float],
    nodata: float | None,
    descriptions: Sequence[str] | None,
    named: Path,
) -> DatasetWriter:
    """A new tiled GeoTIFF of ``shape`` at ``path`` with a name per band (``named``: the output the
    error names).

    Raises:
        ValueError: if ``descriptions`` does not name every band.
    """
    count, height, width = shape
    if descriptions is not None and len(descriptions) != count:
        raise ValueError(f"{named}: {len(descriptions)} band descriptions for {count} bands")
    dst = _create(path, shape, dtype, crs, transform, nodata, **block_options(width, height))
    if descriptions is not None:
        dst.descriptions = tuple(descriptions)
    return dst


class GeoTiffWriter:
    """A GeoTIFF written window by window, so that a scene never has to be held whole in memory.

    The file is tiled (``BLOCK`` x ``BLOCK`` blocks), deflate-compressed and becomes a BigTIFF when it needs
    to. It is written as ``NAME.partial`` beside its path and takes the path only when closed, so
    a write that fails or is interrupted leaves no half-written file and never replaces an earlier
    one. Use it as a context manager: leaving on an exception discards the partial file.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        width: int,
        height: int,
        count: int,
        dtype: str | np.dtype,
        crs: str | None,
        transform: Sequence[float],
        nodata: float | None = None,
        descriptions: Sequence[str] | None = None,
    ) -> None:
        """Create the file.

        Args:
            path: output file; its parent folder is created if needed.
            width: columns.
            height: rows.
            count: bands.
            dtype: pixel type, e.g. ``"uint8"``.
            crs: coordinate reference system, or None.
            transform: affine coefficients ``(a, b, c, d, e, f)``.
            nodata: value marking pixels without data, or None.
            descriptions: a name per band (GDAL band descriptions, e.g. ``red``), or None.

        Raises:
            ValueError: if ``descriptions`` does not name every band.
        """
        path = Path(path)
        self.path, self.partial = path, path.with_name(path.name + ".partial")
        self.shape = (count, height, width)
        self.dtype = np.dtype(dtype)
        self._dst = create_tiled(self.partial, self.shape, self.dtype, crs, transform, nodata, descriptions, path)

    def write(self, array: np.ndarray, row_off: int, col_off: int = 0) -> None:
        """Write a (bands, rows, columns) block with its top-left pixel at ``(row_off, col_off)``.

        Raises:
            ValueError: if the block has other bands than the file or leaves it.
        """
        count, height, width = self.shape
        if array.ndim != 3 or array.shape[0] != count:
            raise ValueError(
                f"{self.path}: expected a block of {count} bands (bands, rows, columns), got shape {array.shape}"
            )
        if row_off < 0 or col_off < 0 or row_off + array.shape[1] > height or col_off + array.shape[2] > width:
            raise ValueError(
                f"{self.path}: a {array.shape[1]}x{array.shape[2]} block at ({row_off}, {col_off}) "
                f"leaves the {height}x{width} raster"
            )
        window = Window(col_off, row_off, array.shape[2], array.shape[1])
        self._dst.write(array.astype(self.dtype, copy=False), window=window)

    def close(self) -> None:
        """Finish the file and move it to its path."""
        self._dst.close()
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        """Close and delete the partial file; the path keeps what it held before."""
        self._dst.close()
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> GeoTiffWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()
