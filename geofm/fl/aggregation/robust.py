"""Aggregators: how the server combines a round's accepted client updates into one.

* ``mean``: the data-weighted mean (the default, FedAvg's).
* ``median``: the coordinate-wise median (Yin et al., "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates", ICML 2018); with an even count, the mean of the two middle
  values of each coordinate.
* ``trimmed_mean``: per coordinate, drop the ``floor(trim_fraction n)`` largest and as many smallest
  values and average the rest (Yin et al. 2018).
* ``krum``: each update's score is the sum of squared distances to its ``n - f - 2`` nearest other
  updates (``f = byzantine_clients``); the update with the lowest score is the result, or with
  ``multi_krum: m`` the mean of the ``m`` lowest (Blanchard et al., "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017). It needs ``n > 2f + 2``.

Each rule's own settings (``trim_fraction``, ``byzantine_clients``, ``multi_krum``) are its
``Options``, read from ``algorithm.aggregator.options``.

The mean streams: each update is decoded, added and freed. The median, the trimmed mean and Krum
need every update at once: they spill the decoded updates to a file under the run's folder and
read it back by blocks of coordinates (:mod:`~geofm.fl.communication.spill`), so the server's memory stays
flat in the number of clients either way.

The robust rules ignore the weights, as in the papers: a Byzantine client claims its example count
as freely as its update. They run after screening (:mod:`~geofm.fl.aggregation.uploads`), which
already drops malformed and outsized uploads. A round with too few accepted updates for the rule
raises :class:`TooFewUpdates`; :func:`~geofm.fl.aggregation.uploads.aggregate_uploads` then applies
no update that round.

A plug-in registers a class in the ``geofm.aggregators`` entry-point group: ``from_config(cfg:
AggregatorConfig)`` builds an object with ``combine(updates, weights) -> Tensor``; its ``Options``
(a pydantic model, optional) checks ``cfg.options``, read back by ``cfg.options_of()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from geofm.config.algorithm import AggregatorConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import Aggregator, TooFewUpdates, weighted_mean
from geofm.fl.communication.spill import SpilledUpdates
from geofm.registry import Registry

AGGREGATORS: Registry = Registry("aggregator", "geofm.aggregators")
"""Rules combining a round's accepted client updates into one (``algorithm.aggregator.name``)."""


class _Plain:
    """An aggregator without settings of its own."""

    @classmethod
    def from_config(cls, cfg: AggregatorConfig) -> Self:
        return cls()


class Mean(_Plain):
    """The data-weighted mean ``sum_i w_i u_i / sum_i w_i`` (FedAvg's, the default); it streams (one decoded
    update at a time)."""

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        return weighted_mean(updates, weights)


class Spilling(_Plain):
    """Base of the rules that need every update at once: they read them back from a spill file by blocks
    of coordinates (:class:`~geofm.fl.communication.spill.SpilledUpdates`) under :attr:`spill_dir` (the run's
    spill folder, set by :meth:`~geofm.fl.algorithms.base.Algorithm.spill_to`; None: the
    system's temporary folder)."""

    spill_dir: Path | None = None

    def spilled(self, updates: Sequence[Tensor]) -> SpilledUpdates:
        """The updates written to a spill file, read back with ``blocks()``; removed on exit."""
        return SpilledUpdates(updates, self.spill_dir)

    def by_block(self, updates: Sequence[Tensor], rule: Callable[[Tensor], Tensor]) -> Tensor:
        """``rule`` (rows x columns -> columns) applied block by block of the spilled updates."""
        with self.spilled(updates) as spill:
            result = torch.empty(spill.columns, dtype=torch.float32)
            for columns, block in spill.blocks():
                result[columns] = rule(block)
        return result


def _sorted(block: Tensor) -> Tensor:
    """Each column (coordinate) of a block of updates sorted ascending."""
    return torch.sort(block, dim=0).values


class Median(Spilling):
    """The coordinate-wise median (Yin et al. 2018); the mean of the two middle values for an even count. It
    spills."""

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        half = len(updates) // 2

        def median(block: Tensor) -> Tensor:
            ordered = _sorted(block)
            return ordered[half] if len(updates) % 2 else (ordered[half - 1] + ordered[half]) / 2

        return self.by_block(updates, median)


