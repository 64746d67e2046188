"""Built-in demo archive: small synthetic, georeferenced scenes from two made-up sensors.

The archive is smoke-test data for the pipeline, not real imagery. Its scenes are procedurally
generated (smooth fields, parcels, roads, buildings, a river, noise) so that a masked-image model
has spatial structure to learn, and the same seed always gives the same pixels.

Two sources are written below the root:

* ``aerial_rgb/``: 24 GeoTIFFs, 3 bands (red, green, blue) uint8, 96 x 96 pixels of 0.5 m,
  EPSG:32632 (UTM 32N).
* ``satellite_4band/``: 24 GeoTIFFs, 4 bands (blue, green, red, nir) uint16 reflectance x 10000,
  64 x 64 pixels of 10 m, EPSG:32632, nodata 0; every third scene has a no-data swath edge.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from geofm.data.readers import write_geotiff

SCENES = 24
CRS = "EPSG:32632"
_VERSION = 1
_MARKER = ".complete"

_README = """\
geofm demo archive (format version {version}, seed {seed})
================================================

SYNTHETIC SMOKE-TEST DATA, NOT REAL IMAGERY.

These scenes are generated procedurally by geofm.data.demo.make_demo_archive so that the
pretraining pipeline can be run end to end without any download. Coordinates are plausible
but arbitrary; no pixel shows a real place.

aerial_rgb/        {scenes} GeoTIFFs, bands red, green, blue, uint8, 96 x 96 pixels,
                   0.5 m pixels, {crs}, no nodata.
satellite_4band/   {scenes} GeoTIFFs, bands blue, green, red, nir, uint16 reflectance
                   x 10000 (1..10000), 64 x 64 pixels, 10 m pixels, {crs},
                   nodata 0 (every third scene has a no-data swath edge).

Regenerate with the same seed to get identical pixels.
"""

# Aerial land cover colours (R, G, B).
_GRASS = np.array([86.0, 120.0, 62.0])
_CROP = np.array([140.0, 150.0, 80.0])
_SOIL = np.array([150.0, 120.0, 90.0])
_ROAD = np.array([118.0, 118.0, 114.0])
_ROOFS = np.array([[165.0, 80.0, 64.0], [150.0, 150.0, 156.0], [95.0, 92.0, 98.0]])

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


def aerial_scene(rng: np.random.Generator, size: int = 96) -> np.ndarray:
    """One synthetic aerial RGB scene.

    Args:
        rng: source of randomness.
        size: side of the scene in pixels.

    Returns:
        uint8 array of shape (3, size, size).
    """
    field = _smooth_field(rng, size, size, cells=3)
    texture = _smooth_field(rng, size, size, cells=12)
    cover = np.where(field[..., None] < -0.3, _SOIL, np.where(field[..., None] < 0.4, _GRASS, _CROP))
    rgb = cover * (1 + 0.08 * texture[..., None])

    for _ in range(rng.integers(1, 3)):
        rgb[_road_mask(rng, size, size, half_width=rng.uniform(2.0, 3.5))] = _ROAD
    for _ in range(rng.integers(0, 5)):
        h, w = rng.integers(8, 22, 2)
        y, x = rng.integers(0, size - h), rng.integers(0, size - w)
        shadow = min(3, size - y - h)
        rgb[y + h : y + h + shadow, x : x + w] *= 0.45
        rgb[y : y + h, x : x + w] = _ROOFS[rng.integers(len(_ROOFS))]

    rgb += rng.normal(0.0, 4.0, rgb.shape)
    return np.clip(rgb, 0, 255).round().astype(np.uint8).transpose(2, 0, 1)


def satellite_scene(rng: np.random.Generator, size: int = 64, swath_edge: bool = False) -> np.ndarray:
    """One synthetic 4-band (blue, green, red, nir) satellite scene.

    Args:
        rng: source of randomness.
        size: side of the scene in pixels.
        swath_edge: blank a slanted strip along one edge to nodata (0), like the edge of a swath.

    Returns:
        uint16 array of shape (4, size, size), reflectance x 10000 in 1..10000, 0 for nodata.
    """
    labels = _parcels(rng, size, size, cuts=int(rng.integers(2, 5)))
    classes = rng.integers(0, len(_SIGNATURES), labels.max() + 1)
    gain = rng.uniform(0.85, 1.15, labels.max() + 1)
    reflectance = _SIGNATURES[classes[labels]] * gain[labels][..., None]
    reflectance *= 1 + 0.1 * _smooth_field(rng, size, size, cells=6)[..., None]

    if rng.random() < 0.5:
        yy, xx = np.mgrid[0:size, 0:size]
        course = size / 2 + 0.25 * size * _smooth_field(rng, 1, size, cells=2)[0]
        reflectance[np.abs(yy - course[None, :]) < rng.uniform(1.5, 3.5)] = _WATER
    reflectance[_road_mask(rng, size, size, half_width=0.6)] = _SIGNATURES[3]

    reflectance += rng.normal(0.0, 0.004, reflectance.shape)
    pixels = np.clip(reflectance * 10000, 1, 10000).round().astype(np.uint16).transpose(2, 0, 1)
    if swath_edge:
        width = rng.integers(3, 10)
        slope = rng.uniform(-0.1, 0.1)
        yy, xx = np.mgrid[0:size, 0:size]
        edge = xx < width + slope * yy
        pixels[:, edge if rng.random() < 0.5 else edge[:, ::-1]] = 0
    return pixels


def make_demo_archive(root: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the demo archive below ``root``, unless it is already complete for this seed.

    Args:
        root: folder of the archive; created if needed.
        seed: generation seed; the same seed gives the same pixels.

    Returns:
        Folder of each source: ``{"aerial_rgb": ..., "satellite_4band": ...}``.
    """
    root = Path(root)
    paths = {"aerial_rgb": root / "aerial_rgb", "satellite_4band": root / "satellite_4band"}
    marker = root / _MARKER
    stamp = f"version={_VERSION} seed={seed} scenes={SCENES}\n"
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

    (root / "README.txt").write_text(_README.format(version=_VERSION, seed=seed, scenes=SCENES, crs=CRS))
    marker.write_text(stamp)
    return paths
