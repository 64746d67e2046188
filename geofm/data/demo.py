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
the archive's README.txt, :data:`FINETUNE_SPLITS` and :data:`LAND_COVER`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from geofm.data.writers import write_geotiff

SCENES = 24
PUBLIC_SCENES = 16
CRS = "EPSG:32632"
_VERSION = 4
_MARKER = ".complete"

SCENE_CLASSES = ("farmland", "forest", "residential", "water")
"""Classes of the demo's scene classification data, in class-id order (the sorted folder names)."""

LAND_COVER = ("crop", "forest", "bare_soil", "built_up", "grassland", "water")
"""Classes of the demo's segmentation masks and multi-label tables, in class-id order."""

UNLABELED = 255
"""Mask value of nodata pixels in the demo's segmentation masks."""

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

SYNTHETIC SMOKE-TEST DATA, NOT REAL IMAGERY.

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
"""

# Aerial land cover colours (R, G, B).
_GRASS = np.array([86.0, 120.0, 62.0])
_CROP = np.array([140.0, 150.0, 80.0])
_SOIL = np.array([150.0, 120.0, 90.0])
_ROAD = np.array([118.0, 118.0, 114.0])
_ROOFS = np.array([[165.0, 80.0, 64.0], [150.0, 150.0, 156.0], [95.0, 92.0, 98.0]])
_FOREST = np.array([46.0, 78.0, 40.0])
_OPEN_WATER = np.array([38.0, 72.0, 96.0])

# Satellite reflectance signatures (blue, green, red, nir).
_SIGNATURES = np.array(
    [
        [0.035, 0.065, 0.045, 0.38],  # crop
        [0.025, 0.045, 0.030, 0.28],  # forest
        [0.080, 0.110, 0.140, 0.22],  # bare soil
        [0.100, 0.110, 0.120, 0.17],  # built-up
        [0.040, 0.070, 0.080, 0.30],  # grassland
    ]
)
_WATER = np.array([0.060, 0.050, 0.030, 0.012])


def _smooth_field(rng: np.random.Generator, height: int, width: int, cells: int) -> np.ndarray:
    """Smooth random field: Gaussian noise on a coarse grid, bilinearly upsampled (unit variance-ish)."""
    coarse = rng.standard_normal((cells + 1, cells + 1))
    ys = np.linspace(0.0, cells, height, endpoint=False)
    xs = np.linspace(0.0, cells, width, endpoint=False)
    y0, x0 = ys.astype(int), xs.astype(int)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = coarse[y0][:, x0] * (1 - fx) + coarse[y0][:, x0 + 1] * fx
    bottom = coarse[y0 + 1][:, x0] * (1 - fx) + coarse[y0 + 1][:, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def _parcels(rng: np.random.Generator, height: int, width: int, cuts: int) -> np.ndarray:
    """Label image of rectangular parcels from random row and column cuts."""
    rows = np.searchsorted(np.sort(rng.integers(1, height, cuts)), np.arange(height), side="right")
    cols = np.searchsorted(np.sort(rng.integers(1, width, cuts)), np.arange(width), side="right")
    return rows[:, None] * (cuts + 1) + cols[None, :]


def _road_mask(rng: np.random.Generator, height: int, width: int, half_width: float) -> np.ndarray:
    """Straight road at a random angle through a random point of the scene."""
    yy, xx = np.mgrid[0:height, 0:width]
    angle = rng.uniform(0, np.pi)
    cy, cx = rng.uniform(0, height), rng.uniform(0, width)
    distance = np.abs((yy - cy) * np.cos(angle) - (xx - cx) * np.sin(angle))
    return distance <= half_width


def _aerial_ground(rng: np.random.Generator, size: int) -> np.ndarray:
    """Fields and roads of an aerial scene, float RGB of shape (size, size, 3)."""
    field = _smooth_field(rng, size, size, cells=3)
    texture = _smooth_field(rng, size, size, cells=12)
    cover = np.where(field[..., None] < -0.3, _SOIL, np.where(field[..., None] < 0.4, _GRASS, _CROP))
    rgb = cover * (1 + 0.08 * texture[..., None])
    for _ in range(rng.integers(1, 3)):
        rgb[_road_mask(rng, size, size, half_width=rng.uniform(2.0, 3.5))] = _ROAD
    return rgb


def _add_building(rng: np.random.Generator, rgb: np.ndarray, size: int) -> np.ndarray:
    """Draw a roof with its shadow into a float RGB scene; returns the roof's footprint (bool)."""
    h, w = rng.integers(8, 22, 2)
    y, x = rng.integers(0, size - h), rng.integers(0, size - w)
    shadow = min(3, size - y - h)
    rgb[y + h : y + h + shadow, x : x + w] *= 0.45
    rgb[y : y + h, x : x + w] = _ROOFS[rng.integers(len(_ROOFS))]
    roof = np.zeros((size, size), dtype=bool)
    roof[y : y + h, x : x + w] = True
    return roof


