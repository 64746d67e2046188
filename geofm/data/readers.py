"""Raster input: GeoTIFF, PNG and JPEG through rasterio.

Whole files (:func:`read_raster`), headers (:func:`raster_info`), windows of scenes of any size
(:class:`WindowReader`), the single-band files of a product read onto one grid, resampled by window
(:class:`BandFiles`; the pixels come as :mod:`geofm.data.pixels` holds them), footprints (:func:`read_bounds_lonlat`), and GDAL's block cache held to a bound
while a scene is streamed (:func:`bounded_block_cache`). With
:mod:`geofm.data.writers` (GeoTIFF output), the only module of geofm that imports :mod:`rasterio`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import rasterio
from affine import Affine
from rasterio.enums import Resampling
from rasterio.errors import NotGeoreferencedWarning, RasterioError
from rasterio.io import DatasetReader
from rasterio.vrt import WarpedVRT
from rasterio.warp import transform_bounds
from rasterio.windows import Window

from geofm.data.grid import PixelGrid, pixel_offset
from geofm.data.pixels import Raster
from geofm.errors import RasterReadError


@dataclass(frozen=True)
class RasterInfo:
    """The header of an image file: size, bands, dtype and georeferencing.

    Attributes:
        path: the file.
        width: columns.
        height: rows.
        count: bands.
        dtype: name of the dtype of its first band, e.g. ``"uint16"``.
        crs: coordinate reference system, or None if the file has none.
        transform: affine coefficients ``(a, b, c, d, e, f)`` from pixel to map coordinates.
        nodata: the file's nodata value, or None.
    """

    path: str
    width: int
    height: int
    count: int
    dtype: str
    crs: str | None
    transform: tuple[float, ...]
    nodata: float | None


def same_grid(a: RasterInfo | Raster, b: RasterInfo | Raster) -> str | None:
    """How two rasters' pixel grids differ (CRS, transform, size), or None if they are the same grid."""
    shape_a = (a.height, a.width) if isinstance(a, RasterInfo) else a.data.shape[1:]
    shape_b = (b.height, b.width) if isinstance(b, RasterInfo) else b.data.shape[1:]
    if shape_a != shape_b:
        return f"size {shape_a[0]}x{shape_a[1]} vs {shape_b[0]}x{shape_b[1]} pixels"
    if a.crs != b.crs:
        return f"CRS {a.crs} vs {b.crs}"
    if not np.allclose(a.transform, b.transform, rtol=0.0, atol=1e-9 * max(1.0, *map(abs, a.transform))):
        return f"transform {tuple(a.transform)} vs {tuple(b.transform)}"
    return None


def _describe(exc: Exception) -> str:
    """Message of a rasterio error, with the GDAL error that caused it when there is one."""
    message = str(exc).replace(" See previous exception for details.", "")
    if exc.__cause__ is not None:
        message = f"{message} ({exc.__cause__})"
    return message


_GDAL = threading.local()


def _gdal_environment() -> None:
    """Enter one rasterio (GDAL) environment per thread and keep it for the thread's life.

    Outside an environment every ``rasterio.open`` sets one up and tears it down again, which
    costs about as much as reading a small chip; a DataLoader worker opens thousands of files.
    """
    if getattr(_GDAL, "env", None) is None:
        _GDAL.env = rasterio.Env()
        _GDAL.env.__enter__()


@contextmanager
def bounded_block_cache(mib: int) -> Iterator[None]:
    """Hold GDAL's block cache to ``mib`` MiB inside the block (outside: 5% of the machine's memory), so
    that reading and writing a scene of any size by window keeps no more of it than that."""
    _gdal_environment()
    with rasterio.Env(GDAL_CACHEMAX=mib * 2**20):
        yield


def _open_dataset(path: str | Path) -> DatasetReader:
    """Open a raster for reading; rasterio errors become :class:`RasterReadError`."""
    _gdal_environment()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            return rasterio.open(path)
    except RasterioError as exc:
        raise RasterReadError(path, f"cannot read raster: {_describe(exc)}") from exc


