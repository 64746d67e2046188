"""A chip store: prepared shards of decoded chips, read back without decoding.

``geofm data prepare`` (:mod:`geofm.data.prepare`) reads a pretraining source of any layout once and
writes its chips here; a source with ``layout: chips`` reads them back, and :class:`ChipDataset`
feeds a GPU from them. A store is a folder:

* ``index.json``: the bands, the chip size, the source it was prepared from, whether it is
  complete, and each shard's name, number of chips, dtype and the source sample after its last;
* per shard ``NNNNN``: ``NNNNN.pixels.npy`` (chips, bands, size, size) of raw values in the
  source's dtype (0 where invalid), ``NNNNN.valid.npy`` of the same shape (bool: the valid mask
  travels with each chip, nodata and quality band applied), and ``NNNNN.chips.npy``, one record per chip: the source
  sample it came from and its bands' ``scale`` and ``offset`` (physical = raw * scale + offset).

Plain ``.npy`` files, memory-mapped, give zero-copy random access to any chip and any crop of it: a
read touches only the crop's pages, with no decoding and no dependency beyond numpy. A shard is
written under a temporary name and renamed, then the index is replaced, so a killed ``prepare``
leaves only finished shards and continues after the last. This module imports only numpy, torch
and the standard library, so a machine without the raster stack reads stores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from geofm.data.epochs import EpochShareSampler
from geofm.errors import DataMismatchError, DatasetNotFoundError, RasterReadError

FORMAT = "geofm-chips"
VERSION = 1
INDEX = "index.json"
PIXELS, VALID, CHIPS = ".pixels.npy", ".valid.npy", ".chips.npy"


def _records(bands: int) -> np.dtype:
    """The dtype of a shard's per-chip records."""
    return np.dtype([("sample", np.int64), ("scale", np.float32, (bands,)), ("offset", np.float32, (bands,))])


@dataclass(frozen=True)
class Shard:
    """One shard of a store: its name, its number of chips, the dtype of its pixels, and the source
    sample after its last chip (where a resumed ``prepare`` continues)."""

    name: str
    chips: int
    dtype: str
    next_sample: int


