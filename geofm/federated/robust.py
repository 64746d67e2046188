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

The robust rules ignore the weights, as in the papers: a Byzantine client claims its example count
as freely as its update. They run after screening (:mod:`~geofm.federated.aggregation`), which
already drops malformed and outsized uploads. A round with too few accepted updates for the rule
raises :class:`TooFewUpdates`; :func:`~geofm.federated.aggregation.aggregate_uploads` then applies
no update that round.

A plug-in registers a factory ``(cfg: AggregatorConfig) ->`` an object with
``combine(updates, weights) -> Tensor`` in the ``geofm.aggregators`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from geofm.config.federated import AggregatorConfig
from geofm.errors import ConfigError
from geofm.federated.aggregation import Aggregator, TooFewUpdates, weighted_mean
from geofm.registry import Registry

AGGREGATORS: Registry = Registry("aggregator", "geofm.aggregators")
"""Rules combining a round's accepted client updates into one (``algorithm.aggregator.name``)."""


class Mean:
    """The weighted mean ``sum_i w_i u_i / sum_i w_i``."""

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        return weighted_mean(updates, weights)


def _sorted(updates: Sequence[Tensor]) -> Tensor:
    """The updates stacked as rows, each column (coordinate) sorted ascending."""
    return torch.sort(torch.stack(list(updates)).float(), dim=0).values


class Median:
    """The coordinate-wise median; the mean of the two middle values for an even count."""

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        ordered, half = _sorted(updates), len(updates) // 2
        if len(updates) % 2:
            return ordered[half].clone()
        return (ordered[half - 1] + ordered[half]) / 2


class TrimmedMean:
    """The coordinate-wise mean after dropping the ``floor(trim_fraction n)`` largest and smallest values."""

    def __init__(self, trim_fraction: float) -> None:
        if not 0.0 <= trim_fraction < 0.5:
            raise ConfigError(
                f"algorithm.aggregator.trim_fraction must be in [0, 0.5) so that a value is left, got {trim_fraction}"
            )
        self.trim_fraction = trim_fraction

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        ordered = _sorted(updates)
        cut = int(self.trim_fraction * len(updates))
        return ordered[cut : len(updates) - cut].mean(dim=0)


class Krum:
    """Krum (``multi_krum`` 1) or Multi-Krum: the mean of the ``multi_krum`` updates of lowest score."""

    def __init__(self, byzantine_clients: int, multi_krum: int = 1) -> None:
        if byzantine_clients < 0 or multi_krum < 1:
            raise ConfigError(
                f"krum needs byzantine_clients >= 0 and multi_krum >= 1, got {byzantine_clients} and {multi_krum}"
            )
        self.f, self.m = byzantine_clients, multi_krum

    def scores(self, updates: Sequence[Tensor]) -> Tensor:
        """Each update's sum of squared distances to its ``n - f - 2`` nearest others (float64)."""
        n = len(updates)
        if n <= 2 * self.f + 2:
            raise TooFewUpdates(
                f"krum with byzantine_clients f={self.f} needs more than 2f + 2 = {2 * self.f + 2} updates, got {n}"
            )
        distances = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n):
            for j in range(i + 1, n):
                distances[i, j] = distances[j, i] = torch.sum((updates[i].double() - updates[j].double()) ** 2)
        # Row i sorted ascending starts with its zero distance to itself; the next n - f - 2 are its nearest others.
        nearest = torch.sort(distances, dim=1).values[:, 1 : n - self.f - 1]
        return nearest.sum(dim=1)

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        scores = self.scores(updates)
        if self.m > len(updates):
            raise TooFewUpdates(f"multi_krum {self.m} averages more updates than the round's {len(updates)}")
        best = torch.sort(scores, stable=True).indices[: self.m]
        return torch.stack([updates[i].float() for i in best.tolist()]).mean(dim=0)


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


__all__ = ["AGGREGATORS", "Aggregator", "Krum", "Mean", "Median", "TooFewUpdates", "TrimmedMean", "build_aggregator"]
