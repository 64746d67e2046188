"""``geofm data prepare``: a pretraining source of any layout written once as a chip store.

Each sample of the source cut into ``size`` px chips (:func:`geofm.data.sources.chips_of`) is read as
a training run reads it, in the source's own bands, and stored raw with its valid mask (nodata,
non-finite pixels and the quality band applied) and its bands' scaling; a chip smaller than
``size`` (the edge of a file smaller than a chip) is padded with invalid pixels, and chips whose
quality band marks more than ``quality.max_invalid_fraction`` invalid are left out, as the pile
would pass over them, and so are the chips of a file that cannot be read where the config's
``data.on_bad_file`` is ``skip``. Worker processes may read the source while this one writes the chips in
order. A killed run, started again with the same arguments, continues after the last finished shard.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from torch.utils.data import DataLoader, Dataset

from geofm.data.chipstore import ChipWriter
from geofm.data.layouts import PRODUCT_LAYOUTS
from geofm.data.sources import ImageSource
from geofm.errors import ConfigError, DatasetNotFoundError, InvalidChipError, OutputPathError, RasterReadError
from geofm.runlog import progress_bar

if TYPE_CHECKING:
    from geofm.config import SourceConfig

logger = logging.getLogger("geofm.data")


def _padded(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` (bands, h, w) padded with zeros (False) at its bottom and right to (bands, size, size)."""
    _, height, width = array.shape
    return np.pad(array, ((0, 0), (0, size - height), (0, size - width)))


class _Chips(Dataset):
    """Sample ``i`` of a source as a chip to store: ``(i, (pixels, valid, scale, offset))``; ``(i, None)``
    for a sample its quality band marks mostly invalid; with ``skip_unreadable``, ``(i, why)`` for one
    whose file cannot be read (what the pile warns: ``"skipping FILE: REASON"``)."""

    def __init__(self, source: ImageSource, size: int, skip_unreadable: bool) -> None:
        self.source, self.size, self.skip_unreadable = source, size, skip_unreadable

    def __getitem__(self, sample: int) -> tuple[int, tuple[np.ndarray, ...] | str | None]:
        try:
            raw = self.source.read(sample)
        except InvalidChipError:
            return sample, None
        except RasterReadError as err:
            if not self.skip_unreadable:
                raise
            return sample, f"skipping {err.path}: {err.reason}"
        return sample, (_padded(raw.data, self.size), _padded(raw.valid_mask(), self.size), raw.scale, raw.offset)


def _as_is(item: Any) -> Any:
    """A DataLoader's collate function that leaves numpy arrays as they are."""
    return item


def source_record(cfg: SourceConfig) -> dict[str, Any]:
    """What a store records of the source it was prepared from (a resumed run must say the same)."""
    return cfg.model_dump(mode="json", exclude={"mean", "std", "weight"})


def prepare_store(
    cfg: SourceConfig,
    out: Path,
    size: int,
    chips_per_shard: int = 256,
    workers: int = 0,
    progress: bool = True,
    on_bad_file: Literal["error", "skip"] = "error",
) -> dict[str, Any]:
    """Write source ``cfg`` as a chip store of ``size`` px chips at ``out``, or finish one a killed run left.

    Args:
        cfg: the source (any layout but ``chips``); its ``chip_size`` is replaced by ``size``.
        out: the store's folder.
        size: side of the chips, in pixels.
        chips_per_shard: chips of each shard file.
        workers: processes reading the source beside this one, which writes the chips in order (0: none).
        progress: show a progress bar of the source's samples on stderr.
        on_bad_file: what a training run's ``data.on_bad_file`` says of a file that cannot be read: stop
            (``error``), or leave out its chips with one warning per file (``skip``).

    Returns:
        A summary: the store, its chips and shards, the samples read and left out (mostly invalid, or
        unreadable), seconds and chips/s.

    Raises:
        ConfigError: ``cfg`` is a chip store already, ``size`` or ``chips_per_shard`` is not positive, or
            ``workers`` is negative.
        OutputPathError: ``out`` is a file.
        DataMismatchError: ``out`` holds a store prepared from another source or with other settings.
        RasterReadError: with ``on_bad_file`` ``error``, a file of the source cannot be read.
        DatasetNotFoundError: with ``skip``, no sample of the source can be read.
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
    unreadable, warned = 0, set()
    if not writer.complete:
        with progress_bar(len(source), start, progress, f"prepare {cfg.name}", unit="sample") as bar:
            samples = range(start, len(source))
            dataset = _Chips(source, size, skip_unreadable=on_bad_file == "skip")
            chips = DataLoader(dataset, batch_size=None, sampler=samples, num_workers=workers, collate_fn=_as_is)
            for sample, chip in chips:
                if chip is None:
                    left_out += 1
                elif isinstance(chip, str):
                    unreadable += 1
                    if chip not in warned:  # once per file, however many of its chips
                        warned.add(chip)
                        logger.warning("source %r: %s", cfg.name, chip)
                else:
                    writer.add(sample, *chip)
                    written += 1
                bar.update()
        if samples and unreadable == len(samples):
            raise DatasetNotFoundError(
                f"source {cfg.name!r}: none of the {len(samples)} samples of {cfg.root.resolve()} can be read"
            )
        writer.finish()
    seconds = time.perf_counter() - started
    return {
        "store": str(out),
        "chips": writer.chips,
        "shards": len(writer.tree["shards"]),
        "samples": len(source),
        "resumed_at_sample": start,
        "left_out_mostly_invalid": left_out,
        "left_out_unreadable": unreadable,
        "seconds": seconds,
        "chips_per_s": written / seconds if written else None,
    }
