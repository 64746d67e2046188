"""The band vocabulary: canonical names of spectral and radar bands, their aliases, and checks.

Band names are how geofm matches a file's bands to a model's inputs and a checkpoint's kernels to a
model's bands, so a misspelt name must never pass silently. Canonical names follow the STAC
``eo:common_name`` style, with the red-edge bands numbered as on Sentinel-2:

=================  ==========================================  ========================================
canonical          what                                        aliases
=================  ==========================================  ========================================
``coastal``        coastal aerosol (~443 nm)                   ``b01`` (Sentinel-2), ``sr_b1`` (Landsat)
``blue``           blue (~490 nm)                              ``b02``, ``sr_b2``
``green``          green (~560 nm)                             ``b03``, ``sr_b3``
``red``            red (~665 nm)                               ``b04``, ``sr_b4``
``rededge1``       red edge 1 (~705 nm)                        ``b05``, ``rededge071`` (STAC)
``rededge2``       red edge 2 (~740 nm)                        ``b06``, ``rededge075`` (STAC)
``rededge3``       red edge 3 (~783 nm)                        ``b07``, ``rededge078`` (STAC)
``nir``            near infrared (~842-865 nm)                 ``b08``, ``sr_b5``, ``near_infrared``
``nir08``          narrow near infrared (~865 nm)              ``b8a``, ``rededge4``
``water_vapour``   water vapour (~945 nm)                      ``b09``, ``nir09``, ``water_vapor``
``cirrus``         cirrus (~1375 nm)                           ``b10``
``swir16``         short-wave infrared 1 (~1610 nm)            ``b11``, ``sr_b6``, ``swir1``
``swir22``         short-wave infrared 2 (~2200 nm)            ``b12``, ``sr_b7``, ``swir2``
``pan``            panchromatic                                ``panchromatic``
``lwir11``         thermal infrared 1 (~10.9 um)               ``st_b10``, ``tirs1``
``lwir12``         thermal infrared 2 (~12 um)                 ``tirs2``
``vv`` ``vh``      SAR polarisations                           (none)
``hh`` ``hv``
=================  ==========================================  ========================================

Names are case-insensitive. Unpadded band numbers (``b5``, ``b8``) are not aliases: they mean
different bands on Sentinel-2 and Landsat; a file's band id is read through a sensor's table of
:data:`BAND_ID_TABLES` instead (:func:`band_of_id`). Bands outside this vocabulary (an index, an elevation model, a
sensor-specific band) are declared explicitly, e.g. ``data.custom_bands: [ndvi, dem]``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

CANONICAL_BANDS: tuple[str, ...] = (
    "coastal",
    "blue",
    "green",
    "red",
    "rededge1",
    "rededge2",
    "rededge3",
    "nir",
    "nir08",
    "water_vapour",
    "cirrus",
    "swir16",
    "swir22",
    "pan",
    "lwir11",
    "lwir12",
    "vv",
    "vh",
    "hh",
    "hv",
)

ALIASES: dict[str, str] = {
    # Sentinel-2 band numbers
    "b01": "coastal",
    "b02": "blue",
    "b03": "green",
    "b04": "red",
    "b05": "rededge1",
    "b06": "rededge2",
    "b07": "rededge3",
    "b08": "nir",
    "b8a": "nir08",
    "b09": "water_vapour",
    "b10": "cirrus",
    "b11": "swir16",
    "b12": "swir22",
    # Landsat 8/9 Collection 2 surface products (bare Landsat numbers clash with Sentinel-2's: b5 is nir there)
    "sr_b1": "coastal",
    "sr_b2": "blue",
    "sr_b3": "green",
    "sr_b4": "red",
    "sr_b5": "nir",
    "sr_b6": "swir16",
    "sr_b7": "swir22",
    "st_b10": "lwir11",
    "tirs1": "lwir11",
    "tirs2": "lwir12",
    # spelled-out and common names
    "near_infrared": "nir",
    "rededge4": "nir08",
    "nir09": "water_vapour",
    "water_vapor": "water_vapour",
    "swir1": "swir16",
    "swir2": "swir22",
    "panchromatic": "pan",
    # STAC eo extension v2 common names of the red-edge bands
    "rededge071": "rededge1",
    "rededge075": "rededge2",
    "rededge078": "rededge3",
}

BAND_ID_TABLES: dict[str, dict[str, str]] = {
    "sentinel2": {
        "B01": "coastal",
        "B02": "blue",
        "B03": "green",
        "B04": "red",
        "B05": "rededge1",
        "B06": "rededge2",
        "B07": "rededge3",
        "B08": "nir",
        "B8A": "nir08",
        "B09": "water_vapour",
        "B10": "cirrus",
        "B11": "swir16",
        "B12": "swir22",
    },
    "landsat8": {
        "B1": "coastal",
        "B2": "blue",
        "B3": "green",
        "B4": "red",
        "B5": "nir",
        "B6": "swir16",
        "B7": "swir22",
        "B8": "pan",
        "B9": "cirrus",
        "B10": "lwir11",
        "B11": "lwir12",
    },
}
"""Band ids as sensors name their files (``T32TQM_..._B8A.jp2``, ``LC08_..._B5.TIF``), per sensor:
Sentinel-2 MSI and Landsat 8/9 OLI-TIRS (Landsat 9 numbers its bands as Landsat 8 does)."""

CENTRAL_WAVELENGTHS_UM: dict[str, float] = {
    "coastal": 0.443,
    "blue": 0.49,
    "green": 0.56,
    "red": 0.665,
    "rededge1": 0.705,
    "rededge2": 0.74,
    "rededge3": 0.783,
    "nir": 0.842,
    "nir08": 0.865,
    "water_vapour": 0.945,
    "cirrus": 1.375,
    "swir16": 1.61,
    "swir22": 2.19,
    "pan": 0.59,
    "lwir11": 10.9,
    "lwir12": 12.0,
}
"""Central wavelength of each optical band in micrometres (Sentinel-2 MSI's where it has the band, else
Landsat 8 OLI-TIRS'), as wavelength-conditioned models (DOFA) take them. SAR bands have none here."""

RGB = ("red", "green", "blue")


def rgb_indices(bands: Sequence[str]) -> list[int] | None:
    """Positions of red, green, blue in canonical ``bands``, or None if any is missing."""
    if all(b in bands for b in RGB):
        return [list(bands).index(b) for b in RGB]
    return None


def central_wavelengths(bands: Sequence[str], where: str = "bands") -> list[float]:
    """The central wavelength (um) of each of ``bands`` (canonical names), in order.

    Raises:
        UnknownBandError: a band has no wavelength in :data:`CENTRAL_WAVELENGTHS_UM` (SAR, a custom band).
    """
    missing = [b for b in bands if b not in CENTRAL_WAVELENGTHS_UM]
    if missing:
        raise UnknownBandError(
            f"{where}: {', '.join(missing)} has no central wavelength; bands with one: {', '.join(CENTRAL_WAVELENGTHS_UM)}"
        )
    return [CENTRAL_WAVELENGTHS_UM[b] for b in bands]


def teacher_band_indices(bands: Sequence[str]) -> list[int]:
    """Input bands an RGB teacher sees: red, green, blue (or the first three bands when one is missing)."""
    return rgb_indices(bands) or [0, 1, 2]


class UnknownBandError(ValueError):
    """A band name is neither in the vocabulary nor declared as custom."""


def canonical_band(name: str, custom: Iterable[str] = ()) -> str:
    """The canonical name of a band (aliases resolved, lower case), or a declared custom band.

    Args:
        name: a band name as written in a config or a file's metadata.
        custom: band names declared outside the vocabulary; kept as written (lower case).

    Raises:
        UnknownBandError: naming the band and the nearest known names.
    """
    key = str(name).strip().lower()
    custom = {c.strip().lower() for c in custom}
    if key in CANONICAL_BANDS or key in custom:
        return key
    if key in ALIASES:
        return ALIASES[key]
    known = sorted(set(CANONICAL_BANDS) | set(ALIASES) | custom)
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise UnknownBandError(
        f"unknown band {name!r}: {hint}known bands are {', '.join(CANONICAL_BANDS)} (and aliases such as b08 for nir); "
        "declare other bands under data.custom_bands"
    )


def band_of_id(band_id: str, table: str, custom: Iterable[str] = ()) -> str | None:
    """The vocabulary band a file's band id stands for, or None if ``table`` does not know the id.

    Args:
        band_id: the id in a file name, e.g. ``B8A`` or ``B5`` (case-insensitive).
        table: a sensor of :data:`BAND_ID_TABLES`, or ``vocabulary``: the id is a band name or
            alias of the vocabulary (or of ``custom``) itself.
        custom: declared custom band names.
    """
    if table == "vocabulary":
        try:
            return canonical_band(band_id, custom)
        except UnknownBandError:
            return None
    return BAND_ID_TABLES[table].get(band_id.strip().upper())


def canonical_bands(names: Sequence[str], custom: Iterable[str] = (), where: str = "bands") -> list[str]:
    """Canonical names of a band list, in order; duplicates after resolving aliases are an error.

    Args:
        names: the band names.
        custom: declared custom band names.
        where: the config field the names come from, for the error message.

    Raises:
        UnknownBandError: an unknown or duplicated band, naming ``where``.
    """
    custom = list(custom)
    resolved = []
    for name in names:
        try:
            resolved.append(canonical_band(name, custom))
        except UnknownBandError as err:
            raise UnknownBandError(f"{where}: {err}") from None
    duplicated = sorted({b for b in resolved if resolved.count(b) > 1})
    if duplicated:
        raise UnknownBandError(f"{where}: {list(names)} names {', '.join(duplicated)} more than once")
    return resolved
