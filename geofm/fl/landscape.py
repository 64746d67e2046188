"""Flatness of a model's minimum: the mean loss increase under random perturbations of a fixed norm.

For a model with trainable parameters ``theta`` (n values, all of them as one vector), fixed
batches with loss ``L`` (the mean of the batch losses) and a radius ``r``:

    F(r) = mean over k = 1..K of  L(theta + r u_k / ||u_k||) - L(theta),   u_k ~ N(0, I_n)

with one global norm over every parameter and the draws ``u_k`` seeded, so every model measured
with the same seed sees the same directions. Its spread over the draws comes with it.

The perturbation is the plain one, not filter-normalised. Li et al. ("Visualizing the Loss Landscape
of Neural Nets", NeurIPS 2018) rescale each filter of a direction to that filter's norm so that 1-D
and 2-D plots of networks whose weights differ in scale are comparable; that makes the radius
relative to each model's own weights. A fixed plain norm keeps what the number estimates exact: for
a quadratic ``L = 1/2 (w - w*)^T A (w - w*)`` at its minimum, ``u / ||u||`` is uniform on the sphere,
``E[u^T A u / ||u||^2] = tr(A) / n`` and

    E[F(r)] = r^2 tr(A) / (2 n),

so for a small ``r`` the measure is ``r^2 / 2`` times the mean eigenvalue of the Hessian: the
trace-based flatness that Caldarola et al. ("Improving Generalization in Federated Learning by
Seeking Flat Minima", ECCV 2022) report, with the top eigenvalue, for the global models of FedAvg,
FedSAM and FedASAM; and it is the average-case counterpart of Keskar et al.'s worst case in a
neighbourhood ("On Large-Batch Training for Deep Learning: Generalization Gap and Sharp Minima",
ICLR 2017). Models of one architecture trained by different algorithms from the same start are
what it compares; weights of very different scale (a scale-invariant layer grown large) would
read flatter than they are, which filter normalisation would hide.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from geofm.fl.parameter_vectors import ParameterLayout


@dataclass(frozen=True)
class Flatness:
    """The loss at the model and its increase under each random perturbation of norm ``radius``."""

    radius: float
    loss: float
    increases: tuple[float, ...]

    @property
    def mean(self) -> float:
        """The measure: the mean increase over the draws."""
        return statistics.fmean(self.increases)

    @property
    def std(self) -> float:
        """The standard deviation of the increase over the draws (0 for one draw)."""
        return statistics.stdev(self.increases) if len(self.increases) > 1 else 0.0

    def record(self) -> dict[str, Any]:
        """The measure as plain numbers, for a JSON result."""
        return {
            "radius": self.radius,
            "loss": self.loss,
            "increase_mean": self.mean,
            "increase_std": self.std,
            "draws": len(self.increases),
        }


def mean_loss(model: nn.Module, batches: Sequence[Any], loss: Callable[[nn.Module, Any], Tensor]) -> float:
    """The mean of ``loss(model, batch)`` over the batches (equal batches: the mean over their samples)."""
    return statistics.fmean(float(loss(model, batch)) for batch in batches)


@torch.no_grad()
def flatness(
    model: nn.Module,
    batches: Sequence[Any],
    loss: Callable[[nn.Module, Any], Tensor],
    radius: float,
    draws: int = 8,
    seed: int = 0,
) -> Flatness:
    """The loss increase of ``model`` under ``draws`` random perturbations of norm ``radius``.

    Args:
        model: the model; its trainable parameters are perturbed together (one global norm) and
            restored on return, as is its train/eval mode (it is measured in eval mode).
        batches: the fixed batches the loss is averaged over.
        loss: the loss of one batch, a scalar tensor (the task's own loss).
        radius: ``r``, the norm of every perturbation.
        draws: ``K``, the number of perturbations.
        seed: seeds the directions (drawn on the CPU in float32, so they do not depend on the device).

    Raises:
        ValueError: a negative radius, fewer than one draw or no batch.
    """
    if radius < 0 or draws < 1 or not batches:
        raise ValueError(f"flatness needs radius >= 0, draws >= 1 and batches: got {radius}, {draws}, {len(batches)}")
    layout = ParameterLayout.of(model)
    theta = layout.flatten_module(model)
    generator = torch.Generator().manual_seed(seed)
    training = model.training
    model.eval()
    try:
        base = mean_loss(model, batches, loss)
        increases = []
        for _ in range(draws):
            u = torch.randn(layout.numel, generator=generator).to(theta.device)
            layout.assign(model, theta + radius / torch.linalg.vector_norm(u) * u)
            increases.append(mean_loss(model, batches, loss) - base)
    finally:
        layout.assign(model, theta)
        model.train(training)
    return Flatness(radius, base, tuple(increases))


__all__ = ["Flatness", "flatness", "mean_loss"]
