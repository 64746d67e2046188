"""The flatness measure against the closed form of a quadratic: E[L(w* + r u/||u||) - L(w*)] = r^2 tr(A) / (2 n)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from geofm.fl.landscape import flatness


class Quadratic(nn.Module):
    """L(w) = 1/2 (w - w*)^T A (w - w*) of a trainable w that starts at the minimum w*."""

    def __init__(self, diagonal: list[float]) -> None:
        super().__init__()
        self.optimum = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5][: len(diagonal)])
        self.w = nn.Parameter(self.optimum.clone())
        self.a = torch.tensor(diagonal)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def loss(self) -> torch.Tensor:
        d = self.w - self.optimum
        return 0.5 * (self.a * d * d).sum() + self.frozen.sum() - 3.0


def _loss(model: Quadratic, batch: None) -> torch.Tensor:
    return model.loss()


def test_an_isotropic_quadratic_rises_by_exactly_r2_a_over_2_in_every_direction() -> None:
    # A = 3 I on n = 5, r = 0.2: every unit direction u gives 1/2 r^2 u^T A u = 1/2 * 0.04 * 3 = 0.06.
    measured = flatness(Quadratic([3.0] * 5), [None], _loss, radius=0.2, draws=6)
    assert measured.loss == pytest.approx(0.0, abs=1e-7)
    assert measured.increases == pytest.approx([0.06] * 6, rel=1e-5)
    assert measured.mean == pytest.approx(0.06, rel=1e-5) and measured.std == pytest.approx(0.0, abs=1e-6)


def test_an_anisotropic_quadratic_rises_by_r2_trace_over_2n_on_average() -> None:
    # A = diag(1, 2, 3, 6), n = 4, r = 0.5: E = 0.25 * 12 / (2 * 4) = 0.375. One draw is 1/2 r^2 sum a_i z_i^2
    # with z uniform on the sphere, between 0.125 (all on a_1) and 0.75 (all on a_4).
    measured = flatness(Quadratic([1.0, 2.0, 3.0, 6.0]), [None], _loss, radius=0.5, draws=4000, seed=3)
    assert all(0.125 - 1e-6 <= x <= 0.75 + 1e-6 for x in measured.increases)
    assert measured.std > 0.05, "directions along small and large curvature must rise differently"
    assert abs(measured.mean - 0.375) < 4 * measured.std / math.sqrt(4000), "mean off the closed form"


def test_the_model_comes_back_unchanged_and_the_same_seed_draws_the_same_directions() -> None:
    model = Quadratic([1.0, 2.0, 3.0, 6.0])
    model.train()
    first = flatness(model, [None, None], _loss, radius=0.5, draws=3, seed=7)
    assert torch.equal(model.w.detach(), model.optimum) and torch.equal(model.frozen, torch.ones(3))
    assert model.training, "the model's train mode must be restored"
    assert flatness(model, [None], _loss, radius=0.5, draws=3, seed=7).increases == first.increases
    assert flatness(model, [None], _loss, radius=0.5, draws=3, seed=8).increases != first.increases
    record = first.record()
    assert record["draws"] == 3 and record["increase_mean"] == pytest.approx(first.mean)


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="radius >= 0, draws >= 1 and batches"):
        flatness(Quadratic([1.0]), [None], _loss, radius=0.5, draws=0)
