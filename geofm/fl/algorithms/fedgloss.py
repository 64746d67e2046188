"""FedGloSS: server-side sharpness-aware minimisation from the previous round's pseudo-gradient.

Caldarola, Cagnasso, Caputo, Ciccone, "Beyond Local Sharpness: Communication-Efficient Global
Sharpness-aware Minimization for Federated Learning", CVPR 2025 (Algorithm 1; official code
pietrocagnasso/fedgloss). SAM on the global loss needs the global gradient at ``w`` before the
perturbed round; FedGloSS takes the previous round's pseudo-gradient ``D^{t-1}`` in its place, so
one model travels down per round, the perturbed one. With ``N`` the federation's clients, ``S`` the
round's accepted ones and the dual variables ``sigma`` (server) and ``sigma_k`` (client k) at zero::

    w~ = w + rho D^{t-1} / ||D^{t-1}||                       (server ascent; no move while D = 0)
    client k from w_k,0 = w~, each step (g: the local SAM gradient at w_k + e_k, rho_l):
        w_k <- w_k - lr [g - sigma_k + (w_k - w~) / beta]
    sigma_k <- sigma_k - (w_k,E - w~) / beta                 (upload: Delta_k = w_k,E - w~)
    sigma  <- sigma - 1 / (beta N) sum_{k in S} Delta_k
    D^t     = -sum_k N_k / N_S Delta_k                        (the pseudo-gradient; minus ``update``)
    w      <- w - D^t - beta sigma                           (the descent, applied at the unperturbed w)

``downlink_values`` sends ``w~`` as ``model``; the server keeps, validates and exports the unperturbed
``w``. The descent ``w - D^t`` is FedAvg's step (``aggregator``, ``server_optimizer``: sgd at lr 1 by
default, the paper's). Clients train with SAM through ``algorithm.sam`` (default ``rho_l = 0.15``); the
ADMM terms enter the local loss as a linear term whose gradient is ``-sigma_k + (w_k - w~) / beta``
taken at the unperturbed ``w_k`` at the start of each micro-step, so it stays outside SAM's ascent and
is the same at the perturbed point, as in Algorithm 1, line 15.

Options (``algorithm.options``) and their defaults, the official code's CIFAR-10 setting
(``paper_experiments/cnn_cifar10.sh``): ``rho`` 0.15 (server), ``beta`` 10, ``warmup_rounds`` 0
(``T_s``, the code's default; its CIFAR-10 runs warm up over 2000 of 10000 rounds) and ``rho0``
0.001: over the first ``warmup_rounds`` rounds both radii rise linearly from ``rho0`` (round 1) to
their values (round ``warmup_rounds + 1``); the local ``rho_l`` is ``sam.rho``.

Deviations: (1) the global dual update divides by ``beta N`` as Algorithm 1 (line 22) does; the
official code also divides by the number of participants. (2) The official code's server warm-up
adds its step to the clients' final radius (so the server's radius never ramps); the ramp here is the
one its client schedule and the paper describe. (3) The local optimiser is the paper's SGD (declared
as :attr:`FedGloSS.local_optimizer`, no momentum, no weight decay) at geofm's SGD rate
(:data:`~geofm.fl.algorithms.scaffold.SGD_BASE_LR`), not the code's CIFAR rate; the ADMM
correction passes through it as the loss's gradient does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from geofm.config.algorithm import AlgorithmConfig, SamConfig
from geofm.config.base import Section
from geofm.config.federated import LocalOptimizerConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import RoundAggregate, weighted_mean
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import Arrays, LocalHooks, LocalRound, LocalUpdate, ServerRound
from geofm.fl.algorithms.scaffold import SGD_BASE_LR


class FedGloSSOptions(Section):
    """FedGloSS's settings (``algorithm.options``); the local radius is ``algorithm.sam.rho``."""

    rho: float = Field(default=0.15, gt=0.0, description="the server's SAM radius")
    beta: float = Field(default=10.0, gt=0.0, description="the ADMM penalty's inverse weight")
    warmup_rounds: int = Field(default=0, ge=0, description="T_s: rounds over which both radii rise from rho0")
    rho0: float = Field(default=0.001, gt=0.0, description="both radii in round 1 under a warm-up")


def scheduled_radius(radius: float, options: FedGloSSOptions, rnd: int) -> float:
    """The radius of round ``rnd`` (from 1): ``rho0`` rising linearly to ``radius`` over ``warmup_rounds``."""
    if not options.warmup_rounds:
        return radius
    done = min(max(rnd - 1, 0), options.warmup_rounds)
    return options.rho0 + done * (radius - options.rho0) / options.warmup_rounds


