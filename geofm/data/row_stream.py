"""A GeoTIFF written top to bottom that continues after a kill (:class:`RowStreamWriter`).

The file records what it holds (:func:`written_record`), so that a rerun with the same record
continues after the rows already written (:func:`resumable_rows`). With :mod:`geofm.data.readers` and
:mod:`geofm.data.writers`, the only module of geofm that imports :mod:`rasterio`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from rasterio.errors import RasterioError
from rasterio.io import DatasetWriter
from rasterio.windows import Window

from geofm.data.writers import BLOCK, block_options, create_tiled
from geofm.errors import OutputPathError

RECORD_TAG = "GEOFM_RECORD"  # metadata item holding a streamed file's record


def _jsonable(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` as it reads back from JSON (tuples become lists), so that records compare equal."""
    return json.loads(json.dumps(record))


def resumable_rows(path: str | Path, record: Mapping[str, Any]) -> int:
    """Rows of ``path`` that an interrupted :class:`RowStreamWriter` with an equal ``record`` left finished
    in ``NAME.partial`` (0: none, or another record's)."""
    path = Path(path)
    sidecar = path.with_name(path.name + ".partial.json")
    try:
        state = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return 0
    if state.get("record") != _jsonable(record) or not path.with_name(path.name + ".partial").is_file():
        return 0
    return int(state.get("rows_done", 0))


def written_record(path: str | Path) -> dict[str, Any] | None:
    """The record a finished :class:`RowStreamWriter` stored in ``path`` (None: none, or no such file)."""
    try:
        with rasterio.open(path) as src:
            text = src.tags().get(RECORD_TAG)
    except RasterioError:
        return None
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


class RowStreamWriter:
    """A GeoTIFF written top to bottom, one row of blocks at a time, that a killed process continues.

    Rows are handed over in order (:meth:`append`) and held until a row of blocks is complete (or
    the raster ends): then that row of blocks is written, made durable (the file is closed, which
    writes its directory, and opened again) and counted in a sidecar ``NAME.partial.json`` beside
    ``NAME.partial``, with ``record``, a JSON description of what is being written. Memory holds
    one row of blocks, and a write that is killed loses at most one. A writer opened on the same
    path with an equal ``record`` continues after the rows the sidecar counts (:attr:`rows_done`;
    :func:`resumable_rows` says how many before opening); with another record, or ``resume``
    False, it starts afresh. :meth:`close` moves the finished file to its path with ``record`` in
    its metadata (:func:`written_record`). Use it as a context manager: leaving on an exception
    closes the partial file and keeps it and its sidecar for the next writer.
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
        record: Mapping[str, Any],
        nodata: float | None = None,
        descriptions: Sequence[str] | None = None,
        resume: bool = True,
    ) -> None:
        """Create the partial file, or open the one an interrupted writer left.

        Args:
            path: output file; its parent folder is created if needed.
            width: columns.
            height: rows.
            count: bands.
            dtype: pixel type.
            crs: coordinate reference system, or None.
            transform: affine coefficients ``(a, b, c, d, e, f)``.
            record: what is written (inputs, model, settings), JSON-serialisable.
            nodata: value marking pixels without data, or None.
            descriptions: a name per band, or None.
            resume: continue an interrupted write of the same record.

        Raises:
            OutputPathError: if the partial file of the same record cannot be continued (it holds another
                raster, or is damaged).
        """
        path = Path(path)
        self.path, self.partial = path, path.with_name(path.name + ".partial")
        self.sidecar = path.with_name(path.name + ".partial.json")
        self.shape, self.dtype, self.record = (count, height, width), np.dtype(dtype), _jsonable(record)
        options = block_options(width, height)
        self.block_rows = BLOCK if options["tiled"] else height
        self.rows_done = resumable_rows(path, record) if resume else 0
        self._pending = np.empty((count, self.block_rows, width), dtype=self.dtype)
        self._held = 0
        if self.rows_done:
            self._dst = self._reopen()
            return
        self.sidecar.unlink(missing_ok=True)
        self._dst = create_tiled(self.partial, self.shape, self.dtype, crs, transform, nodata, descriptions, path)

    def _reopen(self) -> DatasetWriter:
        """The partial file opened for update, after checking that it holds this raster."""
        try:
            dst = rasterio.open(self.partial, "r+")
        except (RasterioError, TypeError) as exc:  # TypeError: not a raster GDAL can update
            raise OutputPathError(
                f"{self.partial} cannot be continued ({exc}); delete it and {self.sidecar.name}, or overwrite"
            ) from exc
        if (dst.count, dst.height, dst.width) != self.shape or np.dtype(dst.dtypes[0]) != self.dtype:
            dst.close()
            raise OutputPathError(
                f"{self.partial} holds a {dst.count}x{dst.height}x{dst.width} {dst.dtypes[0]} raster, not the "
                f"{'x'.join(map(str, self.shape))} {self.dtype} one being written; delete it, or overwrite"
            )
        return dst

    def append(self, rows: np.ndarray, row_off: int) -> None:
        """Hand over the (bands, rows, columns) rows from ``row_off`` on, the next ones in order; rows a
        previous writer finished are skipped.

        Raises:
            ValueError: if the rows are not the next ones, or have another shape than the raster's.
        """
        count, height, width = self.shape
        if rows.ndim != 3 or rows.shape[0] != count or rows.shape[2] != width:
            raise ValueError(f"{self.path}: expected rows of shape ({count}, n, {width}), got {rows.shape}")
        skip = max(self.rows_done - row_off, 0)
        rows, row_off = rows[:, skip:], row_off + skip
        if row_off != self.rows_done + self._held or row_off + rows.shape[1] > height:
            raise ValueError(
                f"{self.path}: rows {row_off}:{row_off + rows.shape[1]} handed over; the next are "
                f"{self.rows_done + self._held}:, of {height}"
            )
        while rows.shape[1]:
            take = min(rows.shape[1], self.block_rows - self._held)
            self._pending[:, self._held : self._held + take] = rows[:, :take]
            self._held += take
            rows = rows[:, take:]
            if self._held == min(self.block_rows, height - self.rows_done):
                self._flush()

    def _flush(self) -> None:
        """Write the held rows, make them durable and count them in the sidecar."""
        window = Window(0, self.rows_done, self.shape[2], self._held)
        self._dst.write(self._pending[:, : self._held], window=window)
        self._dst.close()
        self.rows_done += self._held
        self._held = 0
        state = json.dumps({"record": self.record, "rows_done": self.rows_done})
        temporary = self.sidecar.with_name(self.sidecar.name + ".tmp")
        temporary.write_text(state)
        os.replace(temporary, self.sidecar)
        self._dst = rasterio.open(self.partial, "r+")

    def close(self) -> None:
        """Finish the file: record ``record`` in it and move it to its path.

        Raises:
            ValueError: if rows are missing.
        """
        if self.rows_done != self.shape[1]:
            self._dst.close()
            raise ValueError(f"{self.path}: closed after {self.rows_done} of {self.shape[1]} rows")
        self._dst.update_tags(**{RECORD_TAG: json.dumps(self.record)})
        self._dst.close()
        os.replace(self.partial, self.path)
        self.sidecar.unlink(missing_ok=True)

    def __enter__(self) -> RowStreamWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._dst.close()
