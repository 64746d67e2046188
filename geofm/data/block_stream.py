"""A GeoTIFF written block by block in a fixed order that continues after a kill (:class:`BlockStreamWriter`),
finished as a Cloud-Optimized GeoTIFF.

The raster is written in strips of columns, left to right, each top to bottom, so that memory holds
one block whatever the raster's size. The file records what it holds (:func:`written_record`), so
that a rerun with the same record continues after the blocks already written
(:func:`resumable_blocks`); :func:`claim` holds the path for one writer at a time and keeps it from
replacing its inputs or a file that no writer here finished. With :mod:`geofm.data.readers` and :mod:`geofm.data.writers`, the only
module of geofm that imports :mod:`rasterio`.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import rasterio
from rasterio.errors import RasterioError
from rasterio.io import DatasetWriter
from rasterio.windows import Window

from geofm.data.writers import BLOCK, block_options, check_overview_resampling, create_tiled, write_cog
from geofm.errors import OutputPathError

RECORD_TAG = "GEOFM_RECORD"  # metadata item holding a streamed file's record


def _jsonable(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` as it reads back from JSON (tuples become lists), so that records compare equal."""
    return json.loads(json.dumps(record))


def strip_columns(width: int, height: int, strip: int) -> int:
    """Columns of the strips a :class:`BlockStreamWriter` of this size writes when asked for ``strip``: all of
    them when the raster is narrower or not tiled (under one block on a side), else ``strip``.

    Raises:
        ValueError: if ``strip`` is needed and is not a positive multiple of ``BLOCK``.
    """
    if strip >= width or not block_options(width, height)["tiled"]:
        return width
    if strip <= 0 or strip % BLOCK:
        raise ValueError(f"strips of {strip} columns: expected a positive multiple of {BLOCK}")
    return strip


