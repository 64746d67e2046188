"""The multi-source pretraining pile, in the spirit of GeoPile.

Several imagery sources (aerial RGB, multispectral satellite scenes...) are mixed by weight into
one stream of samples. :class:`PileSampler` decides which file of which source each position of an
epoch holds and gives every position its own seed; :class:`PretrainPile` turns such an index into
an augmented, normalised sample. A sample is a pure function of its index, so the data order and
content do not depend on the number of DataLoader workers, and a run can resume mid-epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Dataset

from geofm.data.epochs import EpochShareSampler
from geofm.data.sources import ImageSource
from geofm.data.transforms import PretrainAugmentation
from geofm.errors import DatasetNotFoundError, InvalidChipError, RasterReadError

if TYPE_CHECKING:
    from geofm.config import DataConfig

logger = logging.getLogger("geofm.data")

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

UNREADABLE = "u"
"""Why a sample was passed over: its file could not be read (``data.on_bad_file: skip``)."""
MOSTLY_INVALID = "i"
"""Why a sample was passed over: its quality band marks more than ``quality.max_invalid_fraction`` invalid."""

# Tags that keep the random streams derived from one run seed apart.
_CHOICE, _WALK, _SAMPLE, _AUGMENT, _SHOWN = 1, 2, 3, 4, 5


def _splitmix64(x: int) -> int:
    """One step of the SplitMix64 generator: a bijective, well-mixing hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(*values: int) -> int:
    """Deterministic 63-bit seed derived from a sequence of integers."""
    h = 0
    for v in values:
        h = _splitmix64(h ^ (v & _MASK64))
    return h & _MASK63


class PileIndex(NamedTuple):
    """One sample of the pile: which file of which source, and the seed of its randomness."""

    source: int
    file: int
    sample_seed: int


