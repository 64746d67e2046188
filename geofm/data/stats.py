"""Per-band statistics of a source, for the ``mean`` and ``std`` of its configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from geofm.data.products import list_images
from geofm.data.readers import read_raster
from geofm.errors import ConfigError, DataMismatchError

if TYPE_CHECKING:
    from geofm.config import SourceConfig


@dataclass(frozen=True)
class BandStats:
    """Mean and standard deviation of the physical values (``raw * scale``...) per band, over valid pixels.

    Attributes:
        bands: band names, in the file's band order.
        mean: mean of each band.
        std: population standard deviation of each band.
        pixels: number of valid pixels of each band.
        files: number of files read.
    """

    bands: list[str]
    mean: list[float]
    std: list[float]
    pixels: list[int]
    files: int


class _Moments:
    """Per-band count, mean and sum of squared deviations, merged sample by sample in float64 (Chan et al.)."""

    def __init__(self, bands: int) -> None:
        self.count = np.zeros(bands, dtype=np.int64)
        self.mean = np.zeros(bands, dtype=np.float64)
        self.m2 = np.zeros(bands, dtype=np.float64)

    def add(self, band: int, x: np.ndarray) -> None:
        """Merge the values ``x`` of one band."""
        if x.size == 0:
            return
        x = x.astype(np.float64, copy=False)
        n, m = x.size, x.mean()
        total = self.count[band] + n
        delta = m - self.mean[band]
        self.m2[band] += ((x - m) ** 2).sum() + delta**2 * self.count[band] * n / total
        self.mean[band] += delta * n / total
        self.count[band] = total

    def stats(self, bands: list[str], files: int, where: object) -> BandStats:
        """The statistics so far.

        Raises:
            DataMismatchError: if a band has no valid pixel.
        """
        empty = [name for name, n in zip(bands, self.count, strict=False) if n == 0]
        if empty:
            raise DataMismatchError(
                f"bands {empty} have no valid pixel (all nodata or not finite) in the {files} files read from {where}"
            )
        return BandStats(
            bands=list(bands),
            mean=self.mean.tolist(),
            std=np.sqrt(self.m2 / self.count).tolist(),
            pixels=self.count.tolist(),
            files=files,
        )


def _evenly_spaced(count: int, most: int | None) -> list[int]:
    """Indices of at most ``most`` of ``count`` items, evenly spaced (all of them without ``most``).

    Raises:
        ConfigError: if ``most`` is not positive.
    """
    if most is None:
        return list(range(count))
    if most <= 0:
        raise ConfigError(f"max_files (--max-files) must be positive, got {most}")
    if most >= count:
        return list(range(count))
    return np.unique(np.linspace(0, count - 1, most).round().astype(int)).tolist()


def compute_band_stats(
    *,
    root: str | Path,
    pattern: str,
    bands: list[str],
    scale: float = 1.0,
    nodata: float | None = None,
    max_files: int | None = None,
) -> BandStats:
    """Stream over a source's files and compute per-band mean and standard deviation.

    Pixels equal to the nodata value (``nodata``, else the file's own) and non-finite pixels are
    left out. Per-file moments are merged in float64 (Chan et al.), one file in memory at a time.

    Args:
        root: the source's folder, or one file (``pattern`` is then not used).
        pattern: glob of its files below ``root``.
        bands: band names, in the file's band order.
        scale: multiplies raw values before the statistics are taken.
        nodata: overrides the files' own nodata value.
        max_files: read at most this many files, evenly spaced over the sorted list.

    Returns:
        The statistics.

    Raises:
        DatasetNotFoundError: if ``root`` is neither a file nor a folder, or no file matches.
        RasterReadError: if a file cannot be read or holds another number of bands.
        ConfigError: if ``max_files`` is not positive.
        DataMismatchError: if a band has no valid pixel.
    """
    files = [Path(root)] if Path(root).is_file() else list_images(root, pattern)
    files = [files[i] for i in _evenly_spaced(len(files), max_files)]
    moments = _Moments(len(bands))
    for path in files:
        raster = read_raster(path, len(bands), band_names=bands)
        for b, (raw, valid) in enumerate(zip(raster.data, raster.valid(nodata), strict=False)):
            moments.add(b, raw[valid].astype(np.float64) * scale)
    return moments.stats(bands, len(files), root)


def compute_band_stats_for(cfg: SourceConfig, max_files: int | None = None) -> BandStats:
    """Per-band statistics of a configured source's physical values (its own ``mean`` and ``std`` are ignored).

    The values are the ones the source normalises: ``raw * scale + offset``, or a product's own
    scaling; nodata, non-finite pixels and those a quality band flags are left out (and no sample
    is passed over for having too many).

    Args:
        cfg: the source, of any layout.
        max_files: read at most this many samples (files, products or chips), evenly spaced.

    Returns:
        The statistics.

    Raises:
        DatasetNotFoundError: if the source's folder is missing or holds no file or product.
        RasterReadError: if a sample cannot be read.
        ConfigError: if ``max_files`` is not positive.
        DataMismatchError: if a band has no valid pixel.
    """
    from geofm.data.sources import ImageSource  # torch: `geofm data stats` on a folder goes without it

    n = len(cfg.bands)
    quality = cfg.quality.model_copy(update={"max_invalid_fraction": 1.0}) if cfg.quality else None
    plain = cfg.model_copy(update={"mean": [0.0] * n, "std": [1.0] * n, "quality": quality})
    source = ImageSource(plain, cfg.bands)
    picks = _evenly_spaced(len(source), max_files)
    moments = _Moments(n)
    for index in picks:
        image, valid = source.load(index)
        for b in range(n):
            moments.add(b, image[b][valid[b]].numpy())
    return moments.stats(cfg.bands, len(picks), cfg.root)


def _yaml_float(value: float) -> str:
    """A number with 6 significant digits, written so that YAML 1.1 reads it back as a float."""
    text = f"{value:.6g}"
    if "e" in text and "." not in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def format_stats_yaml(stats: BandStats, counted: str = "files") -> str:
    """YAML lines ``mean: [...]`` and ``std: [...]`` to paste into the source's configuration.

    Values have 6 significant digits; a comment line names the bands and the number of ``counted``
    read (files, or a configured source's samples).
    """
    mean = ", ".join(_yaml_float(v) for v in stats.mean)
    std = ", ".join(_yaml_float(v) for v in stats.std)
    return f"# bands {', '.join(stats.bands)}; {stats.files} {counted}\nmean: [{mean}]\nstd: [{std}]\n"
