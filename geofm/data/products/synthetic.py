"""Per-band products written in their real on-disk layouts from given pixels, for tests and benchmarks.

Sentinel-2 SAFE folders (lossless JPEG 2000 bands and an MTD XML with the fields
:mod:`.sentinel2` reads), Landsat 8 scene folders (tiled GeoTIFF bands and an MTL as text or
JSON with the groups :mod:`.landsat` reads) and STAC items (GeoTIFF assets beside the JSON).
Every band lies on a north-up grid in EPSG:32632 whose top-left corner is :data:`ORIGIN`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from geofm.data.products.sentinel2 import BAND_IDS
from geofm.data.writers import GeoTiffWriter, write_jpeg2000

CRS = "EPSG:32632"
ORIGIN = (500_000.0, 5_000_000.0)
TILE = "T32TQM"
SENSING = "20240101T101010"


def write_band(path: Path, array: np.ndarray, res: float, nodata: float | None = None) -> Path:
    """A single-band file of ``array`` (height, width) with ``res`` m pixels: JPEG 2000 for ``.jp2``,
    else a tiled, deflate-compressed GeoTIFF."""
    transform = (res, 0.0, ORIGIN[0], 0.0, -res, ORIGIN[1])
    if path.suffix == ".jp2":
        write_jpeg2000(path, array[None], transform=transform, crs=CRS, nodata=nodata)
        return path
    height, width = array.shape
    with GeoTiffWriter(
        path, width=width, height=height, count=1, dtype=array.dtype, crs=CRS, transform=transform, nodata=nodata
    ) as writer:
        writer.write(array[None], 0)
    return path


def _mtd(level: str, baseline: str, offsets: bool) -> str:
    """An MTD_MSIL1C/MTD_MSIL2A.xml with the baseline, no-data value, quantification and (if ``offsets``) -1000 offsets."""
    number = level[1:]
    quantification, offset = (
        ("BOA_QUANTIFICATION_VALUE", "BOA_ADD_OFFSET")
        if level == "L2A"
        else ("QUANTIFICATION_VALUE", "RADIO_ADD_OFFSET")
    )
    spectral = "".join(
        f'<Spectral_Information bandId="{i}" physicalBand="{b.replace("B0", "B")}"/>' for i, b in enumerate(BAND_IDS)
    )
    offset_list = "".join(f'<{offset} band_id="{i}">-1000</{offset}>' for i in range(len(BAND_IDS))) if offsets else ""
    offset_group = "BOA_ADD_OFFSET_VALUES_LIST" if level == "L2A" else "Radiometric_Offset_List"
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<n1:Level-{number}_User_Product xmlns:n1="https://psd-14.sentinel2.eo.esa.int/PSD/User_Product_Level-{number}.xsd">
  <n1:General_Info>
    <Product_Info>
      <PROCESSING_LEVEL>Level-{number}</PROCESSING_LEVEL>
      <PROCESSING_BASELINE>{baseline}</PROCESSING_BASELINE>
    </Product_Info>
    <Product_Image_Characteristics>
      <Special_Values><SPECIAL_VALUE_TEXT>NODATA</SPECIAL_VALUE_TEXT><SPECIAL_VALUE_INDEX>0</SPECIAL_VALUE_INDEX></Special_Values>
      <Special_Values><SPECIAL_VALUE_TEXT>SATURATED</SPECIAL_VALUE_TEXT><SPECIAL_VALUE_INDEX>65535</SPECIAL_VALUE_INDEX></Special_Values>
      <QUANTIFICATION_VALUES_LIST><{quantification} unit="none">10000</{quantification}></QUANTIFICATION_VALUES_LIST>
      <{offset_group}>{offset_list}</{offset_group}>
      <Spectral_Information_List>{spectral}</Spectral_Information_List>
    </Product_Image_Characteristics>
  </n1:General_Info>
</n1:Level-{number}_User_Product>
"""


def write_sentinel2_safe(
    root: Path,
    name: str,
    bands: dict[str, tuple[np.ndarray, int]],
    level: str = "L2A",
    baseline: str = "04.00",
    offsets: bool | None = None,
    scl: np.ndarray | None = None,
) -> Path:
    """A SAFE folder below ``root`` holding ``bands`` (band id such as ``B8A`` -> (DN array, metres)).

    L1C files lie in ``IMG_DATA``, L2A files in its ``R10m``/``R20m``/``R60m`` folder (``scl``, the
    scene classification, at 20 m). The MTD gives offsets of -1000 if ``offsets`` (default: from
    baseline 04.00 on). Returns the folder.
    """
    safe = root / f"S2A_MSI{level}_{SENSING}_N{baseline.replace('.', '')}_R022_{TILE}_{name}.SAFE"
    image = safe / "GRANULE" / f"{level}_{TILE}_A044000_{SENSING}" / "IMG_DATA"
    for band_id, (array, res) in bands.items():
        if level == "L1C":
            write_band(image / f"{TILE}_{SENSING}_{band_id}.jp2", array, res)
        else:
            write_band(image / f"R{res}m" / f"{TILE}_{SENSING}_{band_id}_{res}m.jp2", array, res)
    if scl is not None:
        write_band(image / "R20m" / f"{TILE}_{SENSING}_SCL_20m.jp2", scl, 20)
    offsets = float(baseline) >= 4 if offsets is None else offsets
    (safe / f"MTD_MSI{level}.xml").write_text(_mtd(level, baseline, offsets))
    return safe