def _finish_rgb(rng: np.random.Generator, rgb: np.ndarray) -> np.ndarray:
    """Sensor noise, then uint8 of shape (3, H, W)."""
    rgb = rgb + rng.normal(0.0, 4.0, rgb.shape)
    return np.clip(rgb, 0, 255).round().astype(np.uint8).transpose(2, 0, 1)


def aerial_scene(rng: np.random.Generator, size: int = 96) -> np.ndarray:
    """One synthetic aerial RGB scene.

    Args:
        rng: source of randomness.
        size: side of the scene in pixels.

    Returns:
        uint8 array of shape (3, size, size).
    """
    rgb = _aerial_ground(rng, size)
    for _ in range(rng.integers(0, 5)):
        _add_building(rng, rgb, size)
    return _finish_rgb(rng, rgb)


def uav_scene(rng: np.random.Generator, size: int = 80) -> np.ndarray:
    """One synthetic very-high-resolution drone scene: red, green, blue and near infrared.

    Near infrared is bright on vegetation (green above red) and dark on roofs, roads and soil.

    Returns:
        uint8 array of shape (4, size, size).
    """
    rgb = aerial_scene(rng, size).astype(np.float64)
    red, green = rgb[0], rgb[1]
    nir = 60.0 + 2.2 * np.clip(green - red, 0.0, None) + 0.25 * green + rng.normal(0.0, 3.0, red.shape)
    return np.concatenate([rgb, np.clip(nir, 0, 255)[None]]).round().astype(np.uint8)


def satellite_scene(rng: np.random.Generator, size: int = 64, swath_edge: bool = False) -> np.ndarray:
    """One synthetic 4-band (blue, green, red, nir) satellite scene.

    Args:
        rng: source of randomness.
        size: side of the scene in pixels.
        swath_edge: blank a slanted strip along one edge to nodata (0), like the edge of a swath.

    Returns:
        uint16 array of shape (4, size, size), reflectance x 10000 in 1..10000, 0 for nodata.
    """
    return satellite_scene_with_cover(rng, size, swath_edge)[0]


