"""FedNova: normalised averaging (Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization", NeurIPS 2020).

Clients that take different numbers of local steps ``tau_i`` (``local_epochs`` over shares of
different sizes) pull FedAvg's average towards the clients that ran longest: it minimises a
surrogate objective weighted by ``p_i tau_i`` instead of ``p_i``. FedNova removes the
inconsistency by normalising each client's cumulative update by the norm of its aggregation
vector ``a_i`` before averaging. With ``x`` the global model, ``y_i`` client ``i``'s model after its
local steps and ``p_i`` its data weight (its share of the round's accepted examples)::

    d_i = (x - y_i) / ||a_i||_1
    tau_eff = sum_i p_i ||a_i||_1
    x <- x - tau_eff * sum_i p_i d_i  =  x + tau_eff * sum_i p_i (y_i - x) / ||a_i||_1

``tau_eff = sum_i p_i ||a_i||_1`` is the effective step count the paper uses; it keeps the step as
long as FedAvg's when every client ran the same number of steps (FedNova is then FedAvg). The local
learning rate is inside ``y_i - x``: the paper's server has no rate of its own, and neither has this one.

Each client uploads ``update = y_i - x`` and reports its number of local optimizer steps as
``local_steps`` in its metadata; the server reads it from the upload's metrics and refuses a round
where an accepted client reported none or a count that is not positive, naming the client.

The paper's ``a_i`` follows the local optimiser (plain SGD: ``a_i = (1, ..., 1)`` and
``||a_i||_1 = tau_i``; momentum ``rho``: ``||a_i||_1 = [tau_i - rho (1 - rho^tau_i) / (1 - rho)]
/ (1 - rho)``). FedNova declares the paper's plain SGD (:attr:`FedNova.local_optimizer`); a client
under SGD with momentum (``train.optimizer``) reports the momentum form as ``a_norm``. Under AdamW
(with a warning), whose per-coordinate scaling by the running second moment makes the update no
fixed linear combination of the gradients, there is no closed ``a_i``: the client reports the SGD
form ``tau_i``, which normalises the leading cause of the inconsistency, the differing step counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor

from geofm.config.federated import LocalOptimizerConfig
from geofm.errors import FederatedRunError
from geofm.fl.aggregation.screening import Accepted
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.base import Algorithm
from geofm.fl.algorithms.rounds import LocalRound, LocalUpdate, ServerRound
from geofm.fl.algorithms.scaffold import SGD_BASE_LR

STEPS_KEY = "local_steps"
NORM_KEY = "a_norm"


def aggregation_norm(steps: int, momentum: float) -> float:
    """``||a_i||_1`` of ``steps`` local SGD steps with heavy-ball ``momentum`` (``steps`` without momentum)."""
    if not momentum:
        return float(steps)
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


class FedNova(Algorithm):
    """FedNova: up ``update`` (``y_i - x``), ``local_steps`` and ``a_norm`` (``||a_i||_1``), down ``model``."""

    name = "fednova"
    uplink = ("update",)
    downlink = ("model",)
    own_server_rule = (
        "normalises each client's update by its own step count before the data-weighted mean and steps by tau_eff"
    )
    local_optimizer = LocalOptimizerConfig(name="sgd", base_lr=SGD_BASE_LR, momentum=0.0, weight_decay=0.0)
    local_optimizer_source = "Wang et al., NeurIPS 2020: local SGD, a_i from its momentum"

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        return LocalUpdate(
            {"update": trained - local.received["model"]},
            {STEPS_KEY: steps, NORM_KEY: aggregation_norm(steps, local.momentum)},
        )

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """``x + tau_eff * sum_i p_i (y_i - x) / ||a_i||_1`` over the accepted clients.

        Raises:
            FederatedRunError: an accepted client reported no local step count, or one that is not positive.
        """
        aggregate = payloads["update"]
        taus = [local_steps(a) for a in aggregate.accepted]
        tau_eff = sum(p * tau for p, tau in zip(aggregate.weights, taus, strict=True))
        direction = sum(
            (p / tau * a.update for a, p, tau in zip(aggregate.accepted, aggregate.weights, taus, strict=True)),
            start=model.new_zeros(model.shape),
        )
        return ServerRound(model + tau_eff * direction, {"tau_eff": tau_eff})


def local_steps(upload: Accepted) -> float:
    """``||a_i||_1`` of an accepted client: its reported ``a_norm``, else its local step count ``tau_i``.

    Raises:
        FederatedRunError: it reported none, or a count that is not a positive number.
    """
    reported = upload.metadata.get(NORM_KEY, upload.metadata.get(STEPS_KEY))
    try:
        tau = float(reported)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        tau = math.nan
    if isinstance(reported, bool) or not tau > 0 or not math.isfinite(tau):
        raise FederatedRunError(
            f"fednova: client {upload.client} reported {STEPS_KEY}={reported!r} with its upload; "
            "the server needs its number of local steps (a positive count) to normalise its update"
        )
    return tau


__all__ = ["FedNova", "local_steps"]
