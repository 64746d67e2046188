"""FedU²: the flexible uniform regulariser on the clients and the efficient unified aggregator on the server.

Liao, Ma, Zhang, Yu, Chen and Liu, "Rethinking the Representation in Federated Unsupervised Learning
with Non-IID Data", CVPR 2024 (official code: ``XeniaLLL/FedU2``).

**Flexible uniform regulariser (FUR), on the clients.** Each local loss adds ``gamma L_FUR``: the
representations ``z`` of a batch, on the unit sphere, are drawn towards the uniform distribution on
it (samples ``g_i`` of a spherical Gaussian, normalised), so that no client's representations
collapse into a corner of the space the others fill. The distance is the sliced Wasserstein distance
in the tangent spaces of ``T`` random points ``t_j`` of the sphere, each set reached by the
sphere's logarithmic map ``log_t(x) = arccos(<t, x>) (x - <t, x> t) / ||x - <t, x> t||``::

    L_FUR = 1/T sum_j SW(log_{t_j}(z), log_{t_j}(g), Theta_j)
    SW(a, b, Theta) = 1/(L n) sum_{theta in Theta} sum_i (sort(a theta)_i - sort(b theta)_i)^2

with ``Theta_j`` ``L`` random directions, drawn as the official code draws them (standard Gaussian,
not normalised; a unit direction would scale ``L_FUR`` by ``1/d``). ``t_j``, ``g`` and ``Theta_j``
are drawn anew at every call. ``z`` is the representation network's pooled final stage (the backbone,
or DINO's and masked image modelling's encoder), each of its calls in a forward regularised on its
own (DINO: the global and the local views) and the mean taken.

**Efficient unified aggregator (EUA), on the server.** The round's updates ``Delta_k`` are brought to
unit length and combined by the weights of the smallest vector in their convex hull (MGDA's min-norm
element: the direction that improves every client's objective as much as any other does)::

    u_k = Delta_k / ||Delta_k||,  alpha = argmin_{alpha in simplex} ||sum_k alpha_k u_k||^2
    Theta' = Theta + eta m sum_k alpha_k u_k,  m = sum_k p_k ||Delta_k||

Deviations: the official code takes the step ``2 sum_k alpha_k u_k`` (a fixed length of at most 2 for
every model); geofm scales it by ``m``, the clients' data-weighted mean update norm, so the step has the
length of the updates it combines (with identical clients EUA is then FedAvg), and ``eta`` is
``options.server_lr``. The official client draws as many tangent points as the batch has samples and
divides by 6; here ``T`` points and the mean over them. On DINO (FedSense's Table 1), FUR regularises
the student's backbone representation, which BYOL's online representation stands for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from geofm.config.base import Section
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.representation import Capture, CapturingRound
from geofm.fl.algorithms.rounds import Arrays, LocalHooks, LocalUpdate, ServerRound

# ---- FUR ------------------------------------------------------------------------------------------


def sphere_log(base: Tensor, points: Tensor) -> Tensor:
    """The logarithmic map of the unit sphere at ``base`` (d,) of unit ``points`` (n, d): tangent vectors. The
    cosines stay 1e-6 inside [-1, 1], where ``arccos``'s gradient is finite (geoopt's sphere clamps alike)."""
    cos = points @ base
    direction = points - cos[:, None] * base
    norm = torch.linalg.vector_norm(direction, dim=1, keepdim=True).clamp_min(1e-12)
    return direction * torch.arccos(cos.clamp(-1.0 + 1e-6, 1.0 - 1e-6))[:, None] / norm


def sliced_wasserstein(a: Tensor, b: Tensor, directions: Tensor) -> Tensor:
    """Squared sliced Wasserstein distance of two equally large point sets (n, d) along ``directions`` (L, d):
    the mean over directions and ranks of the squared gap between the sorted projections."""
    projected_a = torch.sort(a @ directions.T, dim=0).values
    projected_b = torch.sort(b @ directions.T, dim=0).values
    return (projected_a - projected_b).pow(2).mean()


def uniformity_loss(z: Tensor, tangent_points: Tensor, references: Tensor, directions: Tensor) -> Tensor:
    """``L_FUR`` of representations ``z`` (n, d), normalised here, against unit ``references`` (n, d), at unit
    ``tangent_points`` (T, d), along ``directions`` (T, L, d)."""
    z = F.normalize(z.float(), dim=1)
    losses = [
        sliced_wasserstein(sphere_log(t, z), sphere_log(t, references), theta)
        for t, theta in zip(tangent_points, directions, strict=True)
    ]
    return torch.stack(losses).mean()


def fur_draws(n: int, d: int, tangent_points: int, projections: int, device: torch.device) -> tuple[Tensor, ...]:
    """The random parts of one ``L_FUR``: ``T`` tangent points and ``n`` references, uniform on the sphere,
    and ``L`` standard Gaussian directions per tangent point."""
    points = F.normalize(torch.randn(tangent_points, d, device=device), dim=1)
    references = F.normalize(torch.randn(n, d, device=device), dim=1)
    return points, references, torch.randn(tangent_points, projections, d, device=device)


# ---- EUA ------------------------------------------------------------------------------------------


def simplex_projection(v: Tensor) -> Tensor:
    """The Euclidean projection of ``v`` onto the probability simplex."""
    u = torch.sort(v, descending=True).values
    cumulative = torch.cumsum(u, 0) - 1.0
    index = torch.arange(1, len(v) + 1, dtype=v.dtype)
    rho = int(torch.nonzero(u - cumulative / index > 0).max())
    return (v - cumulative[rho] / (rho + 1)).clamp_min(0.0)


def min_norm_weights(gram: Tensor, iterations: int = 10000, tol: float = 1e-12) -> Tensor:
    """``argmin_{alpha in simplex} alpha^T G alpha`` for the Gram matrix ``G`` of the vectors: the weights of
    the smallest vector in their convex hull, by projected gradient descent (float64) from equal weights."""
    gram = gram.double()
    alpha = torch.full((len(gram),), 1.0 / len(gram), dtype=torch.float64)
    step = 1.0 / max(float(torch.linalg.eigvalsh(gram).max()), 1e-12)
    for _ in range(iterations):
        moved = simplex_projection(alpha - step * (gram @ alpha))
        if float((moved - alpha).abs().sum()) < tol:
            return moved
        alpha = moved
    return alpha


def unified_update(updates: Sequence[Tensor], norms: Sequence[float]) -> tuple[Tensor, Tensor]:
    """``sum_k alpha_k u_k`` with ``u_k = Delta_k / ||Delta_k||`` and ``alpha`` the min-norm weights; returns
    it and ``alpha``. ``updates`` may decode each update when taken (it is taken ``K (K + 1) / 2 + K`` times)."""
    count = len(updates)
    gram = torch.zeros(count, count, dtype=torch.float64)
    for i in range(count):
        u_i = updates[i].double() / max(norms[i], 1e-12)
        for j in range(i, count):
            gram[i, j] = gram[j, i] = torch.dot(u_i, updates[j].double()) / max(norms[j], 1e-12)
    alpha = min_norm_weights(gram)
    direction = torch.zeros_like(updates[0])
    for k in range(count):
        direction.add_(updates[k], alpha=float(alpha[k]) / max(norms[k], 1e-12))
    return direction, alpha.float()


# ---- the algorithm --------------------------------------------------------------------------------


class FedU2Options(Section):
    """FedU²'s settings (``algorithm.options``; defaults are the official code's)."""

    fur_weight: float = Field(default=0.01, ge=0.0, description="gamma of the flexible uniform regulariser")
    tangent_points: int = Field(default=6, ge=1, description="T tangent points of the sphere per L_FUR")
    projections: int = Field(default=6, ge=1, description="L random directions per tangent point")
    server_lr: float = Field(default=1.0, gt=0.0, description="eta of the unified aggregator's step")


class FedU2(FedAvg):
    """FedU²: the flexible uniform regulariser in every local loss and the efficient unified aggregator on the
    server (details in the module docstring)."""

    name = "fedu2"
    Options = FedU2Options
    reported_loss = "uniformity_loss"
    own_server_rule = "steps along the min-norm combination of the unit updates"

    def local_round(
        self, client: str, received: dict[str, Tensor], module: nn.Module, state: Arrays, lr: float
    ) -> CapturingRound:
        """The round of ``module``, its representation network's calls captured until :meth:`finish_local`."""
        return CapturingRound(
            **vars(super().local_round(client, received, module, state, lr)), capture=Capture.attach(module, self.name)
        )

    def local_hooks(self, local: CapturingRound) -> LocalHooks:
        options = self.options

        def regulariser(batch: Any, output: Any) -> Tensor:
            """``gamma L_FUR``, the mean over the representation network's calls in the forward just run."""
            losses = []
            for _, z in local.capture.take(self.name):
                draws = fur_draws(len(z), z.shape[1], options.tangent_points, options.projections, z.device)
                losses.append(uniformity_loss(z, *draws))
            loss = torch.stack(losses).mean()
            local.losses.append(loss.detach())
            return options.fur_weight * loss

        return LocalHooks(regulariser=regulariser)

    def finish_local(self, local: CapturingRound, trained: Tensor, steps: int) -> LocalUpdate:
        local.capture.remove()
        return super().finish_local(local, trained, steps)

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """``Theta + eta m sum_k alpha_k u_k``; logs the length of the unified direction (1: the clients agree)."""
        aggregate = payloads["update"]
        norms = [a.norm for a in aggregate.accepted]
        direction, _ = unified_update(aggregate.updates, norms)
        mean_norm = sum(w * n for w, n in zip(aggregate.weights, norms, strict=True))
        outcome = ServerRound(model + self.options.server_lr * mean_norm * direction)
        outcome.metrics["unified_norm"] = float(torch.linalg.vector_norm(direction))
        return self.reporting(outcome, payloads)


__all__ = [
    "FedU2",
    "FedU2Options",
    "fur_draws",
    "min_norm_weights",
    "simplex_projection",
    "sliced_wasserstein",
    "sphere_log",
    "unified_update",
    "uniformity_loss",
]
