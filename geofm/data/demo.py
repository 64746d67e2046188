"""Built-in demo archive: small synthetic, georeferenced scenes from three made-up sensors.

The archive is smoke-test data for the pipeline, not real imagery. Its scenes are procedurally
generated (smooth fields, parcels, roads, buildings, a river, noise) so that a masked-image model
has spatial structure to learn, and the same seed always gives the same pixels.

Pretraining sources written below the root (three institutions' archives and a public set):

* ``aerial_rgb/``: 24 GeoTIFFs, 3 bands (red, green, blue) uint8, 96 x 96 pixels of 0.5 m,
  EPSG:32632 (UTM 32N).
* ``satellite_4band/``: 24 GeoTIFFs, 4 bands (blue, green, red, nir) uint16 reflectance x 10000,
  64 x 64 pixels of 10 m, EPSG:32632, nodata 0; every third scene has a no-data swath edge.
* ``uav_rgbn/``: 24 GeoTIFFs, 4 bands (red, green, blue, nir) uint8, 80 x 80 pixels of 0.1 m,
  EPSG:32632.
* ``public_rgb/``: 16 GeoTIFFs like ``aerial_rgb`` at 1 m, elsewhere: the public data a
  federation's server holds.

and labelled downstream data below ``finetune/``, one folder per task family in the folder layouts
of :mod:`geofm.data.finetune.folders`, each with ``train/``, ``val/`` and ``test/`` splits (see
the archive's README.txt, :data:`FINETUNE_SPLITS` and :data:`~geofm.data.demo_scenes.LAND_COVER`).
Real imagery goes below ``real/`` (:mod:`geofm.data.demo_real`), which the README describes too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from geofm.data.demo_real import README_SECTION as REAL_README_SECTION
from geofm.data.demo_scenes import (
    LAND_COVER,
    SCENE_CLASSES,
    UNLABELED,
    aerial_scene,
    area_average,
    change_pair,
    classification_scene,
    satellite_scene,
    satellite_scene_with_cover,
    uav_scene,
)
from geofm.data.writers import write_geotiff

SCENES = 24
PUBLIC_SCENES = 16
CRS = "EPSG:32632"
_VERSION = 5
_MARKER = ".complete"

SR_FACTOR = 4
"""High / low resolution ratio of the demo's super-resolution pairs."""

FINETUNE_SPLITS: dict[str, dict[str, int]] = {
    "classification": {"train": 8, "val": 3, "test": 3},  # scenes per class
    "multilabel": {"train": 16, "val": 6, "test": 6},
    "segmentation": {"train": 12, "val": 4, "test": 4},
    "change": {"train": 12, "val": 4, "test": 4},
    "superres": {"train": 8, "val": 2, "test": 2},
}
"""Scenes per split of each downstream family."""

_README = """\
geofm demo archive (format version {version}, seed {seed})
================================================

Everything here except real/ is SYNTHETIC SMOKE-TEST DATA, NOT REAL IMAGERY.

These scenes are generated procedurally by geofm.data.demo.make_demo_archive so that the
pretraining and finetuning pipelines can be run end to end without any download. Coordinates are plausible
but arbitrary; no pixel shows a real place.

aerial_rgb/        {scenes} GeoTIFFs, bands red, green, blue, uint8, 96 x 96 pixels,
                   0.5 m pixels, {crs}, no nodata.
satellite_4band/   {scenes} GeoTIFFs, bands blue, green, red, nir, uint16 reflectance
                   x 10000 (1..10000), 64 x 64 pixels, 10 m pixels, {crs},
                   nodata 0 (every third scene has a no-data swath edge).
uav_rgbn/          {scenes} GeoTIFFs, bands red, green, blue, nir, uint8, 80 x 80 pixels,
                   0.1 m pixels, {crs}, no nodata.
public_rgb/        {public} GeoTIFFs like aerial_rgb at 1 m pixels, elsewhere: the public set
                   of a federated demo's server.

finetune/          labelled downstream data, one folder per task, each with train/ val/ test/:
  classification/  <split>/<class>/scene_*.tif, RGB uint8, 64 x 64 px of 0.5 m; classes
                   {classes} (visibly different content);
                   {cls_counts} scenes per class.
  multilabel/      <split>/images/scene_*.tif (4-band uint16 as satellite_4band, 64 x 64 px,
                   nodata 0) and <split>/labels.csv: header "image,<class>,...", one row per
                   image with 0/1 per land cover class present on at least 2% of its valid
                   pixels; classes {cover};
                   {ml_counts} scenes.
  segmentation/    <split>/images/scene_*.tif (4-band uint16, 96 x 96 px of 10 m, nodata 0,
                   every third scene with a no-data swath edge) and <split>/masks/scene_*.tif
                   (uint8 land cover ids {cover_ids},
                   {unlabeled} on nodata pixels); {seg_counts} scenes.
  change/          <split>/A/ (before), <split>/B/ (after), <split>/label/ (LEVIR-CD layout):
                   RGB uint8 pairs, 96 x 96 px of 0.5 m on one grid, where buildings appear
                   (and light and noise differ); label uint8 0 = no change, 255 = new
                   building; some pairs have no change; {cd_counts} pairs.
  superres/        <split>/hr/scene_*.tif RGB uint8 256 x 256 px of 0.5 m and <split>/lr/
                   scene_*.tif the {factor} x {factor} area average of those bands and near infrared
                   (red, green, blue, nir uint8), 64 x 64 px of {lr_gsd} m, same upper-left corner:
                   4-band multispectral to pan-sharpened RGB, as from a Pleiades-like sensor;
                   {sr_counts} pairs.
                   Split counts are train/val/test.

Regenerate with the same seed to get identical pixels.

{real}"""


