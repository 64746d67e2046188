"""``geofm data prepare``: a pretraining source of any layout written once as a chip store.

Each sample of the source cut into ``size`` px chips (:func:`geofm.data.sources.chips_of`) is read as
a training run reads it, in the source's own bands, and stored raw with its valid mask (nodata,
non-finite pixels and the quality band applied) and its bands' scaling; a chip smaller than
``size`` (the edge of a file smaller than a chip) is padded with invalid pixels, and chips whose
quality band marks more than ``quality.max_invalid_fraction`` invalid are left out, as the pile
would pass over them. Worker processes may read the source while this one writes the chips in
order. A killed run, started again with the same arguments, continues after the last finished shard.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from geofm.config import SourceConfig
from geofm.data.chipstore import ChipWriter
from geofm.data.layouts import PRODUCT_LAYOUTS
from geofm.data.sources import ImageSource
from geofm.errors import ConfigError, InvalidChipError, OutputPathError
from geofm.runlog import progress_bar


def _padded(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` (bands, h, w) padded with zeros (False) at its bottom and right to (bands, size, size)."""
    _, height, width = array.shape
    return np.pad(array, ((0, 0), (0, size - height), (0, size - width)))


class _Chips(Dataset):
    """Sample ``i`` of a source as a chip to store: ``(i, (pixels, valid, scale, offset))``, or ``(i, None)``
    for a sample its quality band marks mostly invalid."""

    def __init__(self, source: ImageSource, size: int) -> None:
        self.source, self.size = source, size

    def __getitem__(self, sample: int) -> tuple[int, tuple[np.ndarray, ...] | None]:
        try:
            raw = self.source.read(sample)
        except InvalidChipError:
            return sample, None
        return sample, (_padded(raw.data, self.size), _padded(raw.valid_mask(), self.size), raw.scale, raw.offset)


def _as_is(item: Any) -> Any:
    """A DataLoader's collate function that leaves numpy arrays as they are."""
    return item


def source_record(cfg: SourceConfig) -> dict[str, Any]:
    """What a store records of the source it was prepared from (a resumed run must say the same)."""
    return cfg.model_dump(mode="json", exclude={"mean", "std", "weight"})


def prepare_store(
    cfg: SourceConfig, out: Path, size: int, chips_per_shard: int = 256, workers: int = 0, progress: bool = True
) -> dict[str, Any]:
    """Write source ``cfg`` as a chip store of ``size`` px chips at ``out``, or finish one a killed run left.

    Args:
        cfg: the source (any layout but ``chips``); its ``chip_size`` is replaced by ``size``.
        out: the store's folder.
        size: side of the chips, in pixels.
        chips_per_shard: chips of each shard file.
        workers: processes reading the source beside this one, which writes the chips in order (0: none).
        progress: show a progress bar of the source's samples on stderr.

    Returns:
        A summary: the store, its chips and shards, the samples read and left out, seconds and chips/s.

    Raises:
        ConfigError: ``cfg`` is a chip store already, ``size`` or ``chips_per_shard`` is not positive, or
            ``workers`` is negative.
        OutputPathError: ``out`` is a file.
        DataMismatchError: ``out`` holds a store prepared from another source or with other settings.
        RasterReadError: a file of the source cannot be read.
    """
    if PRODUCT_LAYOUTS.get(cfg.layout).reads == "chips":
        raise ConfigError(
            f"source {cfg.name!r} is a chip store already (layout {cfg.layout}); prepare its source instead"
        )
    if size <= 0 or chips_per_shard <= 0 or workers < 0:
        raise ConfigError(
            f"chip size and chips per shard must be positive and workers at least 0, got {size}, {chips_per_shard} "
            f"and {workers}"
        )
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{out}: the chip store's folder is a file")
    cfg = cfg.model_copy(update={"chip_size": size})
    writer = ChipWriter(out, cfg.bands, size, chips_per_shard, source_record(cfg))
    source = ImageSource(cfg, cfg.bands)
    start, written, left_out, started = writer.next_sample, 0, 0, time.perf_counter()
    if not writer.complete:
        with progress_bar(len(source), start, progress, f"prepare {cfg.name}", unit="sample") as bar:
            samples = range(start, len(source))
            chips = DataLoader(
                _Chips(source, size), batch_size=None, sampler=samples, num_workers=workers, collate_fn=_as_is
            )
            for sample, chip in chips:
                if chip is None:
                    left_out += 1
                else:
                    writer.add(sample, *chip)
                    written += 1
                bar.update()
        writer.finish()
    seconds = time.perf_counter() - started
    return {
        "store": str(out),
        "chips": writer.chips,
        "shards": len(writer.tree["shards"]),
        "samples": len(source),
        "resumed_at_sample": start,
        "left_out_mostly_invalid": left_out,
        "seconds": seconds,
        "chips_per_s": written / seconds if written else None,
    }
