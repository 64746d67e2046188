"""Pixel grids: tiling a scene into windows (a covering grid of equal windows, or a partition into
blocks), and the one grid the bands of a product are read onto."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class RasterHeader(Protocol):
    """What :func:`common_grid` needs of a raster's header (a :class:`geofm.data.readers.RasterInfo`)."""

    path: str
    crs: str | None
    transform: tuple[float, ...]
    width: int
    height: int


class Window(NamedTuple):
    """A rectangle of a scene's pixels: first row and column, height and width."""

    row: int
    col: int
    height: int
    width: int


def grid_origins(length: int, size: int) -> list[int]:
    """Offsets of ``size``-long tiles covering ``length`` pixels: every ``size`` pixels, the last one
    flush with the far edge (so it overlaps its neighbour); ``[0]`` when the scene is not longer than a tile."""
    if length <= size:
        return [0]
    origins = list(range(0, length - size, size))
    return [*origins, length - size]


@dataclass(frozen=True)
class PixelGrid:
    """A north-up pixel grid: CRS, affine transform ``(a, b, c, d, e, f)`` and size."""

    crs: str | None
    transform: tuple[float, ...]
    width: int
    height: int


class GridError(ValueError):
    """The bands of a product cannot share one grid (another CRS, rotated, no common area)."""


def _snap(value: float, origin: float, step: float, up: bool) -> float:
    """``value`` moved onto the lattice ``origin + k * step`` (up or down), within a millionth of a pixel."""
    k = (value - origin) / step
    k = math.ceil(k - 1e-6) if up else math.floor(k + 1e-6)
    return origin + k * step


def common_grid(rasters: Sequence[RasterHeader], gsd: float | None = None) -> PixelGrid:
    """The grid all ``rasters`` are read onto: their common area, at ``gsd``, on the finest one's lattice.

    The grid's pixels are ``gsd`` metres (default: the finest raster's pixel size) and its lattice
    is anchored at the finest raster's corner, so that raster reads unresampled at its own
    resolution; the grid covers the area every raster covers, shrunk to whole pixels.

    Raises:
        GridError: rasters in different CRSs, rotated or flipped, or without a common area.
    """
    crss = {r.crs for r in rasters}
    if len(crss) != 1:
        raise GridError(f"bands in different CRSs {sorted(map(str, crss))}; a product's bands share one")
    for r in rasters:
        a, b, _, d, e, _ = r.transform[:6]
        if b != 0 or d != 0 or a <= 0 or e >= 0:
            raise GridError(f"{r.path} is not north-up (transform {tuple(r.transform[:6])})")
    finest = min(rasters, key=lambda r: min(r.transform[0], -r.transform[4]))
    step = gsd or min(finest.transform[0], -finest.transform[4])
    x0, y0 = finest.transform[2], finest.transform[5]
    left = _snap(max(r.transform[2] for r in rasters), x0, step, up=True)
    right = _snap(min(r.transform[2] + r.transform[0] * r.width for r in rasters), x0, step, up=False)
    top = _snap(min(r.transform[5] for r in rasters), y0, -step, up=True)
    bottom = _snap(max(r.transform[5] + r.transform[4] * r.height for r in rasters), y0, -step, up=False)
    width, height = round((right - left) / step), round((top - bottom) / step)
    if width <= 0 or height <= 0:
        raise GridError(f"the bands cover no common area of at least one {step:g} m pixel")
    return PixelGrid(next(iter(crss)), (step, 0.0, left, 0.0, -step, top), width, height)


def pixel_offset(transform: Sequence[float], grid: PixelGrid) -> tuple[int, int] | None:
    """``(row, col)`` of the grid's corner in a raster of that ``transform``, if the raster's pixels are
    the grid's (same size, whole-pixel shift), else None."""
    a, _, c, _, e, f = transform[:6]
    step = grid.transform[0]
    if abs(a - step) > 1e-9 * step or abs(e + step) > 1e-9 * step:
        return None
    col, row = (grid.transform[2] - c) / step, (f - grid.transform[5]) / step
    if abs(col - round(col)) > 1e-6 or abs(row - round(row)) > 1e-6:
        return None
    return round(row), round(col)


def grid_windows(area: Window, size: int) -> list[Window]:
    """``size`` x ``size`` windows covering ``area`` row by row (see :func:`grid_origins`), each inside it;
    a side of ``area`` shorter than ``size`` gives windows of that side."""
    height, width = min(size, area.height), min(size, area.width)
    return [
        Window(area.row + row, area.col + col, height, width)
        for row in grid_origins(area.height, height)
        for col in grid_origins(area.width, width)
    ]


def block_windows(height: int, width: int, block: int) -> list[Window]:
    """Non-overlapping ``block`` x ``block`` windows partitioning a ``height`` x ``width`` scene row by row;
    those of the last row and column are cut short by the scene's edges."""
    return [
        Window(row, col, min(block, height - row), min(block, width - col))
        for row in range(0, height, block)
        for col in range(0, width, block)
    ]
