"""Synthetic scenes of the demo archive: aerial, drone and satellite imagery and their labels.

Procedurally generated (smooth fields, parcels, roads, buildings, a river, noise) so that a
masked-image model has spatial structure to learn; every function draws only from the given
generator, so the same generator state always gives the same pixels.
"""

from __future__ import annotations

import numpy as np

SCENE_CLASSES = ("farmland", "forest", "residential", "water")
"""Classes of the demo's scene classification data, in class-id order (the sorted folder names)."""

LAND_COVER = ("crop", "forest", "bare_soil", "built_up", "grassland", "water")
"""Classes of the demo's segmentation masks and multi-label tables, in class-id order."""

UNLABELED = 255
"""Mask value of nodata pixels in the demo's segmentation masks."""

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
