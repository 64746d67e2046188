"""Tiling a scene into windows: a covering grid of equal windows, or a partition into blocks."""

from __future__ import annotations

from typing import NamedTuple


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
