from __future__ import annotations

import pytest
import torch
from torch import nn

from geofm.errors import LayoutMismatchError
from geofm.fl.local.perturbation import Perturbation, drift_norm, perturbed, proximal_term
from geofm.fl.parameter_vectors import ParameterLayout


def model_and_anchor(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, list[torch.Tensor]]:
    """A small model whose parameters have drifted from the global ones (kept in float32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)).to(dtype)
    anchor = [p.detach().float() + 0.1 * torch.randn(p.shape) for p in model.parameters()]
    return model, anchor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturbation_has_norm_lambda_along_the_drift_and_restores_exactly(dtype: torch.dtype) -> None:
    model, anchor = model_and_anchor(dtype)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    drift = torch.cat([(p.detach().float() - a).flatten() for p, a in zip(params, anchor, strict=True)])
    radius = 0.05
    x = torch.randn(8, 5).to(dtype)
    with perturbed(params, anchor, radius) as norm:
        moved = torch.cat([(p.detach().float() - b.float()).flatten() for p, b in zip(params, before, strict=True)])
        model(x).square().sum().backward()
    assert float(norm) == pytest.approx(float(drift.norm()), rel=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 parameters round the moved values
    assert float(moved.norm()) == pytest.approx(radius, rel=tol * 10, abs=tol), "eps does not have norm lambda"
    cosine = float(moved @ drift / (moved.norm() * drift.norm()))
    assert cosine > 0.999 - 10 * tol, f"eps is not along theta - Theta (cosine {cosine:.4f})"
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b), "parameters not restored bit for bit"
        assert p.grad is not None and p.grad.abs().sum() > 0, "the gradient at theta + eps was lost"


def test_gradient_is_taken_at_the_perturbed_point() -> None:
    model, anchor = model_and_anchor()
    params = list(model.parameters())
    x = torch.randn(8, 5)
    with perturbed(params, anchor, 0.5):
        expected = torch.autograd.grad(model(x).square().sum(), params)
    with perturbed(params, anchor, 0.5):
        model(x).square().sum().backward()
    for p, g in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, g)
    unperturbed = torch.autograd.grad(model(x).square().sum(), params)
    assert not torch.allclose(unperturbed[0], expected[0]), "the perturbation did not change the gradient"


def test_zero_drift_does_not_move_parameters() -> None:
    model, _ = model_and_anchor()
    params = list(model.parameters())
    anchor = [p.detach().clone() for p in params]
    with perturbed(params, anchor, 1.0) as norm:
        assert float(norm) == 0.0
        for p, a in zip(params, anchor, strict=True):
            assert torch.equal(p.detach(), a), "zero drift moved a parameter"


def test_restores_even_when_the_block_raises() -> None:
    model, anchor = model_and_anchor()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="boom"), perturbed(params, anchor, 0.3):
        raise RuntimeError("boom")
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def test_proximal_term_value_and_gradient() -> None:
    model, anchor = model_and_anchor()
    params = list(model.parameters())
    beta = 0.3
    term = proximal_term(params, anchor, beta)
    diffs = [p.detach() - a for p, a in zip(params, anchor, strict=True)]
    expected = beta / 2 * sum(float(d.square().sum()) for d in diffs)
    assert float(term.detach()) == pytest.approx(expected, rel=1e-6)
    assert term.shape == ()
    term.backward()
    for p, d in zip(params, diffs, strict=True):
        torch.testing.assert_close(p.grad, beta * d)
    assert drift_norm(params, anchor) == pytest.approx((2 * expected / beta) ** 0.5, rel=1e-6)


def test_works_with_a_layout_split_of_the_global_vector() -> None:
    model, anchor = model_and_anchor()
    layout = ParameterLayout.of(model)
    global_vector = layout.flatten(anchor)
    assert proximal_term(layout.parameters(model), layout.split(global_vector), 1.0) > 0
    with pytest.raises(LayoutMismatchError, match="parameter 1 has shape"):
        drift_norm(layout.parameters(model), [anchor[0], anchor[0], anchor[2], anchor[3]])
    with pytest.raises(LayoutMismatchError, match="got 4 parameters but 3 global tensors"):
        proximal_term(layout.parameters(model), anchor[:3], 1.0)


def test_a_reused_perturbation_moves_from_the_current_parameters_each_time() -> None:
    model, anchor = model_and_anchor()
    params = list(model.parameters())
    perturbation = Perturbation(params, anchor, 0.2)
    for _ in range(3):
        with torch.no_grad():
            params[0].add_(0.05)  # a step between micro-batches changes theta
        before = [p.detach().clone() for p in params]
        with perturbation() as norm:
            moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before, strict=True)])
        drift = torch.cat([(b - a).flatten() for b, a in zip(before, anchor, strict=True)])
        assert float(norm) == pytest.approx(float(drift.norm()), rel=1e-5)
        torch.testing.assert_close(moved, 0.2 * drift / drift.norm(), rtol=1e-4, atol=1e-7)
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