def strip_rows_done(blocks_done: int, strip_index: int, width: int, height: int) -> int:
    """Rows of strip ``strip_index`` that the first ``blocks_done`` blocks of a :class:`BlockStreamWriter` of
    this size hold."""
    block_rows = BLOCK if block_options(width, height)["tiled"] else height
    per_strip = -(-height // block_rows)
    return min(max(blocks_done - strip_index * per_strip, 0) * block_rows, height)


def resumable_blocks(path: str | Path, record: Mapping[str, Any], strip: int) -> int:
    """Blocks of ``path`` that an interrupted :class:`BlockStreamWriter` with an equal ``record`` and
    ``strip`` left finished in ``NAME.partial`` (0: none, or another record's)."""
    path = Path(path)
    sidecar = path.with_name(path.name + ".partial.json")
    try:
        state = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return 0
    same = state.get("record") == _jsonable(record) and state.get("strip") == strip
    if not same or not path.with_name(path.name + ".partial").is_file():
        return 0
    return int(state.get("blocks_done", 0))


def discard_partial(path: str | Path, record: Mapping[str, Any]) -> None:
    """Delete ``NAME.partial`` and its sidecar if they hold ``record``: what a writer killed after its
    finished file took ``path``, and before it removed them, left behind."""
    path = Path(path)
    sidecar = path.with_name(path.name + ".partial.json")
    try:
        same = json.loads(sidecar.read_text()).get("record") == _jsonable(record)
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is no object
        return
    if same:
        sidecar.unlink(missing_ok=True)
        path.with_name(path.name + ".partial").unlink(missing_ok=True)


def written_record(path: str | Path) -> dict[str, Any] | None:
    """The record a finished :class:`BlockStreamWriter` stored in ``path`` (None: none, or no such file)."""
    try:
        with rasterio.open(path) as src:
            text = src.tags().get(RECORD_TAG)
    except RasterioError:
        return None
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


@contextmanager
def claim(path: str | Path, inputs: Sequence[str | Path], overwrite: bool) -> Iterator[None]:
    """Hold ``path`` for one writer inside the block, after checking that it may be written.

    The claim is an exclusive lock (``flock``) on ``NAME.lock`` beside ``path``, which records the
    holder's pid and host; it is released when the block ends or its process dies, and the file is
    deleted when the block ends.

    Args:
        path: the output file.
        inputs: files read to write it, never replaced (the same file, a hard link or a symlink).
        overwrite: whether an existing file that holds no :func:`written_record` may be replaced.

    Raises:
        OutputPathError: if another process holds ``path``, if it is one of ``inputs``, or if it is a
            file that no writer here finished, and not ``overwrite``.
    """
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputPathError(
                f"{path} is being written by {holder} (lock {lock.name}); wait for it to finish, or stop it"
            ) from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the file was released and deleted while this process waited for it: lock the next one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
        _check_replaceable(path, inputs, overwrite)
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _check_replaceable(path: Path, inputs: Sequence[str | Path], overwrite: bool) -> None:
    """Refuse to replace an input, or (unless ``overwrite``) a file that holds no :func:`written_record`."""
    if not path.exists():
        return
    for source in inputs:
        if Path(source).exists() and os.path.samefile(path, source):
            raise OutputPathError(f"{path} is the input {source}; write the output to another path")
    if not overwrite and written_record(path) is None:
        raise OutputPathError(
            f"{path} exists and was not written by geofm (no {RECORD_TAG} in its metadata); choose another "
            "path, or overwrite (--overwrite) to replace it"
        )


class BlockStreamWriter:
    """A GeoTIFF written in strips of columns, each top to bottom, that a killed process continues.

    Rows of a strip are handed over in order (:meth:`append`), strip after strip, and held until a
    block (``BLOCK`` rows of the strip) is complete, or the strip ends: then that block is written,
    made durable (the file is closed, which writes its directory, and opened again) and counted in
    a sidecar ``NAME.partial.json`` beside ``NAME.partial``, with ``record``, a JSON description of
    what is being written. Memory holds one block, and a write that is killed loses at most one. A
    writer opened on the same path with an equal ``record`` and strip width continues after the
    blocks the sidecar counts (:meth:`rows_done` says how many rows of a strip are on disk;
    :func:`resumable_blocks` how many blocks before opening); with another record, or ``resume``
    False, it starts afresh. :meth:`close` records ``record`` in the finished partial file's metadata
    (:func:`written_record`) and copies it to its path as a Cloud-Optimized GeoTIFF
    (:func:`~geofm.data.writers.write_cog`, overviews made with ``overview_resampling``); the partial
    file and its sidecar stay until the copy has its path, so a writer killed while copying is
    continued (every block on disk) and copies again. Use it as a context manager: leaving on an
    exception closes the partial file and keeps it and its sidecar for the next writer.
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
        strip: int | None = None,
        resume: bool = True,
        overview_resampling: str = "nearest",
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
            strip: columns of a strip, a multiple of ``BLOCK`` (default: the whole width);
                :func:`strip_columns` says what is used.
            resume: continue an interrupted write of the same record.
            overview_resampling: how the finished file's overviews are made: ``nearest`` or ``mode`` for
                class ids, ``average`` for measurements (:data:`~geofm.data.writers.OVERVIEW_RESAMPLINGS`).

        Raises:
            OutputPathError: if the partial file of the same record cannot be continued (it holds another
                raster, or is damaged).
            ValueError: if ``strip`` is no multiple of ``BLOCK``, or ``overview_resampling`` no resampling
                of overviews.
        """
        path = Path(path)
        check_overview_resampling(overview_resampling, path)
        self.overview_resampling = overview_resampling
        self.path, self.partial = path, path.with_name(path.name + ".partial")
        self.sidecar = path.with_name(path.name + ".partial.json")
        self.shape, self.dtype, self.record = (count, height, width), np.dtype(dtype), _jsonable(record)
        self.strip = strip_columns(width, height, width if strip is None else strip)
        self.block_rows = BLOCK if block_options(width, height)["tiled"] else height
        self.blocks_done = resumable_blocks(path, record, self.strip) if resume else 0
        self._pending = np.empty((count, self.block_rows, self.strip), dtype=self.dtype)
        self._held = 0
        if self.blocks_done:
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

    def rows_done(self, col_off: int = 0) -> int:
        """Rows of the strip starting at column ``col_off`` that are on disk."""
        _, height, width = self.shape
        return strip_rows_done(self.blocks_done, col_off // self.strip, width, height)

    def append(self, rows: np.ndarray, row_off: int, col_off: int = 0) -> None:
        """Hand over the (bands, rows, columns) rows from ``row_off`` on of the strip starting at column
        ``col_off``, the next ones in order; rows a previous writer finished are skipped.

        Raises:
            ValueError: if the rows are not the next ones, or have another shape than the strip's.
        """
        count, height, width = self.shape
        columns = min(self.strip, width - col_off)
        if col_off % self.strip or rows.ndim != 3 or rows.shape[0] != count or rows.shape[2] != columns:
            raise ValueError(
                f"{self.path}: expected rows of shape ({count}, n, {columns}) at a strip's first column, a multiple "
                f"of {self.strip}; got {rows.shape} at column {col_off}"
            )
        done = self.rows_done(col_off)
        skip = max(done - row_off, 0)
        rows, row_off = rows[:, skip:], row_off + skip
        current = self.blocks_done // -(-height // self.block_rows)  # the strip being written
        if row_off != done + self._held or row_off + rows.shape[1] > height or col_off // self.strip > current:
            raise ValueError(
                f"{self.path}: rows {row_off}:{row_off + rows.shape[1]} of the strip at column {col_off} handed "
                f"over; the next are rows {self.rows_done(current * self.strip) + self._held}: of {height} of the "
                f"strip at column {current * self.strip}"
            )
        while rows.shape[1]:
            take = min(rows.shape[1], self.block_rows - self._held)
            self._pending[:, self._held : self._held + take, :columns] = rows[:, :take]
            self._held += take
            rows = rows[:, take:]
            if self._held == min(self.block_rows, height - done):
                self._flush(done, col_off, columns)
                done += self._held
                self._held = 0

    def _flush(self, row_off: int, col_off: int, columns: int) -> None:
        """Write the held block, make it durable and count it in the sidecar."""
        window = Window(col_off, row_off, columns, self._held)
        self._dst.write(self._pending[:, : self._held, :columns], window=window)
        self._dst.close()
        self.blocks_done += 1
        state = json.dumps({"record": self.record, "strip": self.strip, "blocks_done": self.blocks_done})
        temporary = self.sidecar.with_name(self.sidecar.name + ".tmp")
        temporary.write_text(state)
        os.replace(temporary, self.sidecar)
        self._dst = rasterio.open(self.partial, "r+")

    def close(self) -> None:
        """Finish the file: record ``record`` in it and copy it to its path as a Cloud-Optimized GeoTIFF.

        Raises:
            ValueError: if blocks are missing.
        """
        _, height, width = self.shape
        if self.rows_done(width - 1) != height:
            self._dst.close()
            raise ValueError(f"{self.path}: closed after {self.blocks_done} blocks, before the last")
        self._dst.update_tags(**{RECORD_TAG: json.dumps(self.record)})
        self._dst.close()
        write_cog(self.partial, self.path, self.overview_resampling)
        self.sidecar.unlink(missing_ok=True)
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> BlockStreamWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._dst.close()