class TrimmedMeanOptions(BaseModel):
    """``trimmed_mean``'s settings (``algorithm.aggregator.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    trim_fraction: float = Field(
        default=0.1, ge=0.0, lt=0.5, description="share of the values dropped at each end, per coordinate"
    )


class TrimmedMean(Spilling):
    """The coordinate-wise mean after dropping the ``floor(trim_fraction n)`` largest and smallest values
    (Yin et al. 2018). It spills."""

    Options = TrimmedMeanOptions

    @classmethod
    def from_config(cls, cfg: AggregatorConfig) -> TrimmedMean:
        return cls(cfg.options_of().trim_fraction)

    def __init__(self, trim_fraction: float) -> None:
        if not 0.0 <= trim_fraction < 0.5:
            raise ConfigError(
                f"algorithm.aggregator.options.trim_fraction must be in [0, 0.5) so that a value is left, got {trim_fraction}"
            )
        self.trim_fraction = trim_fraction

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        cut = int(self.trim_fraction * len(updates))
        return self.by_block(updates, lambda block: _sorted(block)[cut : len(updates) - cut].mean(dim=0))


class KrumOptions(BaseModel):
    """``krum``'s settings (``algorithm.aggregator.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    byzantine_clients: int = Field(default=0, ge=0, description="f, the assumed number of Byzantine clients")
    multi_krum: int | None = Field(
        default=None, gt=0, description="average the m updates of lowest score; null: Krum's single best"
    )


class Krum(Spilling):
    """Krum (``multi_krum`` 1) or Multi-Krum, the mean of the ``multi_krum`` updates of lowest score, against
    ``byzantine_clients`` attackers (Blanchard et al. 2017). It spills: the pairwise distances and then the
    mean are summed block by block."""

    Options = KrumOptions

    @classmethod
    def from_config(cls, cfg: AggregatorConfig) -> Krum:
        options = cfg.options_of()
        return cls(options.byzantine_clients, options.multi_krum or 1)

    def __init__(self, byzantine_clients: int, multi_krum: int = 1) -> None:
        if byzantine_clients < 0 or multi_krum < 1:
            raise ConfigError(
                f"krum needs byzantine_clients >= 0 and multi_krum >= 1, got {byzantine_clients} and {multi_krum}"
            )
        self.f, self.m = byzantine_clients, multi_krum

    def scores(self, updates: Sequence[Tensor]) -> Tensor:
        """Each update's sum of squared distances to its ``n - f - 2`` nearest others (float64)."""
        self._check(len(updates))
        with self.spilled(updates) as spill:
            return self._scores(spill)

    def _check(self, n: int) -> None:
        if n <= 2 * self.f + 2:
            raise TooFewUpdates(
                f"krum with byzantine_clients f={self.f} needs more than 2f + 2 = {2 * self.f + 2} updates, got {n}"
            )

    def _scores(self, spill: SpilledUpdates) -> Tensor:
        n = spill.rows
        distances = torch.zeros(n, n, dtype=torch.float64)
        for _, block in spill.blocks():
            block = block.double()
            for i in range(n):
                distances[i] += torch.sum((block - block[i]) ** 2, dim=1)
        # Row i sorted ascending starts with its zero distance to itself; the next n - f - 2 are its nearest others.
        nearest = torch.sort(distances, dim=1).values[:, 1 : n - self.f - 1]
        return nearest.sum(dim=1)

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        self._check(len(updates))
        if self.m > len(updates):
            raise TooFewUpdates(f"multi_krum {self.m} averages more updates than the round's {len(updates)}")
        with self.spilled(updates) as spill:
            best = torch.sort(self._scores(spill), stable=True).indices[: self.m]
            result = torch.empty(spill.columns, dtype=torch.float32)
            for columns, block in spill.blocks():
                result[columns] = block[best].mean(dim=0)
        return result


AGGREGATORS.register("mean", Mean)
AGGREGATORS.register("median", Median)
AGGREGATORS.register("trimmed_mean", TrimmedMean)
AGGREGATORS.register("krum", Krum)


def build_aggregator(cfg: AggregatorConfig) -> Aggregator:
    """The aggregator ``cfg.name`` names."""
    return AGGREGATORS.get(cfg.name).from_config(cfg)


__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "Krum",
    "KrumOptions",
    "Mean",
    "Median",
    "Spilling",
    "TooFewUpdates",
    "TrimmedMean",
    "TrimmedMeanOptions",
    "build_aggregator",
]