def _write_json(path: Path, tree: dict[str, Any]) -> None:
    """Write ``tree`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(tree, indent=1))
    os.replace(tmp, path)


def _read_index(root: Path) -> dict[str, Any]:
    """The index of the store at ``root``.

    Raises:
        DatasetNotFoundError: it has no index, or the index is not a chip store's.
    """
    path = Path(root) / INDEX
    if not path.is_file():
        raise DatasetNotFoundError(f"{path.resolve()}: no chip store index (write the store with geofm data prepare)")
    try:
        tree = json.loads(path.read_text())
        ok = tree.get("format") == FORMAT and isinstance(tree.get("shards"), list)
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise DatasetNotFoundError(f"{path.resolve()}: not a chip store index written by geofm data prepare")
    if tree.get("version") != VERSION:
        raise DatasetNotFoundError(f"{path.resolve()}: chip store version {tree.get('version')}, expected {VERSION}")
    return tree


class ChipStore:
    """A complete store, read by memory-mapping its shards (each opened once per process, when first read).

    Args:
        root: the store's folder.

    Raises:
        DatasetNotFoundError: it has no index, it is incomplete, or a shard's files are missing.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        tree = _read_index(self.root)
        self.index_path = self.root / INDEX
        if not tree.get("complete"):
            name = tree["source"].get("name") if isinstance(tree.get("source"), dict) else None
            raise DatasetNotFoundError(
                f"{self.root.resolve()}: the chip store is unfinished: its geofm data prepare stopped after "
                f"{len(tree['shards'])} shard(s); finish it by running that geofm data prepare again (--config and "
                f"overrides as before, --source {name} --chip-size {tree['size']} --out {self.root.resolve()}), "
                "which continues after its last shard"
            )
        self.bands: list[str] = list(tree["bands"])
        self.size: int = int(tree["size"])
        self.shards = [Shard(**s) for s in tree["shards"]]
        self._by_path = {self.root / f"{s.name}{PIXELS}": s for s in self.shards}
        for path in (self.root / f"{s.name}{suffix}" for s in self.shards for suffix in (PIXELS, VALID, CHIPS)):
            if not path.is_file():
                raise DatasetNotFoundError(f"{path.resolve()}: shard file of the chip store {self.root} is missing")
        self._open: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """The store without its open maps: a worker started by spawn maps the shards itself rather
        than receiving their pixels."""
        return {**self.__dict__, "_open": {}}

    def shard_paths(self) -> list[Path]:
        """Each shard's pixels file: what a source lists, and what federated partitions deal out."""
        return list(self._by_path)

    def shard(self, path: Path) -> Shard:
        """The shard whose pixels file is ``path``.

        Raises:
            DatasetNotFoundError: ``path`` is not a shard of this store.
        """
        shard = self._by_path.get(Path(path))
        if shard is None:
            raise DatasetNotFoundError(f"{path}: not a shard of the chip store {self.root} ({INDEX} does not list it)")
        return shard

    def _arrays(self, shard: Shard) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shard's pixels, valid mask and records, memory-mapped (checked against the index once).

        Raises:
            RasterReadError: a file of the shard is not the ``.npy`` array the index describes.
        """
        if shard.name not in self._open:
            shape = (shard.chips, len(self.bands), self.size, self.size)
            expected = {
                PIXELS: (shape, np.dtype(shard.dtype)),
                VALID: (shape, np.dtype(bool)),
                CHIPS: ((shard.chips,), _records(len(self.bands))),
            }
            arrays = []
            for suffix, (want_shape, want_dtype) in expected.items():
                path = self.root / f"{shard.name}{suffix}"
                try:
                    array = np.load(path, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError) as exc:
                    raise RasterReadError(path, f"is not a readable .npy array ({exc})") from None
                if array.shape != want_shape or array.dtype != want_dtype:
                    raise RasterReadError(
                        path,
                        f"holds {array.dtype} {array.shape}; {self.index_path} says {want_dtype} {want_shape}",
                    )
                arrays.append(array.view(np.ndarray))  # plain views of the map: np.memmap indexes slowly
            self._open[shard.name] = tuple(arrays)
        return self._open[shard.name]

    def read(
        self, path: Path, chip: int, bands: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Chip ``chip`` of the shard whose pixels file is ``path``, in ``bands`` (positions in :attr:`bands`, default all).

        Returns:
            Its raw pixels and valid mask (bands, size, size), and its bands' scale and offset.

        Raises:
            DatasetNotFoundError: ``path`` is not a shard of this store.
            RasterReadError: a file of the shard does not match the index.
        """
        return self.read_chip(self.shard(path), chip, bands)

    def read_chip(
        self, shard: Shard, chip: int, bands: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`read` of a shard given by its :class:`Shard` (one of :attr:`shards`)."""
        pixels, valid, records = self._arrays(shard)
        picks = slice(None) if bands is None else list(bands)
        record = records[chip]
        return pixels[chip][picks], valid[chip][picks], record["scale"][picks], record["offset"][picks]

    def sample_of(self, path: Path, chip: int) -> int:
        """The source sample chip ``chip`` of the shard ``path`` was prepared from."""
        return int(self._arrays(self.shard(path))[2][chip]["sample"])


class ChipWriter:
    """Writes a store shard by shard; opened on a store a killed run left, it continues after its last shard.
    The folder is created with the first shard (or an empty store's index), so that a prepare failing
    before leaves none behind.

    Args:
        root: the store's folder.
        bands: band names of the chips, in order.
        size: side of the chips, in pixels.
        chips_per_shard: chips of each shard (the last may hold fewer).
        source: what the store is prepared from (JSON-able); a store being resumed must say the same.

    Raises:
        DataMismatchError: ``root`` holds a store of other bands, size or source.
    """

    def __init__(
        self, root: str | Path, bands: Sequence[str], size: int, chips_per_shard: int, source: dict[str, Any]
    ) -> None:
        self.root = Path(root)
        self.tree: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "bands": list(bands),
            "size": int(size),
            "chips_per_shard": int(chips_per_shard),
            "source": source,
            "complete": False,
            "shards": [],
        }
        if (self.root / INDEX).exists():
            old = _read_index(self.root)
            for key in ("bands", "size", "chips_per_shard", "source"):
                if old.get(key) != self.tree[key]:
                    raise DataMismatchError(
                        f"{(self.root / INDEX).resolve()}: {key} is {old.get(key)!r}, this prepare's is "
                        f"{self.tree[key]!r}; write the store to another folder or delete this one"
                    )
            self.tree = old
        self._buffer: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    @property
    def complete(self) -> bool:
        """Whether the store was finished."""
        return bool(self.tree["complete"])

    @property
    def next_sample(self) -> int:
        """The source sample to continue from: the one after the last finished shard's last chip."""
        shards = self.tree["shards"]
        return shards[-1]["next_sample"] if shards else 0

    @property
    def chips(self) -> int:
        """Chips written in finished shards."""
        return sum(s["chips"] for s in self.tree["shards"])

    def add(self, sample: int, pixels: np.ndarray, valid: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> None:
        """Add the chip of source sample ``sample``; a full shard is written.

        Args:
            sample: the source sample it is.
            pixels: raw values (bands, size, size); invalid ones are stored as 0.
            valid: bool mask of the same shape.
            scale: per band, factor of the raw values.
            offset: per band, added after scaling.
        """
        self._buffer.append((sample, np.where(valid, pixels, 0), valid, scale, offset))
        if len(self._buffer) == self.tree["chips_per_shard"]:
            self.flush()

    def flush(self) -> None:
        """Write the chips added since the last shard as one shard, then the index."""
        if not self._buffer:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        samples, pixels, valid, scale, offset = zip(*self._buffer, strict=True)
        name = f"{len(self.tree['shards']):05d}"
        records = np.zeros(len(samples), dtype=_records(len(self.tree["bands"])))
        records["sample"], records["scale"], records["offset"] = samples, scale, offset
        stacked = np.stack(pixels)
        for suffix, array in ((PIXELS, stacked), (VALID, np.stack(valid).astype(bool)), (CHIPS, records)):
            tmp = self.root / f"{name}{suffix}.tmp"
            with tmp.open("wb") as f:
                np.save(f, array, allow_pickle=False)
            os.replace(tmp, self.root / f"{name}{suffix}")
        shard = Shard(name, len(samples), stacked.dtype.str, samples[-1] + 1)
        self.tree["shards"].append(shard.__dict__)
        _write_json(self.root / INDEX, self.tree)
        self._buffer = []

    def finish(self) -> Path:
        """Write the last shard and mark the store complete; returns its folder."""
        self.flush()
        self.root.mkdir(parents=True, exist_ok=True)
        self.tree["complete"] = True
        _write_json(self.root / INDEX, self.tree)
        return self.root


def write_synthetic_store(root: Path, count: int, bands: list[str], size: int, seed: int = 0) -> Path:
    """A store of ``count`` random uint16 chips of ``size`` px (values 1..10000 of scale 1e-4), for
    benchmarks and tests; a few pixels are 0 and invalid. A store it wrote before is finished or
    left as it is. Returns its folder."""
    writer = ChipWriter(root, bands, size, chips_per_shard=256, source={"synthetic": {"count": count, "seed": seed}})
    scale, offset = np.full(len(bands), 1e-4, dtype=np.float32), np.zeros(len(bands), dtype=np.float32)
    for sample in range(writer.next_sample, count):
        pixels = np.random.default_rng((seed, sample)).integers(0, 10001, (len(bands), size, size), dtype=np.uint16)
        writer.add(sample, pixels, pixels != 0, scale, offset)
    return writer.finish()


class ChipDataset(Dataset[dict[str, Tensor]]):
    """Every chip of a store, randomly cropped to ``size``, flipped and normalised: the GPU-feeding loader.

    Item ``i`` is chip ``i % len(self)`` with a crop and flips drawn from ``(seed, i)``: a pure function
    of its index, so :class:`ChipSampler` gives each epoch its own crops by indexing past ``len(self)``.
    Only the crop's pixels are read from the memory-mapped shard.

    Args:
        root: the store's folder.
        size: side of the crops, at most the store's chip size.
        mean: per band of the store, mean of the physical values.
        std: per band, their standard deviation.
        hflip: flip left-right with probability 0.5.
        vflip: flip top-bottom with probability 0.5.
        seed: seed of the crops and flips.

    Raises:
        DatasetNotFoundError: the store is missing, incomplete or lacks a shard file.
        DataMismatchError: ``size`` exceeds the store's chips, or ``mean``/``std`` do not give one value per band.
    """

    def __init__(
        self,
        root: Path,
        size: int,
        mean: Sequence[float],
        std: Sequence[float],
        hflip: bool = True,
        vflip: bool = True,
        seed: int = 0,
    ) -> None:
        self.store = ChipStore(root)
        if size > self.store.size:
            raise DataMismatchError(
                f"{self.store.index_path}: its chips are {self.store.size} px, smaller than {size} px crops"
            )
        bands = len(self.store.bands)
        if len(mean) != bands or len(std) != bands:
            raise DataMismatchError(
                f"{self.store.index_path}: the store holds {bands} bands {self.store.bands}; "
                f"mean and std give {len(mean)} and {len(std)} values"
            )
        self.size, self.hflip, self.vflip, self.seed = size, hflip, vflip, seed
        self._mean = np.asarray(mean, dtype=np.float32)
        self._std = np.asarray(std, dtype=np.float32)
        self._chips = [(shard, k) for shard in self.store.shards for k in range(shard.chips)]

    def __len__(self) -> int:
        """Chips of the store."""
        return len(self._chips)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """Chip ``index % len(self)``, cropped and flipped as drawn from ``(seed, index)``.

        Returns:
            ``image`` (float32, (bands, size, size), normalised, 0 where invalid) and ``valid`` (bool, same shape).
        """
        shard, k = self._chips[index % len(self._chips)]
        pixels, valid, scale, offset = self.store.read_chip(shard, k)
        rng = np.random.default_rng((self.seed, index))
        top, left = rng.integers(0, self.store.size - self.size + 1, 2)
        flip_h, flip_v = rng.random(2) < 0.5
        window = (slice(None), slice(top, top + self.size), slice(left, left + self.size))
        # Contiguous copies of the crop, normalised in place (invalid pixels are stored as 0, so
        # multiplying by the mask zeroes them), flipped in torch: numpy copies reversed strides slowly.
        image = pixels[window].astype(np.float32)
        valid = valid[window].copy()
        image *= (scale / self._std)[:, None, None]
        image += ((offset - self._mean) / self._std)[:, None, None]
        image *= valid
        image, valid = torch.from_numpy(image), torch.from_numpy(valid)
        dims = [d for d, flip in ((2, self.hflip and flip_h), (1, self.vflip and flip_v)) if flip]
        if dims:
            image, valid = image.flip(dims), valid.flip(dims)
        return {"image": image, "valid": valid}


class ChipSampler(EpochShareSampler[int]):
    """This process's share of each epoch of a :class:`ChipDataset`: every chip once, in an order drawn
    from ``(seed, epoch)``, as indices ``epoch * chips + chip`` (so each epoch crops anew).

    Dealt among ranks and resumable mid-epoch as the pile's sampler (:class:`~geofm.data.epochs.EpochShareSampler`).
    """

    def __init__(self, chips: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        """Initialise the share of rank ``rank`` of ``world_size`` of epochs of ``chips`` chips, from ``seed``."""
        super().__init__(chips, seed, rank, world_size)
        self.chips = chips

    def __iter__(self) -> Iterator[int]:
        """Indices of this rank's share of the current epoch, from the start position on."""
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.chips)
        base = self.epoch * self.chips
        return (base + int(order[p]) for p in self._share())