def global_ascent(direction: Tensor, radius: float) -> Tensor:
    """``radius * direction / ||direction||``, or zeros for a zero direction."""
    norm = torch.linalg.vector_norm(direction)
    return direction * (radius / norm) if norm > 0 else torch.zeros_like(direction)


class FedGloSS(FedAvg):
    """FedGloSS: global SAM from the previous round's pseudo-gradient, with ADMM dual variables; up ``update`` (``w_k - w~``), down
    ``model`` (``w~``, the perturbed model). Details in the module docstring."""

    name = "fedgloss"
    Options = FedGloSSOptions
    default_sam: ClassVar[SamConfig] = SamConfig(rho=0.15)
    local_optimizer = LocalOptimizerConfig(name="sgd", base_lr=SGD_BASE_LR, momentum=0.0, weight_decay=0.0)
    local_optimizer_source = "Caldarola et al., CVPR 2025: SGD with SAM in the clients' inner loop"

    @classmethod
    def check_config(cls, cfg: AlgorithmConfig) -> None:
        super().check_config(cfg)
        if cfg.privacy is not None and cfg.privacy.mode == "central":
            raise ValueError(
                "privacy: fedgloss's dual sigma sums each accepted update as it arrived, outside central "
                "privacy's clipped and noised mean; use privacy.mode: local"
            )

    # ---- server --------------------------------------------------------------------------
    def downlink_values(self, model: Tensor) -> dict[str, Tensor]:
        """The perturbed model ``w~ = w + rho D / ||D||`` of the round (:attr:`round`)."""
        radius = scheduled_radius(self.options.rho, self.options, self.round)
        return {"model": model + global_ascent(self.global_vector("pseudo_gradient"), radius)}

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """``sigma`` from the accepted uploads, the descent at the unperturbed ``w``, minus ``beta sigma``."""
        if self.num_clients is None:
            raise ConfigError("FedGloSS's server update needs the federation's number of clients")
        beta, aggregate = self.options.beta, payloads["update"]
        accepted = len(aggregate.accepted)  # their sum as a running mean: one decoded update at a time
        total = accepted * weighted_mean(aggregate.updates, [1.0] * accepted)
        sigma = self.global_vector("sigma") - total / (beta * self.num_clients)
        descent = super().server_update(model, payloads)
        return ServerRound(
            descent.model - beta * sigma,
            {"sigma_norm": float(torch.linalg.vector_norm(sigma))},
            state={"sigma": sigma, "pseudo_gradient": -aggregate.update},
        )

    # ---- client --------------------------------------------------------------------------
    def receive(
        self, client: str, arrays: Arrays, config: Mapping[str, Any], state: Arrays
    ) -> tuple[dict[str, Tensor], Arrays]:
        """The payloads, and the round (``config["round"]``) that sets the local radius's schedule."""
        self.round = int(config["round"])
        return super().receive(client, arrays, config, state)

    def local_sam(self) -> SamConfig:
        sam = self.sharpness(self.cfg)
        return sam.model_copy(update={"rho": scheduled_radius(sam.rho, self.options, self.round)})

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        """The ADMM terms: a linear term whose gradient is ``-sigma_k + (w_k - w~) / beta``, evaluated
        where each micro-step starts (before any SAM ascent)."""
        beta = self.options.beta
        dual = [
            d.to(p.device)
            for d, p in zip(self.shared.split(self.client_vector(local, "dual")), local.params, strict=True)
        ]
        correction = [torch.empty_like(a) for a in local.anchor]

        @contextmanager
        def correction_here() -> Iterator[None]:
            with torch.no_grad():
                torch._foreach_copy_(correction, [p.detach() for p in local.params])
                torch._foreach_sub_(correction, local.anchor)
                torch._foreach_div_(correction, beta)
                torch._foreach_sub_(correction, dual)
            yield

        def regulariser(batch, output) -> Tensor:
            linear = sum(torch.sum(p.float() * c) for p, c in zip(local.params, correction, strict=True))
            return linear - linear.detach()

        return LocalHooks(around_gradient=correction_here, regulariser=regulariser)

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        """Upload ``w_k - w~``; keep ``sigma_k - (w_k - w~) / beta``."""
        update = trained - local.received["model"]
        local.state["dual"] = (self.client_vector(local, "dual") - update / self.options.beta).numpy()
        return LocalUpdate({"update": update})


__all__ = ["FedGloSS", "FedGloSSOptions", "global_ascent", "scheduled_radius"]
