"""BigEarthNet patch metadata for decentralisation scenarios: each patch's country and season.

The remote-sensing federated-learning literature splits BigEarthNet-S2 across clients by the
country and season of its patches (DS1: summer patches at random; DS2: summer patches, one country
per client; DS3: all seasons, one country per client). BigEarthNet v2.0's ``metadata.parquet``
(read by torchgeo's ``BigEarthNetV2``) names each patch's country; its season is that of the
acquisition date in the patch name (``S2A_MSIL2A_20170613T101031_...``: June, summer; meteorological
seasons, every BigEarthNet country being in the northern hemisphere). :func:`write_bigearthnet_metadata`
writes them as the CSV that ``federation.metadata`` reads (see :mod:`geofm.fl.partitions.samples`),
one row per sample of each split in torchgeo's order, named ``<split>/<index>`` as the federated
finetuning program names a torchgeo dataset's samples.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path

from geofm.errors import DatasetNotFoundError

METADATA_FILE = "metadata.parquet"
SPLITS = {"train": "train", "val": "validation", "test": "test"}
"""geofm split -> the ``split`` value of BigEarthNet v2.0's metadata (torchgeo's ``BigEarthNetV2.split_map``)."""
_SEASONS = ("winter", "winter", "spring", "spring", "spring", "summer", "summer", "summer", "autumn", "autumn")
_SEASONS += ("autumn", "winter")


def season_of(patch: str) -> str:
    """The meteorological season of a Sentinel-2 patch's acquisition (northern hemisphere).

    Raises:
        ValueError: the name holds no ``YYYYMMDDTHHMMSS`` acquisition time as its third field.
    """
    fields = patch.split("_")
    stamp = fields[2] if len(fields) > 2 else ""
    if len(stamp) < 8 or not stamp[:8].isdigit() or not 1 <= int(stamp[4:6]) <= 12:
        raise ValueError(f"patch {patch!r}: expected an acquisition time YYYYMMDDTHHMMSS as its third field")
    return _SEASONS[int(stamp[4:6]) - 1]


def bigearthnet_metadata(root: str | Path, splits: Mapping[str, str] = SPLITS) -> list[dict[str, str]]:
    """One row per patch of each split: ``sample`` (``<split>/<index>``), ``patch_id``, ``country``, ``season``.

    Raises:
        DatasetNotFoundError: ``root`` holds no ``metadata.parquet`` with the columns needed.
    """
    import pandas as pd  # installed with torchgeo

    path = Path(root) / METADATA_FILE
    if not path.is_file():
        raise DatasetNotFoundError(
            f"{path} does not exist: expected BigEarthNet v2.0's metadata (torchgeo BigEarthNetV2)"
        )
    table = pd.read_parquet(path)
    missing = {"patch_id", "split", "country"} - set(table.columns)
    if missing:
        raise DatasetNotFoundError(f"{path}: no column {sorted(missing)} (columns: {list(table.columns)})")
    rows = []
    for split, value in splits.items():
        patches = table[table["split"] == value].reset_index(drop=True)
        for index, (patch, country) in enumerate(zip(patches["patch_id"], patches["country"], strict=True)):
            rows.append(
                {"sample": f"{split}/{index}", "patch_id": patch, "country": country, "season": season_of(patch)}
            )
    return rows


def write_bigearthnet_metadata(root: str | Path, out: str | Path) -> Path:
    """Write :func:`bigearthnet_metadata` of ``root`` to the CSV file ``out``."""
    rows, out = bigearthnet_metadata(root), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["sample", "patch_id", "country", "season"])
        writer.writeheader()
        writer.writerows(rows)
    os.replace(partial, out)
    return out


__all__ = ["bigearthnet_metadata", "season_of", "write_bigearthnet_metadata"]