def satellite_scene_with_cover(
    rng: np.random.Generator, size: int = 64, swath_edge: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic 4-band satellite scene and its land cover.

    Args:
        rng: source of randomness (drawn from as :func:`satellite_scene` does).
        size: side of the scene in pixels.
        swath_edge: blank a slanted strip along one edge to nodata (0).

    Returns:
        The uint16 pixels (4, size, size) and a uint8 land cover map (size, size) with ids of
        :data:`LAND_COVER` (roads are built-up) and :data:`UNLABELED` on nodata pixels.
    """
    labels = _parcels(rng, size, size, cuts=int(rng.integers(2, 5)))
    classes = rng.integers(0, len(_SIGNATURES), labels.max() + 1)
    gain = rng.uniform(0.85, 1.15, labels.max() + 1)
    cover = classes[labels].astype(np.uint8)
    reflectance = _SIGNATURES[classes[labels]] * gain[labels][..., None]
    reflectance *= 1 + 0.1 * _smooth_field(rng, size, size, cells=6)[..., None]

    if rng.random() < 0.5:
        yy, xx = np.mgrid[0:size, 0:size]
        course = size / 2 + 0.25 * size * _smooth_field(rng, 1, size, cells=2)[0]
        river = np.abs(yy - course[None, :]) < rng.uniform(1.5, 3.5)
        reflectance[river] = _WATER
        cover[river] = LAND_COVER.index("water")
    road = _road_mask(rng, size, size, half_width=0.6)
    reflectance[road] = _SIGNATURES[3]
    cover[road] = LAND_COVER.index("built_up")

    reflectance += rng.normal(0.0, 0.004, reflectance.shape)
    pixels = np.clip(reflectance * 10000, 1, 10000).round().astype(np.uint16).transpose(2, 0, 1)
    if swath_edge:
        width = rng.integers(3, 10)
        slope = rng.uniform(-0.1, 0.1)
        yy, xx = np.mgrid[0:size, 0:size]
        edge = xx < width + slope * yy
        blank = edge if rng.random() < 0.5 else edge[:, ::-1]
        pixels[:, blank] = 0
        cover[blank] = UNLABELED
    return pixels, cover


def classification_scene(rng: np.random.Generator, scene_class: str, size: int = 64) -> np.ndarray:
    """One synthetic aerial RGB scene of a class of :data:`SCENE_CLASSES`, uint8 (3, size, size).

    farmland: rectangular fields of crop, soil and grass; forest: dark, blotchy canopy; residential:
    grass with roads and many buildings; water: mostly open water with a grassy shore.
    """
    texture = _smooth_field(rng, size, size, cells=12)
    if scene_class == "farmland":
        parcels = _parcels(rng, size, size, cuts=3)
        palette = np.stack([_CROP, _SOIL, _GRASS])[rng.integers(0, 3, parcels.max() + 1)]
        rgb = palette[parcels] * (1 + 0.05 * texture[..., None])
    elif scene_class == "forest":
        crowns = _smooth_field(rng, size, size, cells=16)
        rgb = _FOREST * (1 + 0.25 * crowns[..., None])
    elif scene_class == "residential":
        rgb = _GRASS * (1 + 0.08 * texture[..., None])
        for _ in range(rng.integers(1, 3)):
            rgb[_road_mask(rng, size, size, half_width=rng.uniform(1.5, 2.5))] = _ROAD
        for _ in range(rng.integers(5, 9)):
            _add_building(rng, rgb, size)
    elif scene_class == "water":
        shore = _smooth_field(rng, size, size, cells=2)
        rgb = np.where(shore[..., None] < 0.6, _OPEN_WATER, _GRASS) * (1 + 0.03 * texture[..., None])
    else:
        raise ValueError(f"unknown demo scene class {scene_class!r}; expected one of {SCENE_CLASSES}")
    return _finish_rgb(rng, rgb)


def change_pair(rng: np.random.Generator, size: int = 96) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A before/after pair of aerial RGB scenes where buildings appear.

    Returns:
        Before and after, uint8 (3, size, size), and the change mask, uint8 (size, size): 255 on
        the roofs of new buildings, 0 elsewhere. About one pair in four has no new building.
    """
    rgb = _aerial_ground(rng, size)
    for _ in range(rng.integers(0, 3)):
        _add_building(rng, rgb, size)
    after = rgb.copy()
    built = np.zeros((size, size), dtype=bool)
    for _ in range(rng.integers(0, 4)):
        built |= _add_building(rng, after, size)
    after *= rng.uniform(0.9, 1.1)
    return _finish_rgb(rng, rgb), _finish_rgb(rng, after), np.where(built, 255, 0).astype(np.uint8)


def area_average(image: np.ndarray, factor: int) -> np.ndarray:
    """Downsample a (bands, H, W) image by averaging ``factor`` x ``factor`` blocks, in its own dtype."""
    bands, height, width = image.shape
    blocks = image.reshape(bands, height // factor, factor, width // factor, factor).astype(np.float64)
    mean = blocks.mean(axis=(2, 4))
    return mean.round().astype(image.dtype) if image.dtype.kind in "iu" else mean.astype(image.dtype)


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
        )
    )
    marker.write_text(stamp)
    return paths