def _mtl_text(tree: dict, depth: int = 0) -> list[str]:
    """An MTL tree as MTL.txt lines: groups indented, strings quoted, numbers bare."""
    lines = []
    for key, value in tree.items():
        pad = "  " * depth
        if isinstance(value, dict):
            lines += [f"{pad}GROUP = {key}", *_mtl_text(value, depth + 1), f"{pad}END_GROUP = {key}"]
            continue
        try:
            float(value)
        except ValueError:
            value = f'"{value}"'
        lines.append(f"{pad}{key} = {value}")
    return lines


def _landsat_band(number: int, level: int) -> tuple[str, str, dict[str, str]]:
    """A band's file suffix, its MTL file key and its scaling factors (USGS's values)."""
    if level == 1:
        factors = {f"REFLECTANCE_MULT_BAND_{number}": "2.0000E-05", f"REFLECTANCE_ADD_BAND_{number}": "-0.100000"}
        return f"B{number}", f"FILE_NAME_BAND_{number}", factors
    if number == 10:
        factors = {"TEMPERATURE_MULT_BAND_ST_B10": "3.41802E-03", "TEMPERATURE_ADD_BAND_ST_B10": "149.000000"}
        return "ST_B10", "FILE_NAME_BAND_ST_B10", factors
    factors = {f"REFLECTANCE_MULT_BAND_{number}": "2.75E-05", f"REFLECTANCE_ADD_BAND_{number}": "-0.200000"}
    return f"SR_B{number}", f"FILE_NAME_BAND_{number}", factors


def write_landsat_scene(
    root: Path,
    name: str,
    bands: dict[int, np.ndarray],
    collection: int = 2,
    level: int = 2,
    qa: np.ndarray | None = None,
    radsat: np.ndarray | None = None,
    mtl: str = "txt",
) -> Path:
    """A Landsat 8 scene folder ``root/name`` of 30 m ``bands`` (band number -> DN array), its quality
    band (QA_PIXEL for Collection 2, BQA for 1) and QA_RADSAT, and an MTL (``txt`` or ``json``) with the
    collection's groups and scaling factors. Returns the folder."""
    folder = root / name
    kind = "L2SP" if level == 2 else "L1TP"
    stem = f"LC08_{kind}_044034_20240101_20240110_0{collection}_T1"
    files: dict[str, str] = {}
    reflectance: dict[str, str] = {}
    temperature: dict[str, str] = {}
    for number, array in bands.items():
        suffix, key, factors = _landsat_band(number, level)
        files[key] = write_band(folder / f"{stem}_{suffix}.TIF", array, 30.0).name
        (temperature if "TEMPERATURE_MULT_BAND_ST_B10" in factors else reflectance).update(factors)
    if qa is not None:
        key, suffix = (
            ("FILE_NAME_QUALITY_L1_PIXEL", "QA_PIXEL") if collection == 2 else ("FILE_NAME_BAND_QUALITY", "BQA")
        )
        files[key] = write_band(folder / f"{stem}_{suffix}.TIF", qa, 30.0).name
    if radsat is not None:
        files["FILE_NAME_QUALITY_L1_RADIOMETRIC_SATURATION"] = write_band(
            folder / f"{stem}_QA_RADSAT.TIF", radsat, 30.0
        ).name
    if collection == 2:
        contents = {"COLLECTION_NUMBER": "02", "PROCESSING_LEVEL": kind, "SPACECRAFT_ID": "LANDSAT_8", **files}
        scaling = "LEVEL2_SURFACE_REFLECTANCE_PARAMETERS" if level == 2 else "LEVEL1_RADIOMETRIC_RESCALING"
        groups = {"PRODUCT_CONTENTS": contents, scaling: reflectance}
        if temperature:
            groups["LEVEL2_SURFACE_TEMPERATURE_PARAMETERS"] = temperature
        tree = {"LANDSAT_METADATA_FILE": groups}
    else:
        tree = {
            "L1_METADATA_FILE": {
                "METADATA_FILE_INFO": {"COLLECTION_NUMBER": "01"},
                "PRODUCT_METADATA": {"DATA_TYPE": kind, "SPACECRAFT_ID": "LANDSAT_8", **files},
                "RADIOMETRIC_RESCALING": reflectance,
            }
        }
    if mtl == "json":
        (folder / f"{stem}_MTL.json").write_text(json.dumps(tree))
    else:
        (folder / f"{stem}_MTL.txt").write_text("\n".join([*_mtl_text(tree), "END", ""]))
    return folder


def write_stac_item(root: Path, name: str, assets: dict[str, dict], properties: dict | None = None) -> Path:
    """A STAC item ``root/name/name.json`` whose ``assets`` (key -> {``array``, ``res`` (default 10 m),
    asset metadata...}) are written as GeoTIFFs beside it, with relative hrefs. Returns the JSON file."""
    item = root / name / f"{name}.json"
    entries = {}
    for key, spec in assets.items():
        metadata = {k: v for k, v in spec.items() if k not in ("array", "res")}
        write_band(item.parent / f"{key}.tif", spec["array"], spec.get("res", 10.0))
        entries[key] = {"href": f"./{key}.tif", "type": "image/tiff; application=geotiff", **metadata}
    stac = {"type": "Feature", "stac_version": "1.0.0", "id": name, "properties": properties or {}, "assets": entries}
    item.write_text(json.dumps(stac))
    return item