@contextmanager
def _open(path: str | Path) -> Iterator[DatasetReader]:
    """An open raster; rasterio errors raised while it is open become :class:`RasterReadError`."""
    with _open_dataset(path) as src:
        try:
            yield src
        except RasterioError as exc:
            raise RasterReadError(path, f"cannot read raster: {_describe(exc)}") from exc


def _check_layout(
    src: DatasetReader, path: str | Path, expected_bands: int | None, band_names: Sequence[str] | None
) -> None:
    """Refuse a file with another band count than expected or a dtype that is neither integer nor float."""
    if expected_bands is not None and src.count != expected_bands:
        declared = f" ({', '.join(band_names)})" if band_names else ""
        raise RasterReadError(path, f"has {src.count} bands, source declares {expected_bands}{declared}")
    kinds = {np.dtype(d).kind for d in src.dtypes}
    if not kinds <= {"i", "u", "f"}:
        raise RasterReadError(
            path, f"has dtype {', '.join(sorted(set(src.dtypes)))}; expected an integer or float type"
        )


def _info(src: DatasetReader, path: str | Path) -> RasterInfo:
    return RasterInfo(
        path=str(path),
        width=src.width,
        height=src.height,
        count=src.count,
        dtype=str(src.dtypes[0]),
        crs=src.crs.to_string() if src.crs else None,
        transform=tuple(src.transform)[:6],
        nodata=None if src.nodata is None else float(src.nodata),
    )


def read_raster(
    path: str | Path,
    expected_bands: int,
    band_names: Sequence[str] | None = None,
    bands: Sequence[int] | None = None,
) -> Raster:
    """Read the bands of an image file.

    Args:
        path: a GeoTIFF, PNG or JPEG file (anything GDAL reads).
        expected_bands: number of bands the file must hold.
        band_names: names of the declared bands, only used to word the error.
        bands: 0-based positions of the bands to read, in that order (default all); the others
            are never read from disk.

    Returns:
        The file's pixels (the chosen bands), nodata value, dtype and georeferencing.

    Raises:
        RasterReadError: if the file is missing, corrupt or truncated, holds another number of
            bands than expected, or has a dtype that is neither integer nor float.
    """
    with _open(path) as src:
        _check_layout(src, path, expected_bands, band_names)
        data = src.read(_indexes(bands))
        info = _info(src, path)
    return Raster(data=data, nodata=info.nodata, dtype=str(data.dtype), crs=info.crs, transform=info.transform)


def _indexes(bands: Sequence[int] | None) -> list[int] | None:
    """rasterio's 1-based band indexes of 0-based positions (None: every band)."""
    return None if bands is None else [b + 1 for b in bands]


def raster_info(path: str | Path) -> RasterInfo:
    """The header of an image file, without reading its pixels.

    Raises:
        RasterReadError: if the file is missing or not a raster GDAL reads.
    """
    with _open(path) as src:
        return _info(src, path)


