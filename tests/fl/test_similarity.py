from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from geofm.fl.aggregation.similarity import (
    consensus_similarity,
    distill_similarity,
    similarity_loss,
    similarity_matrix,
)
from geofm.fl.parameter_vectors import ParameterLayout


def test_formulas_against_a_hand_computation() -> None:
    # Z_a = [[3, 0], [0, 4]]: ||Z_a||_F = 5, Z_a Z_a^T = [[9, 0], [0, 16]], S_a = [[1.8, 0], [0, 3.2]]
    # Z_b = [[1, 2], [2, 0]]: ||Z_b||_F = 3, Z_b Z_b^T = [[5, 2], [2, 4]], S_b = [[5/3, 2/3], [2/3, 4/3]]
    # Z_g = [[2, 0], [0, 0]]: ||Z_g||_F = 2, S_g = [[2, 0], [0, 0]]
    # S_c = 0.25 S_a + 0.75 S_b = [[0.45 + 1.25, 0.5], [0.5, 0.8 + 1.0]] = [[1.7, 0.5], [0.5, 1.8]]
    # S_g - S_c = [[0.3, -0.5], [-0.5, -1.8]]: squared sum 0.09 + 0.25 + 0.25 + 3.24 = 3.83, / p^2 = 0.9575
    z_a = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    z_b = torch.tensor([[1.0, 2.0], [2.0, 0.0]], dtype=torch.float64)
    z_g = torch.tensor([[2.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    s_a, s_b = similarity_matrix(z_a), similarity_matrix(z_b)
    torch.testing.assert_close(s_a, torch.tensor([[1.8, 0.0], [0.0, 3.2]], dtype=torch.float64))
    torch.testing.assert_close(s_b, torch.tensor([[5, 2], [2, 4]], dtype=torch.float64) / 3)
    consensus = consensus_similarity([s_a, s_b], [0.25, 0.75])
    torch.testing.assert_close(consensus, torch.tensor([[1.7, 0.5], [0.5, 1.8]], dtype=torch.float64))
    loss = similarity_loss(similarity_matrix(z_g), consensus)
    assert float(loss) == pytest.approx(0.9575, rel=1e-12)
    assert torch.equal(similarity_matrix(torch.zeros(3, 4)), torch.zeros(3, 3)), "zero features must give zeros"


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).relu().mean((2, 3)))


def features(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return module(images)


def groups(module: nn.Module, layout: ParameterLayout) -> list[dict[str, torch.Tensor]]:
    """Two group models: the global one moved in two random directions."""
    base = layout.flatten_module(module)
    g = torch.Generator().manual_seed(1)
    return [layout.unflatten(base + 0.5 * torch.randn(base.shape, generator=g)) for _ in range(2)]


def test_distillation_lowers_the_loss_and_leaves_groups_untouched() -> None:
    torch.manual_seed(0)
    module = Encoder()
    layout = ParameterLayout.of(module)
    group_params = groups(module, layout)
    saved = [{k: v.clone() for k, v in p.items()} for p in group_params]
    before_global = layout.flatten_module(module)
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    first = distill_similarity(module, group_params, [0.4, 0.6], itertools.repeat(images), features, optimizer, steps=1)
    distill_similarity(module, group_params, [0.4, 0.6], itertools.repeat(images), features, optimizer, steps=40)
    last = distill_similarity(module, group_params, [0.4, 0.6], itertools.repeat(images), features, optimizer, steps=1)
    assert last < 0.5 * first, f"distillation did not lower the loss: {first:.4g} -> {last:.4g}"
    for params, kept in zip(group_params, saved, strict=True):
        for name in params:
            assert torch.equal(params[name], kept[name]), f"group parameter {name} changed"
    assert not torch.equal(layout.flatten_module(module), before_global), "the global model did not learn"


def test_group_features_come_from_the_group_parameters() -> None:
    torch.manual_seed(0)
    module = Encoder()
    layout = ParameterLayout.of(module)
    group_params = groups(module, layout)
    images = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    targets = []
    for params in group_params:
        copy_ = copy.deepcopy(module)
        copy_.load_state_dict(params, strict=False)
        targets.append(similarity_matrix(copy_(images).detach()))
    expected = similarity_loss(similarity_matrix(module(images).detach()), consensus_similarity(targets, [0.3, 0.7]))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    loss = distill_similarity(module, group_params, [0.3, 0.7], [images], features, optimizer, steps=1)
    assert loss == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="ran out after 1 of 2"):
        distill_similarity(module, group_params, [0.3, 0.7], [images], features, optimizer, steps=2)
