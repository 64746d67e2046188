"""Robust aggregators against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from geofm.config.algorithm import AggregatorConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.robust import AGGREGATORS, Krum, TrimmedMean, build_aggregator
from geofm.fl.aggregation.screening import Upload, UploadRules
from geofm.fl.aggregation.uploads import TooFewUpdates, aggregate_uploads
from geofm.fl.communication.codec import Codec


def _combine(cfg: dict, rows: list[list[float]], weights: list[float] | None = None) -> list[float]:
    weights = weights or [1.0] * len(rows)
    options = {key: value for key, value in cfg.items() if key != "name"}
    aggregator = build_aggregator(AggregatorConfig(name=cfg.get("name", "mean"), options=options))
    return aggregator.combine([torch.tensor(r) for r in rows], weights).tolist()


def test_mean_is_the_weighted_mean() -> None:
    assert _combine({}, [[1.0, 4.0], [3.0, 0.0]], [0.25, 0.75]) == [2.5, 1.0]


def test_median_per_coordinate_with_odd_and_even_counts() -> None:
    rows = [[1.0, 10.0, -3.0], [2.0, 0.0, 5.0], [100.0, -1.0, 4.0]]
    assert _combine({"name": "median"}, rows, [0.9, 0.05, 0.05]) == [2.0, 0.0, 4.0], "weights are ignored"
    # Even count: the mean of the two middle values, (2 + 3) / 2, (0 + 3) / 2, (3 + 4) / 2.
    assert _combine({"name": "median"}, [*rows, [3.0, 3.0, 3.0]]) == [2.5, 1.5, 3.5]


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    rows = [[1.0, -50.0], [2.0, 0.0], [3.0, 1.0], [4.0, 2.0], [100.0, 3.0]]
    assert _combine({"name": "trimmed_mean", "trim_fraction": 0.2}, rows) == [3.0, 1.0]  # mean of (2, 3, 4), (0, 1, 2)
    assert _combine({"name": "trimmed_mean", "trim_fraction": 0.1}, rows) == pytest.approx([22.0, -8.8])  # 0 cut
    with pytest.raises(ConfigError, match=r"trim_fraction must be in \[0, 0.5\)"):
        TrimmedMean(0.5)


HONEST = [[1.1, 1.0], [1.0, 1.0], [0.9, 1.0], [1.0, 1.1], [1.0, 0.9]]
OUTLIERS = [[100.0, 100.0], [-100.0, 50.0]]


def test_krum_picks_the_honest_update_among_planted_outliers() -> None:
    rows = [OUTLIERS[0], *HONEST, OUTLIERS[1]]
    krum = Krum(byzantine_clients=2)
    # n - f - 2 = 3 nearest others: (1, 1) is 0.1 from the four other honest updates (0.03);
    # (1.1, 1) is 0.1, 0.1414, 0.1414 from its nearest (0.05); the outliers are far from all.
    scores = krum.scores([torch.tensor(r) for r in rows]).tolist()
    assert scores[1:6] == pytest.approx([0.05, 0.03, 0.05, 0.05, 0.05], rel=1e-5)
    assert min(scores[0], scores[6]) > 1e4
    assert _combine({"name": "krum", "byzantine_clients": 2}, rows) == [1.0, 1.0]
    # Multi-Krum with m = 2: (1, 1) and, of the tied 0.05 scores, the first, (1.1, 1).
    assert _combine({"name": "krum", "byzantine_clients": 2, "multi_krum": 2}, rows) == pytest.approx([1.05, 1.0])


def test_krum_needs_more_than_2f_plus_2_updates() -> None:
    with pytest.raises(TooFewUpdates, match="byzantine_clients f=1 needs more than 2f \\+ 2 = 4 updates, got 4"):
        Krum(byzantine_clients=1).combine([torch.tensor(r) for r in HONEST[:4]], [1.0] * 4)
    with pytest.raises(TooFewUpdates, match="multi_krum 6 averages more updates than the round's 5"):
        Krum(byzantine_clients=1, multi_krum=6).combine([torch.tensor(r) for r in HONEST], [1.0] * 5)


def test_a_round_too_small_for_the_aggregator_applies_no_update() -> None:
    codec = Codec(bits=32)
    uploads = [Upload(f"c{i}", codec.encode(torch.tensor(r)), 10) for i, r in enumerate(HONEST[:3])]
    result = aggregate_uploads(uploads, UploadRules(num_values=2, bits=32), aggregator=Krum(byzantine_clients=1))
    assert result.update is None and result.accepted == [] and result.weights == []
    assert [r.client for r in result.rejected] == ["c0", "c1", "c2"]
    assert "needs more than 2f + 2 = 4 updates, got 3" in result.rejected[0].reason


def test_the_configured_aggregator_combines_the_screened_uploads() -> None:
    codec = Codec(bits=32)
    uploads = [
        Upload(f"c{i}", codec.encode(torch.tensor(r)), n)
        for i, (r, n) in enumerate(zip(HONEST[:3], [1, 2, 3], strict=True))
    ]
    result = aggregate_uploads(
        uploads, UploadRules(num_values=2, bits=32), aggregator=build_aggregator(AggregatorConfig(name="median"))
    )
    assert result.update.tolist() == [1.0, 1.0] and result.weights == pytest.approx([1 / 6, 2 / 6, 3 / 6])


def test_an_unknown_name_lists_the_nearest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'median'"):
        AGGREGATORS.get("medain")
