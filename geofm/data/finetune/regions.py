"""Where the samples of a split lie in its scenes: every scene whole, a spatial split's regions, chips.

With ``data.split`` the train, val and test splits are disjoint regions of the same scenes: blocks
dealt to the splits in an order drawn from a seed, or stripes of rows or columns. With
``data.chip_size`` each scene or region is cut into a grid of chips inside it (the pretraining
sources' chips, :func:`geofm.data.grid.grid_windows`), so no sample of a split reaches into another's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from geofm.data.finetune.source import SceneSource
from geofm.data.grid import Window, block_windows, grid_windows
from geofm.errors import DatasetTooSmallError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, RegionSplitConfig, Split

SPLITS: tuple[Split, ...] = ("train", "val", "test")


class Region(NamedTuple):
    """A part of a scene the samples of a split are drawn from: a window of it, or (None) all of it."""

    scene: int
    window: Window | None = None


def _apportion(count: int, fractions: Sequence[float]) -> list[int]:
    """``count`` items shared by ``fractions`` in whole numbers summing to ``count`` (largest remainders)."""
    exact = [f * count for f in fractions]
    shares = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[: count - sum(shares)]:
        shares[i] += 1
    return shares


def _stripes(length: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Start and length of each split's stripe of ``length`` rows (or columns), in order."""
    bounds = [0, *(int(c * length + 0.5) for c in np.cumsum(fractions)[:-1]), length]
    return [(start, end - start) for start, end in itertools.pairwise(bounds)]


def split_regions(extents: Sequence[tuple[int, int]], spec: RegionSplitConfig, split: Split) -> list[Region]:
    """The regions of ``split`` under a spatial split of scenes of these (height, width) extents.

    ``by: regions`` deals the blocks of all scenes together: ``round(fraction x blocks)`` each
    (largest remainders), in an order drawn from ``spec.seed``; stripes cut each scene alike.
    Every split's regions are computed from the same extents, so the splits are disjoint.

    Raises:
        DatasetTooSmallError: if ``split`` gets no block or no row (column), with what would give it some.
    """
    index = SPLITS.index(split)
    if spec.by == "regions":
        blocks = [Region(s, w) for s, (h, wd) in enumerate(extents) for w in block_windows(h, wd, int(spec.block or 0))]
        order = np.random.default_rng(spec.seed).permutation(len(blocks))
        shares = _apportion(len(blocks), spec.fractions)
        start = sum(shares[:index])
        regions = [blocks[i] for i in sorted(order[start : start + shares[index]])]
        what = f"none of the {len(blocks)} blocks of {spec.block} px"
        remedy = "a smaller data.split.block"
    else:
        regions = []
        for scene, (height, width) in enumerate(extents):
            along = height if spec.by == "rows" else width
            start, length = _stripes(along, spec.fractions)[index]
            if length:
                rows = (start, 0, length, width) if spec.by == "rows" else (0, start, height, length)
                regions.append(Region(scene, Window(*rows)))
        what = f"no {spec.by[:-1]} of the {len(extents)} scene(s)"
        remedy = "larger scenes"
    if not regions:
        raise DatasetTooSmallError(
            f"data.split by {spec.by} with fractions {list(spec.fractions)}: the {split} split gets {what}; "
            f"give it a larger share or use {remedy}"
        )
    return regions


def chips(regions: Sequence[Region], extents: Sequence[tuple[int, int]], chip_size: int) -> list[Region]:
    """Each region (a whole scene: of its extent) cut into a grid of ``chip_size`` windows inside it."""
    return [
        Region(scene, chip)
        for scene, window in regions
        for chip in grid_windows(window or Window(0, 0, *extents[scene]), chip_size)
    ]


def data_regions(cfg: FinetuneDataConfig, split: Split, source: SceneSource) -> list[Region]:
    """The regions of a split's scenes its samples are drawn from: every scene whole, or with
    ``data.split`` the split's regions of them; with ``data.chip_size`` each cut into chips.

    Raises:
        DatasetTooSmallError: a spatial split that gives ``split`` nothing.
        RasterReadError: with ``data.split`` or ``data.chip_size``, if a scene's size cannot be read.
    """
    if cfg.split is None and cfg.chip_size is None:
        return [Region(scene) for scene in range(len(source))]
    extents = [source.shape(scene) for scene in range(len(source))]
    regions = split_regions(extents, cfg.split, split) if cfg.split else [Region(s) for s in range(len(extents))]
    return chips(regions, extents, cfg.chip_size) if cfg.chip_size is not None else regions