def _present_cover(cover: np.ndarray, share: float = 0.02) -> list[int]:
    """0/1 per land cover class: present on at least ``share`` of the valid pixels."""
    valid = cover[cover != UNLABELED]
    counts = np.bincount(valid, minlength=len(LAND_COVER))
    return [int(c >= share * max(len(valid), 1)) for c in counts]


def _write_finetune(root: Path, seed: int) -> dict[str, Path]:
    """Write the labelled downstream data below ``root``; returns each family's folder."""
    folders = {family: root / family for family in FINETUNE_SPLITS}
    for s, split in enumerate(("train", "val", "test")):

        def at(family: int, i: int, pixel: float, size: int, s: int = s) -> tuple[float, ...]:
            """Transform of scene i of a family: families and splits in separate areas of the zone."""
            x0 = 400_000.0 + family * 20_000.0 + (i % 8) * size * pixel
            y0 = 5_300_000.0 - s * 10_000.0 - (i // 8) * size * pixel
            return (pixel, 0.0, x0, 0.0, -pixel, y0)

        out = folders["classification"] / split
        for c, name in enumerate(SCENE_CLASSES):
            for i in range(FINETUNE_SPLITS["classification"][split]):
                n = c * 100 + i
                image = classification_scene(np.random.default_rng([seed, 10, s, c, i]), name)
                write_geotiff(out / name / f"scene_{n:03d}.tif", image, transform=at(0, n, 0.5, 64), crs=CRS)

        out = folders["multilabel"] / split
        rows = ["image," + ",".join(LAND_COVER)]
        for i in range(FINETUNE_SPLITS["multilabel"][split]):
            pixels, cover = satellite_scene_with_cover(
                np.random.default_rng([seed, 11, s, i]), 64, swath_edge=i % 3 == 0
            )
            write_geotiff(
                out / "images" / f"scene_{i:03d}.tif", pixels, transform=at(1, i, 10.0, 64), crs=CRS, nodata=0
            )
            rows.append(f"scene_{i:03d}.tif," + ",".join(map(str, _present_cover(cover))))
        (out / "labels.csv").write_text("\n".join(rows) + "\n")

        out = folders["segmentation"] / split
        for i in range(FINETUNE_SPLITS["segmentation"][split]):
            pixels, cover = satellite_scene_with_cover(
                np.random.default_rng([seed, 12, s, i]), 96, swath_edge=i % 3 == 0
            )
            transform = at(2, i, 10.0, 96)
            write_geotiff(out / "images" / f"scene_{i:03d}.tif", pixels, transform=transform, crs=CRS, nodata=0)
            write_geotiff(out / "masks" / f"scene_{i:03d}.tif", cover[None], transform=transform, crs=CRS)

        out = folders["change"] / split
        for i in range(FINETUNE_SPLITS["change"][split]):
            before, after, change = change_pair(np.random.default_rng([seed, 13, s, i]))
            transform = at(3, i, 0.5, 96)
            write_geotiff(out / "A" / f"scene_{i:03d}.tif", before, transform=transform, crs=CRS)
            write_geotiff(out / "B" / f"scene_{i:03d}.tif", after, transform=transform, crs=CRS)
            write_geotiff(out / "label" / f"scene_{i:03d}.tif", change[None], transform=transform, crs=CRS)

        out = folders["superres"] / split
        for i in range(FINETUNE_SPLITS["superres"][split]):
            scene = uav_scene(np.random.default_rng([seed, 14, s, i]), size=64 * SR_FACTOR)
            transform = at(4, i, 0.5, 64 * SR_FACTOR)
            write_geotiff(out / "hr" / f"scene_{i:03d}.tif", scene[:3], transform=transform, crs=CRS)
            low = (transform[0] * SR_FACTOR, 0.0, transform[2], 0.0, transform[4] * SR_FACTOR, transform[5])
            write_geotiff(out / "lr" / f"scene_{i:03d}.tif", area_average(scene, SR_FACTOR), transform=low, crs=CRS)
    return folders


def make_demo_archive(root: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the demo archive below ``root``, unless it is already complete for this seed.

    Args:
        root: folder of the archive; created if needed.
        seed: generation seed; the same seed gives the same pixels.

    Returns:
        Folder of each pretraining source (``aerial_rgb``, ``satellite_4band``, ``uav_rgbn``,
        ``public_rgb``) and of each downstream family (``classification``, ``multilabel``,
        ``segmentation``, ``change``, ``superres``, below ``finetune/``).
    """
    root = Path(root)
    paths = {name: root / name for name in ("aerial_rgb", "satellite_4band", "uav_rgbn", "public_rgb")}
    paths.update({family: root / "finetune" / family for family in FINETUNE_SPLITS})
    marker = root / _MARKER
    stamp = f"version={_VERSION} seed={seed} scenes={SCENES} public={PUBLIC_SCENES}\n"
    if marker.is_file() and marker.read_text() == stamp:
        return paths
    marker.unlink(missing_ok=True)

    for i in range(SCENES):
        row, col = divmod(i, 6)
        aerial = aerial_scene(np.random.default_rng([seed, 0, i]))
        x0, y0 = 480_000.0 + col * 48.0, 5_330_000.0 - row * 48.0
        write_geotiff(paths["aerial_rgb"] / f"scene_{i:03d}.tif", aerial, transform=(0.5, 0, x0, 0, -0.5, y0), crs=CRS)

        satellite = satellite_scene(np.random.default_rng([seed, 1, i]), swath_edge=i % 3 == 0)
        x0, y0 = 470_000.0 + col * 640.0, 5_340_000.0 - row * 640.0
        write_geotiff(
            paths["satellite_4band"] / f"scene_{i:03d}.tif",
            satellite,
            transform=(10.0, 0, x0, 0, -10.0, y0),
            crs=CRS,
            nodata=0,
        )

        uav = uav_scene(np.random.default_rng([seed, 2, i]))
        x0, y0 = 490_000.0 + col * 8.0, 5_320_000.0 - row * 8.0
        write_geotiff(paths["uav_rgbn"] / f"scene_{i:03d}.tif", uav, transform=(0.1, 0, x0, 0, -0.1, y0), crs=CRS)
    for i in range(PUBLIC_SCENES):
        row, col = divmod(i, 4)
        public = aerial_scene(np.random.default_rng([seed, 3, i]))
        x0, y0 = 500_000.0 + col * 96.0, 5_300_000.0 - row * 96.0
        write_geotiff(paths["public_rgb"] / f"scene_{i:03d}.tif", public, transform=(1.0, 0, x0, 0, -1.0, y0), crs=CRS)
    _write_finetune(root / "finetune", seed)

    counts = {family: "/".join(str(n) for n in splits.values()) for family, splits in FINETUNE_SPLITS.items()}
    (root / "README.txt").write_text(
        _README.format(
            version=_VERSION,
            seed=seed,
            scenes=SCENES,
            public=PUBLIC_SCENES,
            crs=CRS,
            classes=", ".join(SCENE_CLASSES),
            cover=", ".join(LAND_COVER),
            cover_ids=", ".join(f"{i} {name}" for i, name in enumerate(LAND_COVER)),
            unlabeled=UNLABELED,
            factor=SR_FACTOR,
            lr_gsd=0.5 * SR_FACTOR,
            cls_counts=counts["classification"],
            ml_counts=counts["multilabel"],
            seg_counts=counts["segmentation"],
            cd_counts=counts["change"],
            sr_counts=counts["superres"],
            real=REAL_README_SECTION,
        )
    )
    marker.write_text(stamp)
    return paths
