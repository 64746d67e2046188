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

The mean streams: each update is decoded, added and freed. The median, the trimmed mean and Krum
need every update at once: they spill the decoded updates to a file under the run's folder and
read it back by blocks of coordinates (:mod:`~geofm.federated.communication.spill`), so the server's memory stays
flat in the number of clients either way.

The robust rules ignore the weights, as in the papers: a Byzantine client claims its example count
as freely as its update. They run after screening (:mod:`~geofm.federated.aggregation.uploads`), which
already drops malformed and outsized uploads. A round with too few accepted updates for the rule
raises :class:`TooFewUpdates`; :func:`~geofm.federated.aggregation.uploads.aggregate_uploads` then applies
no update that round.

A plug-in registers a factory ``(cfg: AggregatorConfig) ->`` an object with
``combine(updates, weights) -> Tensor`` in the ``geofm.aggregators`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from geofm.config.algorithm import AggregatorConfig
from geofm.errors import ConfigError
from geofm.federated.aggregation.uploads import Aggregator, TooFewUpdates, weighted_mean
from geofm.federated.communication.spill import SpilledUpdates
from geofm.registry import Registry

AGGREGATORS: Registry = Registry("aggregator", "geofm.aggregators")
"""Rules combining a round's accepted client updates into one (``algorithm.aggregator.name``)."""


class Mean:
    """The weighted mean ``sum_i w_i u_i / sum_i w_i``; it streams (one decoded update at a time)."""

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        return weighted_mean(updates, weights)


class Spilling:
    """Base of the rules that need every update at once: they read them back from a spill file by blocks
    of coordinates (:class:`~geofm.federated.communication.spill.SpilledUpdates`) under :attr:`spill_dir` (the run's
    spill folder, set by :meth:`~geofm.federated.algorithms.base.Algorithm.spill_to`; None: the
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
    """The coordinate-wise median; the mean of the two middle values for an even count. It spills."""

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        half = len(updates) // 2

        def median(block: Tensor) -> Tensor:
            ordered = _sorted(block)
            return ordered[half] if len(updates) % 2 else (ordered[half - 1] + ordered[half]) / 2

        return self.by_block(updates, median)


class TrimmedMean(Spilling):
    """The coordinate-wise mean after dropping the ``floor(trim_fraction n)`` largest and smallest values.
    It spills."""

    def __init__(self, trim_fraction: float) -> None:
        if not 0.0 <= trim_fraction < 0.5:
            raise ConfigError(
                f"algorithm.aggregator.trim_fraction must be in [0, 0.5) so that a value is left, got {trim_fraction}"
            )
        self.trim_fraction = trim_fraction

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        cut = int(self.trim_fraction * len(updates))
        return self.by_block(updates, lambda block: _sorted(block)[cut : len(updates) - cut].mean(dim=0))


class Krum(Spilling):
    """Krum (``multi_krum`` 1) or Multi-Krum: the mean of the ``multi_krum`` updates of lowest score.
    It spills: the pairwise distances and then the mean are summed block by block."""

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


@AGGREGATORS.register("mean")
def _mean(cfg: AggregatorConfig) -> Mean:
    """The data-weighted mean (FedAvg's, the default)."""
    return Mean()


@AGGREGATORS.register("median")
def _median(cfg: AggregatorConfig) -> Median:
    """The coordinate-wise median (Yin et al. 2018)."""
    return Median()


@AGGREGATORS.register("trimmed_mean")
def _trimmed_mean(cfg: AggregatorConfig) -> TrimmedMean:
    """The coordinate-wise mean without the ``trim_fraction`` largest and smallest values (Yin et al. 2018)."""
    return TrimmedMean(cfg.trim_fraction)


@AGGREGATORS.register("krum")
def _krum(cfg: AggregatorConfig) -> Krum:
    """Krum or Multi-Krum (``multi_krum``) against ``byzantine_clients`` attackers (Blanchard et al. 2017)."""
    return Krum(cfg.byzantine_clients, cfg.multi_krum or 1)


def build_aggregator(cfg: AggregatorConfig) -> Aggregator:
    """The aggregator ``cfg.name`` names."""
    return AGGREGATORS.get(cfg.name)(cfg)


__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "Krum",
    "Mean",
    "Median",
    "Spilling",
    "TooFewUpdates",
    "TrimmedMean",
    "build_aggregator",
]
