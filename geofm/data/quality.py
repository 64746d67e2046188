"""Quality bands: which pixels a product's own quality assessment marks as unusable.

A quality band encodes per pixel whether it is fill, saturated, cloud, cloud shadow, cirrus or
snow, in a layout that depends on the product's generation:

==========================  ===================================================================
generation                  layout (bit 0 is the least significant)
==========================  ===================================================================
``landsat_pre_collection``  Landsat 8 BQA before Collection 1: 0 fill, 1 dropped frame,
                            2 terrain occlusion, 4-5 water, 10-11 snow/ice, 12-13 cirrus,
                            14-15 cloud confidence
``landsat_c1``              Collection 1 BQA: 0 fill, 1 terrain occlusion, 2-3 radiometric
                            saturation (number of bands), 4 cloud, 5-6 cloud, 7-8 cloud shadow,
                            9-10 snow/ice, 11-12 cirrus confidence
``landsat_c2``              Collection 2 QA_PIXEL: 0 fill, 1 dilated cloud, 2 cirrus, 3 cloud,
                            4 cloud shadow, 5 snow, 6 clear, 7 water, 8-9 cloud, 10-11 cloud
                            shadow, 12-13 snow/ice, 14-15 cirrus confidence; saturation is in
                            QA_RADSAT (bit n-1: band n saturated, bit 11 terrain occlusion)
``sentinel2_scl``           Sentinel-2 L2A scene classification: 0 no data, 1 saturated or
                            defective, 3 cloud shadow, 8 cloud medium, 9 cloud high probability,
                            10 thin cirrus, 11 snow
==========================  ===================================================================

A two-bit confidence is 0 not determined, 1 low, 2 medium, 3 high (before Collection 1: "no",
"maybe", "yes" for 1-3); a class counts from the configured confidence up. Dropped frames and
terrain occlusion count as fill; Collection 2's dilated cloud counts as cloud. The generation
comes from a product's metadata, or from the config where a product has none.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

QUALITY_CLASSES = ("fill", "saturation", "cloud", "cloud_shadow", "cirrus", "snow")
GENERATIONS = ("landsat_pre_collection", "landsat_c1", "landsat_c2", "sentinel2_scl")
CONFIDENCE_LEVELS = {"low": 1, "medium": 2, "high": 3}

RECORDED_CLASSES: dict[str, tuple[str, ...]] = {
    "landsat_pre_collection": ("fill", "cloud", "cirrus", "snow"),
    "landsat_c1": QUALITY_CLASSES,
    "landsat_c2": QUALITY_CLASSES,
    "sentinel2_scl": QUALITY_CLASSES,
}
"""The classes each generation records; before Collection 1 there is no cloud shadow nor saturation."""

RADSAT_BANDS = 0x7FF
"""QA_RADSAT bits 0-10: saturation of Landsat 8/9 bands 1-11."""
RADSAT_TERRAIN_OCCLUSION = 1 << 11


def _bit(qa: np.ndarray, bit: int) -> np.ndarray:
    return (qa >> bit) & 1 == 1


def _confident(qa: np.ndarray, bit: int, level: int) -> np.ndarray:
    """Whether the two-bit confidence starting at ``bit`` is at least ``level``."""
    return (qa >> bit) & 3 >= level


def _landsat_pre_collection(qa: np.ndarray, level: int) -> dict[str, np.ndarray]:
    return {
        "fill": _bit(qa, 0) | _bit(qa, 1) | _bit(qa, 2),
        "snow": _confident(qa, 10, level),
        "cirrus": _confident(qa, 12, level),
        "cloud": _confident(qa, 14, level),
    }


def _landsat_c1(qa: np.ndarray, level: int) -> dict[str, np.ndarray]:
    return {
        "fill": _bit(qa, 0) | _bit(qa, 1),
        "saturation": (qa >> 2) & 3 > 0,
        "cloud": _bit(qa, 4) | _confident(qa, 5, level),
        "cloud_shadow": _confident(qa, 7, level),
        "snow": _confident(qa, 9, level),
        "cirrus": _confident(qa, 11, level),
    }


def _landsat_c2(qa: np.ndarray, level: int) -> dict[str, np.ndarray]:
    return {
        "fill": _bit(qa, 0),
        "cloud": _bit(qa, 1) | _bit(qa, 3) | _confident(qa, 8, level),
        "cloud_shadow": _bit(qa, 4) | _confident(qa, 10, level),
        "snow": _bit(qa, 5) | _confident(qa, 12, level),
        "cirrus": _bit(qa, 2) | _confident(qa, 14, level),
    }


def _sentinel2_scl(scl: np.ndarray, level: int) -> dict[str, np.ndarray]:
    cloud = (9,) if level == CONFIDENCE_LEVELS["high"] else (8, 9)
    return {
        "fill": scl == 0,
        "saturation": scl == 1,
        "cloud_shadow": scl == 3,
        "cloud": np.isin(scl, cloud),
        "cirrus": scl == 10,
        "snow": scl == 11,
    }


_DECODERS = {
    "landsat_pre_collection": _landsat_pre_collection,
    "landsat_c1": _landsat_c1,
    "landsat_c2": _landsat_c2,
    "sentinel2_scl": _sentinel2_scl,
}


def decode_quality(qa: np.ndarray, generation: str, confidence: str = "medium") -> dict[str, np.ndarray]:
    """Each class a generation's quality band records, as a bool mask of ``qa``'s shape.

    Args:
        qa: the quality band's values (any integer dtype).
        generation: one of :data:`GENERATIONS`.
        confidence: the lowest confidence at which a confidence-coded class counts (``low``,
            ``medium`` or ``high``); for Sentinel-2 it separates medium from high cloud probability.

    Raises:
        ValueError: an unknown generation or confidence.
    """
    if generation not in _DECODERS:
        raise ValueError(f"unknown quality generation {generation!r}; known: {', '.join(GENERATIONS)}")
    if confidence not in CONFIDENCE_LEVELS:
        raise ValueError(f"unknown confidence {confidence!r}; known: {', '.join(CONFIDENCE_LEVELS)}")
    return _DECODERS[generation](qa.astype(np.int64, copy=False), CONFIDENCE_LEVELS[confidence])


def invalid_pixels(
    qa: np.ndarray,
    generation: str,
    classes: Collection[str],
    confidence: str = "medium",
    radsat: np.ndarray | None = None,
) -> np.ndarray:
    """Bool mask of the pixels a quality band puts in any of ``classes``.

    Args:
        qa: the quality band.
        generation: its layout, one of :data:`GENERATIONS`.
        classes: the classes that make a pixel invalid (of :data:`QUALITY_CLASSES`); those the
            generation does not record are refused.
        confidence: see :func:`decode_quality`.
        radsat: Collection 2's QA_RADSAT of the same pixels; needed for ``saturation`` there
            (any band saturated), and its terrain occlusion bit then counts as ``fill``.

    Raises:
        ValueError: a class the generation does not record, or Collection 2 saturation without ``radsat``.
    """
    unrecorded = sorted(set(classes) - set(RECORDED_CLASSES.get(generation, QUALITY_CLASSES)))
    if unrecorded:
        raise ValueError(f"{generation} quality bands do not record {', '.join(unrecorded)}")
    decoded = decode_quality(qa, generation, confidence)
    if generation == "landsat_c2" and radsat is not None:
        radsat = radsat.astype(np.int64, copy=False)
        decoded["saturation"] = radsat & RADSAT_BANDS != 0
        decoded["fill"] = decoded["fill"] | (radsat & RADSAT_TERRAIN_OCCLUSION != 0)
    if "saturation" in classes and "saturation" not in decoded:
        raise ValueError("Collection 2 saturation is read from QA_RADSAT, which was not given")
    invalid = np.zeros(qa.shape, dtype=bool)
    for name in classes:
        invalid |= decoded[name]
    return invalid