class WindowReader:
    """An open image file whose pixels are read one window at a time (scenes of any size).

    Use it as a context manager; :attr:`info` holds the header.
    """

    def __init__(
        self, path: str | Path, expected_bands: int | None = None, band_names: Sequence[str] | None = None
    ) -> None:
        """Open a raster for windowed reading.

        Args:
            path: the file.
            expected_bands: number of bands the file must hold, or None for any.
            band_names: names of the declared bands, only used to word the error.

        Raises:
            RasterReadError: if the file cannot be opened, holds another number of bands than
                expected or has a dtype that is neither integer nor float.
        """
        self.path = str(path)
        self._src = _open_dataset(path)
        try:
            _check_layout(self._src, path, expected_bands, band_names)
        except RasterReadError:
            self._src.close()
            raise
        self.info = _info(self._src, path)

    def read(
        self, row_off: int, col_off: int, height: int, width: int, bands: Sequence[int] | None = None
    ) -> np.ndarray:
        """Pixels of a window inside the raster, shape (bands, height, width), in the file's dtype.

        ``bands`` are 0-based positions of the bands to read, in that order (default all).

        Raises:
            RasterReadError: if the window leaves the raster or the file cannot be read.
        """
        if row_off < 0 or col_off < 0 or row_off + height > self.info.height or col_off + width > self.info.width:
            raise RasterReadError(
                self.path,
                f"window rows {row_off}:{row_off + height}, columns {col_off}:{col_off + width} "
                f"leaves the {self.info.height}x{self.info.width} raster",
            )
        try:
            return self._src.read(_indexes(bands), window=Window(col_off, row_off, width, height))
        except RasterioError as exc:
            raise RasterReadError(self.path, f"cannot read raster: {_describe(exc)}") from exc

    def close(self) -> None:
        """Close the file."""
        self._src.close()

    def __enter__(self) -> WindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BandFiles:
    """The single-band files of one product, open together, each read onto a common grid by window.

    A file whose pixels are the grid's is read as it is; any other is resampled on read
    (:class:`rasterio.vrt.WarpedVRT` over just the window): nearest for categorical bands
    (quality), bilinear where the file is coarser than the grid and average where it is finer.
    Use it as a context manager; :attr:`infos` holds the headers.
    """

    def __init__(self, paths: Sequence[str | Path]) -> None:
        """Open the files.

        Raises:
            RasterReadError: a file cannot be opened, holds more than one band or a dtype that is
                neither integer nor float.
        """
        self._sources: list[DatasetReader] = []
        try:
            for path in paths:
                src = _open_dataset(path)
                self._sources.append(src)
                if src.count != 1:
                    raise RasterReadError(path, f"has {src.count} bands; a band file of a product holds one")
                _check_layout(src, path, None, None)
        except RasterReadError:
            self.close()
            raise
        self.infos = [_info(src, path) for src, path in zip(self._sources, paths, strict=True)]

    def read(
        self,
        index: int,
        grid: PixelGrid,
        window: tuple[int, int, int, int],
        categorical: bool = False,
        nodata: float | None = None,
    ) -> np.ndarray:
        """The pixels of file ``index`` in a window ``(row, col, height, width)`` of ``grid``, in its dtype.

        ``nodata`` (default the file's own) is left out of the resampling and fills the window
        where no valid pixel contributes.

        Raises:
            RasterReadError: if the file cannot be read.
        """
        src, info = self._sources[index], self.infos[index]
        row, col, height, width = window
        nodata = info.nodata if nodata is None else nodata
        offset = pixel_offset(info.transform, grid)
        try:
            if offset is not None:
                r, c = offset[0] + row, offset[1] + col
                if r >= 0 and c >= 0 and r + height <= info.height and c + width <= info.width:
                    return src.read(1, window=Window(c, r, width, height))
            if categorical:
                method = Resampling.nearest
            else:
                method = Resampling.bilinear if info.transform[0] >= grid.transform[0] else Resampling.average
            transform = Affine(*grid.transform[:6]) @ Affine.translation(col, row)
            with WarpedVRT(
                src,
                crs=src.crs,
                transform=transform,
                width=width,
                height=height,
                resampling=method,
                **({} if nodata is None else {"src_nodata": nodata, "nodata": nodata}),
            ) as vrt:
                return vrt.read(1)
        except RasterioError as exc:
            raise RasterReadError(info.path, f"cannot read raster: {_describe(exc)}") from exc

    def close(self) -> None:
        """Close the files."""
        for src in self._sources:
            src.close()

    def __enter__(self) -> BandFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scaled_transform(transform: Sequence[float], factor: float) -> tuple[float, ...]:
    """The transform of the same area at ``factor`` times as many pixels per side (pixel size / factor)."""
    return tuple(Affine(*transform[:6]) @ Affine.scale(1.0 / factor))[:6]


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
    _gdal_environment()
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
