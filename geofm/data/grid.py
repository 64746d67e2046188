"""Tiling a scene into a grid of windows."""

from __future__ import annotations


def grid_origins(length: int, size: int) -> list[int]:
    """Offsets of ``size``-long tiles covering ``length`` pixels: every ``size`` pixels, the last one
    flush with the far edge (so it overlaps its neighbour); ``[0]`` when the scene is not longer than a tile."""
    if length <= size:
        return [0]
    origins = list(range(0, length - size, size))
    return [*origins, length - size]
