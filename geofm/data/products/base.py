"""What every layout describes: a product's band files, how their values scale, its quality band."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from geofm.errors import RasterReadError


def folders_of(files: list[Path]) -> list[Path]:
    """The distinct folders holding ``files`` (a product's metadata file names its folder), sorted."""
    return sorted({f.parent for f in files})


@dataclass(frozen=True)
class BandFile:
    """One band of a product: its single-band file and how its values become physical ones.

    Attributes:
        path: the file.
        scale: factor of the file's values; the physical value (reflectance, radiance, kelvin) is
            ``value * scale + offset``.
        offset: added after scaling.
        nodata: the value marking pixels without data, or None for the file's own.
    """

    path: Path
    scale: float = 1.0
    offset: float = 0.0
    nodata: float | None = None


@dataclass(frozen=True)
class QualityFiles:
    """A product's quality band, the generation its layout follows and, for Landsat Collection 2, its QA_RADSAT."""

    path: Path
    generation: str
    radsat: Path | None = None


@dataclass(frozen=True)
class Product:
    """One product (a scene): its bands by vocabulary name, and its quality band if it has one.

    Attributes:
        path: what identifies it (a SAFE folder, a scene folder, a STAC item, a scene's first band file).
        bands: the band files the layout found, by vocabulary name.
        quality: its quality band, or None.
    """

    path: Path
    bands: Mapping[str, BandFile] = field(default_factory=dict)
    quality: QualityFiles | None = None

    def band(self, name: str) -> BandFile:
        """The file of band ``name``.

        Raises:
            RasterReadError: the product has no such band.
        """
        if name not in self.bands:
            raise RasterReadError(self.path, f"has no {name} band; it holds {', '.join(self.bands) or 'no band'}")
        return self.bands[name]
