from __future__ import annotations

import pytest
import torch

from geofm.errors import ConfigError, LayoutMismatchError
from geofm.fl.aggregation.clustering import cluster_clients, count_sketch

N = 20_000


def grouped_clients(seed: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """Nine clients around three well-separated centres, interleaved: client i belongs to group i % 3."""
    g = torch.Generator().manual_seed(seed)
    centres = [torch.randn(N, generator=g) for _ in range(3)]
    return [centres[i % 3] + 0.05 * torch.randn(N, generator=g) for i in range(9)], [i % 3 for i in range(9)]


def test_recovers_well_separated_groups() -> None:
    vectors, truth = grouped_clients()
    counts = [10 * (i + 1) for i in range(9)]
    result = cluster_clients(vectors, counts, num_groups=3, seed=0)
    assert result.assignment == truth, f"groups not recovered: {result.assignment}"
    assert result.members == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    total = sum(counts)
    for group, members in enumerate(result.members):
        weight = sum(counts[c] for c in members)
        assert result.weights[group] == pytest.approx(weight / total)
        expected = sum(counts[c] * vectors[c] for c in members) / weight
        torch.testing.assert_close(result.models[group], expected, rtol=1e-5, atol=1e-5)
    assert sum(result.weights) == pytest.approx(1.0)


def test_as_many_groups_as_clients_means_singletons() -> None:
    vectors, _ = grouped_clients()
    vectors = vectors[:4]
    for k in (4, 7):
        result = cluster_clients(vectors, [1, 1, 2, 4], num_groups=k)
        assert result.assignment == [0, 1, 2, 3] and result.members == [[0], [1], [2], [3]]
        assert result.weights == pytest.approx([0.125, 0.125, 0.25, 0.5])
        for model, vector in zip(result.models, vectors, strict=True):
            assert torch.equal(model, vector)


def test_count_sketch_preserves_distances_and_is_linear() -> None:
    g = torch.Generator().manual_seed(1)
    vectors = [torch.randn(N, generator=g) * (1 + i) for i in range(4)]
    sketch = count_sketch(vectors, sketch_dim=4096, seed=3)
    assert sketch.shape == (4, 4096) and sketch.dtype == torch.float64
    for i in range(4):
        for j in range(i + 1, 4):
            exact = float((vectors[i] - vectors[j]).norm())
            approx = float((sketch[i] - sketch[j]).norm())
            assert approx == pytest.approx(exact, rel=0.1), f"sketch distorts the distance of clients {i} and {j}"
    combined = count_sketch([vectors[0] + 2 * vectors[1]], sketch_dim=4096, seed=3)[0]
    torch.testing.assert_close(combined, sketch[0] + 2 * sketch[1], rtol=1e-5, atol=1e-4)
    assert torch.equal(count_sketch(vectors[:1], 4096, seed=3)[0], sketch[0]), "sketch not deterministic"
    assert not torch.equal(count_sketch(vectors[:1], 4096, seed=4)[0], sketch[0]), "seed has no effect"


def test_invalid_inputs() -> None:
    vectors, _ = grouped_clients()
    with pytest.raises(ConfigError, match="num_groups"):
        cluster_clients(vectors, [1] * 9, num_groups=0)
    with pytest.raises(ValueError, match="positive example count"):
        cluster_clients(vectors, [1] * 8 + [0], num_groups=2)
    with pytest.raises(LayoutMismatchError, match="one length"):
        count_sketch([torch.zeros(3), torch.zeros(4)])
