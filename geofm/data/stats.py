"""Per-band statistics of a source, for the ``mean`` and ``std`` of its configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geofm.config import SourceConfig
from geofm.data.readers import read_raster
from geofm.data.sources import list_images
from geofm.errors import ConfigError, DataMismatchError


@dataclass(frozen=True)
class BandStats:
    """Mean and standard deviation of ``raw * scale`` per band, over valid pixels.

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
    if max_files is not None:
        if max_files <= 0:
            raise ConfigError(f"max_files (--max-files) must be positive, got {max_files}")
        if max_files < len(files):
            picks = np.unique(np.linspace(0, len(files) - 1, max_files).round().astype(int))
            files = [files[i] for i in picks]

    count = np.zeros(len(bands), dtype=np.int64)
    mean = np.zeros(len(bands), dtype=np.float64)
    m2 = np.zeros(len(bands), dtype=np.float64)
    for path in files:
        raster = read_raster(path, len(bands), band_names=bands)
        for b, (raw, valid) in enumerate(zip(raster.data, raster.valid(nodata), strict=False)):
            x = raw[valid].astype(np.float64) * scale
            if x.size == 0:
                continue
            n, m = x.size, x.mean()
            total = count[b] + n
            delta = m - mean[b]
            m2[b] += ((x - m) ** 2).sum() + delta**2 * count[b] * n / total
            mean[b] += delta * n / total
            count[b] = total

    empty = [name for name, n in zip(bands, count, strict=False) if n == 0]
    if empty:
        raise DataMismatchError(
            f"bands {empty} have no valid pixel (all nodata or not finite) in the {len(files)} files read from {root}"
        )
    return BandStats(
        bands=list(bands),
        mean=mean.tolist(),
        std=np.sqrt(m2 / count).tolist(),
        pixels=count.tolist(),
        files=len(files),
    )


def compute_band_stats_for(cfg: SourceConfig, max_files: int | None = None) -> BandStats:
    """Per-band statistics of a configured source (its own ``mean`` and ``std`` are ignored).

    Args:
        cfg: the source.
        max_files: read at most this many files, evenly spaced.

    Returns:
        The statistics.
    """
    return compute_band_stats(
        root=cfg.root,
        pattern=cfg.pattern,
        bands=cfg.bands,
        scale=cfg.scale,
        nodata=cfg.nodata,
        max_files=max_files,
    )


def _yaml_float(value: float) -> str:
    """A number with 6 significant digits, written so that YAML 1.1 reads it back as a float."""
    text = f"{value:.6g}"
    if "e" in text and "." not in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def format_stats_yaml(stats: BandStats) -> str:
    """YAML lines ``mean: [...]`` and ``std: [...]`` to paste into the source's configuration.

    Values have 6 significant digits; a comment line names the bands and the number of files.
    """
    mean = ", ".join(_yaml_float(v) for v in stats.mean)
    std = ", ".join(_yaml_float(v) for v in stats.std)
    return f"# bands {', '.join(stats.bands)}; {stats.files} files\nmean: [{mean}]\nstd: [{std}]\n"