class PileSampler(EpochShareSampler[PileIndex]):
    """Weighted, reproducible sampling of files across sources.

    Each epoch, every one of ``samples_per_epoch`` positions picks a source with probability
    proportional to its weight; within a source, files follow a random permutation, without
    replacement until the source is exhausted, then a new permutation. The epoch's positions are
    truncated to a multiple of ``world_size`` and rank ``r`` takes positions ``r, r + world_size, ...``.
    Everything is derived from ``(seed, epoch)``.
    """

    def __init__(
        self,
        source_sizes: list[int],
        weights: list[float],
        samples_per_epoch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """Initialise a new PileSampler instance.

        Args:
            source_sizes: number of files of each source.
            weights: relative sampling weight of each source.
            samples_per_epoch: samples of one epoch, over all ranks.
            seed: run seed.
            rank: this process's rank.
            world_size: number of processes sharing the epoch.

        Raises:
            ValueError: if the arguments are inconsistent or leave a rank without samples.
        """
        if len(source_sizes) != len(weights) or not source_sizes:
            raise ValueError(f"need one weight per source, got {len(source_sizes)} sources and {len(weights)} weights")
        if any(n <= 0 for n in source_sizes):
            raise ValueError(f"every source needs at least one file, got sizes {source_sizes}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"weights must be positive, got {weights}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if samples_per_epoch < world_size:
            raise ValueError(f"samples_per_epoch {samples_per_epoch} is smaller than world_size {world_size}")
        super().__init__(samples_per_epoch, seed, rank, world_size)
        self.source_sizes = list(source_sizes)
        self.weights = list(weights)
        self.samples_per_epoch = samples_per_epoch

    def epoch_plan(self, epoch: int) -> tuple[list[int], list[int]]:
        """Source and file of every position of an epoch, over all ranks.

        Args:
            epoch: the epoch.

        Returns:
            Two lists of length ``samples_per_epoch``: the source and the file of each position.
        """
        choice = torch.Generator().manual_seed(_mix(_CHOICE, self.seed, epoch))
        weights = torch.tensor(self.weights, dtype=torch.float64)
        sources = torch.multinomial(weights, self.samples_per_epoch, replacement=True, generator=choice)
        files = torch.empty_like(sources)
        for s, size in enumerate(self.source_sizes):
            where = (sources == s).nonzero(as_tuple=True)[0]
            if len(where) == 0:
                continue
            walk = torch.Generator().manual_seed(_mix(_WALK, self.seed, epoch, s))
            rounds = -(-len(where) // size)
            perms = [torch.randperm(size, generator=walk) for _ in range(rounds)]
            files[where] = torch.cat(perms)[: len(where)]
        return sources.tolist(), files.tolist()

    def __iter__(self) -> Iterator[PileIndex]:
        """Indices of this rank's share of the current epoch, from the start position on."""
        epoch = self.epoch
        sources, files = self.epoch_plan(epoch)
        positions = self._share()
        return (PileIndex(sources[p], files[p], _mix(_SAMPLE, self.seed, epoch, p)) for p in positions)


def shown_samples(source_sizes: list[int], count: int, seed: int) -> list[PileIndex]:
    """``count`` fixed samples to show a model's work on: the sources in turn, each source's files in
    an order drawn from ``seed``, each sample with a seed of its own, apart from the training epochs'
    (so its crop and mask are not the ones a training step sees)."""
    orders = [
        torch.randperm(size, generator=torch.Generator().manual_seed(_mix(_SHOWN, seed, s))).tolist()
        for s, size in enumerate(source_sizes)
    ]
    indices = []
    for k in range(count):
        source, turn = k % len(source_sizes), k // len(source_sizes)
        order = orders[source]
        indices.append(PileIndex(source, order[turn % len(order)], _mix(_SHOWN, seed, len(source_sizes), k)))
    return indices


class PretrainPile(Dataset[dict[str, Tensor | int | str]]):
    """Augmented, normalised samples of every source, indexed by :class:`PileIndex`.

    A sample is a dict with ``image`` (float32, C x img_size x img_size), ``valid`` (bool, same
    shape), ``mask`` (only with a ``mask_fn``), ``source`` (its position in ``cfg.sources``),
    ``file`` (the sample of that source it was drawn as), ``skipped`` (samples passed over to
    produce it: unreadable files, and chips whose quality band marks too many pixels invalid) and
    ``skip_reasons`` (one letter per sample passed over, in order: :data:`UNREADABLE` or
    :data:`MOSTLY_INVALID`) and ``skip_notes`` (a line naming each unreadable file passed over and why,
    for :func:`warn_skipped`). It depends on its index only.
    """

    def __init__(
        self,
        cfg: DataConfig,
        img_size: int,
        mask_fn: Callable[[torch.Generator], Tensor] | None = None,
        files: Sequence[Sequence[Path]] | None = None,
        views: Callable[[Tensor, Tensor], dict[str, Tensor]] | None = None,
    ) -> None:
        """Initialise a new PretrainPile instance.

        Args:
            cfg: the data configuration.
            img_size: side of the square samples, in pixels.
            mask_fn: draws a sample's mask from a generator seeded with its ``sample_seed``.
            files: per source of ``cfg.sources``, the files to use (a federated client's share);
                default every file matching each source's pattern.
            views: makes a sample's tensors from its (image, valid) in place of the crop and flips
                (e.g. DINO's :class:`~geofm.tasks.dino.views.MultiCrop`); its dict replaces ``image``
                and ``valid`` in the sample.

        Raises:
            DatasetNotFoundError: if a source's folder is missing or empty.
        """
        self.cfg = cfg
        shares = files if files is not None else [None] * len(cfg.sources)
        self.sources = [ImageSource(s, cfg.bands, share) for s, share in zip(cfg.sources, shares, strict=True)]
        self.augment = PretrainAugmentation(img_size, scale=cfg.crop_scale, hflip=cfg.hflip, vflip=cfg.vflip)
        self.mask_fn = mask_fn
        self.views = views

    @property
    def samples_per_epoch(self) -> int:
        """Samples of one epoch: ``cfg.samples_per_epoch``, or else the number of files of all sources."""
        return self.cfg.samples_per_epoch or sum(self.source_sizes)

    @property
    def source_sizes(self) -> list[int]:
        """Number of files of each source."""
        return [len(s) for s in self.sources]

    @property
    def weights(self) -> list[float]:
        """Sampling weight of each source."""
        return [s.cfg.weight for s in self.sources]

    def describe(self) -> str:
        """The sources with their sizes and folders, and the epoch length, for messages."""
        sources = ", ".join(f"{s.cfg.name} ({len(s)} samples under {s.cfg.root.resolve()})" for s in self.sources)
        epoch = f"; data.samples_per_epoch {self.cfg.samples_per_epoch}" if self.cfg.samples_per_epoch else ""
        return f"data.sources {sources}{epoch}"

    def _load(self, source: int, file: int) -> tuple[Tensor, Tensor, str, str]:
        """Load a sample, or the next of the same source that is readable (with ``on_bad_file="skip"``)
        and not mostly invalid; also say why each sample before it was passed over (its reason letters,
        and a line for each unreadable file)."""
        src = self.sources[source]
        reasons, notes = "", []
        for skipped in range(len(src)):
            try:
                image, valid = src.load((file + skipped) % len(src))
            except RasterReadError as exc:
                if self.cfg.on_bad_file == "error":
                    raise
                notes.append(f"source {src.name!r}: skipping {exc.path}: {exc.reason}")
                reasons += UNREADABLE
            except InvalidChipError as exc:
                logger.debug("source %r: skipping %s", src.name, exc)  # routine: counted, not warned
                reasons += MOSTLY_INVALID
            else:
                return image, valid, reasons, "\n".join(notes)
        if MOSTLY_INVALID in reasons:
            raise DatasetNotFoundError(
                f"source {src.name!r}: none of the {len(src)} samples of the products matching {src.cfg.pattern!r} "
                f"in {src.cfg.root} is readable with at most {src.cfg.quality.max_invalid_fraction} of its pixels "
                "invalid (quality.max_invalid_fraction)"
            )
        raise DatasetNotFoundError(
            f"source {src.name!r}: none of the {len(src)} files matching {src.cfg.pattern!r} "
            f"in {src.cfg.root} can be read"
        )

    def __getitem__(self, index: PileIndex) -> dict[str, Tensor | int | str]:
        """Load, augment and mask one sample.

        Args:
            index: which file of which source, and the sample's seed.

        Returns:
            The sample dict.

        Raises:
            RasterReadError: with ``on_bad_file="error"``, if the file cannot be read.
            DatasetNotFoundError: with ``on_bad_file="skip"``, if no file of the source can be read.
        """
        source, file, sample_seed = index
        image, valid, reasons, notes = self._load(source, file)
        with torch.random.fork_rng(devices=[]):
            # The CPU generator alone: torch.manual_seed would also queue seeds for every GPU
            # (recording a stack trace each time in a CUDA build), a large part of a small sample's cost.
            torch.default_generator.manual_seed(_mix(_AUGMENT, sample_seed))
            if self.views is None:
                image, valid = self.augment(image, valid)
                tensors = {"image": image, "valid": valid}
            else:
                tensors = self.views(image, valid)
        sample: dict[str, Tensor | int | str] = {
            **tensors,
            "source": source,
            "file": file,
            "skipped": len(reasons),
            "skip_reasons": reasons,
            "skip_notes": notes,
        }
        if self.mask_fn is not None:
            sample["mask"] = self.mask_fn(torch.Generator().manual_seed(sample_seed))
        return sample


def warn_skipped(batch: dict, warned: set[str]) -> None:
    """Warn of each unreadable file a collated batch of the pile passed over, unless ``warned`` holds
    its line already (the lines warned of are added): once per file, however often it is met."""
    for notes in batch["skip_notes"]:
        for note in notes.splitlines():
            if note not in warned:
                warned.add(note)
                logger.warning(note)


class SkippedFiles:
    """The unreadable files and the mostly invalid chips skipped so far, each counted once however
    often it is met, and each unreadable file warned of once (:func:`warn_skipped`).

    A sample of source ``s`` drawn as sample ``f`` that passed over ``k`` samples passed over
    ``f, f+1, ..., f+k-1`` (modulo the source's size), for the reasons its ``skip_reasons`` give
    in that order, see :meth:`PretrainPile._load`.
    """

    def __init__(self, source_sizes: list[int]) -> None:
        self.source_sizes = list(source_sizes)
        self.files: set[tuple[int, int]] = set()
        self.invalid: set[tuple[int, int]] = set()
        self.warned: set[str] = set()

    def add_batch(self, batch: dict) -> None:
        """Record the samples a collated batch skipped; warn of unreadable files not met before."""
        warn_skipped(batch, self.warned)
        for source, file, reasons in zip(
            batch["source"].tolist(), batch["file"].tolist(), batch["skip_reasons"], strict=True
        ):
            size = self.source_sizes[source]
            for k, reason in enumerate(reasons):
                (self.files if reason == UNREADABLE else self.invalid).add((source, (file + k) % size))

    def update(self, pairs: list[list[int]], invalid: list[list[int]] = ()) -> None:
        """Add ``[source, file]`` pairs of unreadable files and of mostly invalid chips (from a
        checkpoint's progress record)."""
        self.files.update((int(s), int(f)) for s, f in pairs)
        self.invalid.update((int(s), int(f)) for s, f in invalid)
