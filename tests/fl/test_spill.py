"""The server flat in its clients: streamed and spilled aggregates equal the in-memory ones."""

from __future__ import annotations

import weakref

import pytest
import torch
from sklearn.cluster import KMeans

from geofm.config.algorithm import AggregatorConfig, AlgorithmConfig
from geofm.fl.aggregation import screening
from geofm.fl.aggregation.robust import AGGREGATORS, Krum, build_aggregator
from geofm.fl.aggregation.screening import Upload, UploadRules
from geofm.fl.aggregation.uploads import ClientUpload, aggregate_uploads, weighted_mean
from geofm.fl.algorithms import build_algorithm
from geofm.fl.communication import spill
from geofm.fl.communication.codec import Codec, decode
from geofm.fl.communication.spill import SpilledUpdates, clear_spill

N = 1000
SETTINGS = {"mean": {}, "median": {}, "trimmed_mean": {"trim_fraction": 0.2}, "krum": {"byzantine_clients": 1}}


def _updates(count: int, n: int = N) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=generator) * (1 + i % 3) + i % 2 for i in range(count)]


def _in_memory(name: str, updates: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Each rule as the server computed it holding every decoded update (before it streamed and spilled)."""
    ordered = torch.sort(torch.stack(updates), dim=0).values
    n = len(updates)
    if name == "mean":
        return sum(w / sum(weights) * u for u, w in zip(updates, weights, strict=True))
    if name == "median":
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    if name == "trimmed_mean":
        cut = int(0.2 * n)
        return ordered[cut : n - cut].mean(dim=0)
    distances = torch.tensor([[float(((a.double() - b.double()) ** 2).sum()) for b in updates] for a in updates])
    scores = torch.sort(distances, dim=1).values[:, 1 : n - 1 - 1].sum(dim=1)
    return updates[int(torch.argmin(scores))]


@pytest.fixture
def live_decodes(monkeypatch):
    """The most decoded updates alive at once while the server aggregates."""
    alive, peak = set(), [0]

    def decoding(packet):
        update = decode(packet)
        key = id(update)
        alive.add(key)
        peak[0] = max(peak[0], len(alive))
        weakref.finalize(update, alive.discard, key)
        return update

    monkeypatch.setattr(screening, "decode", decoding)
    return peak


def test_every_registered_aggregator_equals_its_in_memory_result(monkeypatch, tmp_path, live_decodes) -> None:
    assert set(SETTINGS) == set(AGGREGATORS.names()), "a registered aggregator has no comparison here"
    monkeypatch.setattr(spill, "BLOCK_BYTES", 7 * 4 * 24)  # several blocks, the last one short
    for count in (6, 7):
        updates = _updates(count)
        uploads = [Upload(f"c{i}", Codec(bits=32).encode(u), 10 + i) for i, u in enumerate(updates)]
        for name, settings in SETTINGS.items():
            aggregator = build_aggregator(AggregatorConfig(name=name, options=settings))
            aggregator.spill_dir = tmp_path
            result = aggregate_uploads(uploads, UploadRules(num_values=N, bits=32), aggregator=aggregator)
            expected = _in_memory(name, updates, result.weights)
            torch.testing.assert_close(result.update, expected, msg=f"{name} with {count} updates")
            assert live_decodes[0] <= 2, f"{name}: {live_decodes[0]} decoded updates held at once"
    assert not list(tmp_path.iterdir()), "a spill file outlived its round"


def test_spilled_updates_read_back_by_blocks_and_are_removed(tmp_path) -> None:
    updates = _updates(3, n=10)
    with SpilledUpdates(updates, tmp_path, block_bytes=3 * 4 * 4) as spilled:
        assert len(list(tmp_path.iterdir())) == 1
        blocks = list(spilled.blocks())
    assert [b.stop - b.start for b, _ in blocks] == [4, 4, 2]
    assert torch.equal(torch.cat([block for _, block in blocks], dim=1), torch.stack(updates))
    assert not list(tmp_path.iterdir())
    (tmp_path / spill.SPILL_FOLDER / "round-killed").mkdir(parents=True)
    clear_spill(tmp_path)
    assert not (tmp_path / spill.SPILL_FOLDER).exists(), "a killed round's spill folder survived a restart"


def test_krum_scores_spilled_equal_the_pairwise_distances() -> None:
    updates = _updates(5, n=50)
    distances = torch.cdist(torch.stack(updates).double(), torch.stack(updates).double()) ** 2
    expected = torch.sort(distances, dim=1).values[:, 1:3].sum(dim=1)
    torch.testing.assert_close(Krum(byzantine_clients=1).scores(updates), expected)


def _old_sketches(vectors: list[torch.Tensor], seed: int = 0, sketch_dim: int = 4096) -> torch.Tensor:
    """The count sketches of every vector at once, as computed before the server streamed."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, 2 * sketch_dim, (vectors[0].numel(),), generator=generator)
    signed = torch.zeros(len(vectors), 2 * sketch_dim, dtype=torch.float64)
    for row, vector in zip(signed, vectors, strict=True):
        row.index_add_(0, index, vector.double())
    return signed[:, :sketch_dim] - signed[:, sketch_dim:]


@pytest.mark.parametrize("bits", [32, 1])
def test_fedsense_streams_its_round_and_equals_the_in_memory_one(live_decodes, bits) -> None:
    cfg = AlgorithmConfig.model_validate(
        {"name": "fedsense", "options": {"clusters": 3, "distill_steps": 1}, "uplink": {"bits": bits}}
    )
    algorithm = build_algorithm(cfg, N)
    clients = 9
    updates = [u + 4 * (i % 3) for i, u in enumerate(_updates(clients))]
    uploads = [
        ClientUpload(f"c{i}", {"update": algorithm.feedback["update"].codec.encode(u)}, 10 + i)
        for i, u in enumerate(updates)
    ]
    payloads = algorithm.aggregate(uploads)
    seen = {}

    def distillation(rnd, model, groups, weights):
        seen.update(groups=groups, weights=weights)
        return model, 0.5

    algorithm.distillation = distillation
    model = torch.zeros(N)
    result = algorithm.server_update(model, payloads)
    assert live_decodes[0] <= 2, f"{live_decodes[0]} decoded updates held at once for {clients} clients"

    decoded = [decode(algorithm.feedback["update"].codec.encode(u)) for u in updates]
    accepted = payloads["update"].accepted
    counts = [a.num_examples for a in accepted]
    weights = payloads["update"].weights
    torch.testing.assert_close(result.model, weighted_mean(decoded, weights))
    labels = KMeans(n_clusters=3, n_init=10, random_state=0).fit_predict(_old_sketches(decoded).numpy()).tolist()
    members = [[c for c, label in enumerate(labels) if label == g] for g in dict.fromkeys(labels)]
    expected = [weighted_mean([decoded[c] for c in m], [counts[c] for c in m]) for m in members]
    assert len(seen["groups"]) == len(expected) == 3
    for got, want in zip(seen["groups"], expected, strict=True):
        torch.testing.assert_close(got, model + want)
    assert seen["weights"] == pytest.approx([sum(counts[c] for c in m) / sum(counts) for m in members])
