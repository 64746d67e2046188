"""FedDC: local drift decoupling and correction (Gao, Xu, Chen, Wang, Xu and Wu, "FedDC: Federated Learning
with Non-IID Data via Local Drift Decoupling and Correction", CVPR 2022).

Each client ``i`` keeps a local drift variable ``h_i`` and a gradient-correction state ``c_i``
(its client state, zero at first); the server keeps ``c`` (zero at first) and sends it with the
global model ``w``. The client's local objective, as the official code (github.com/gaoliang13/FedDC)
minimises it::

    F_i(theta) = f_i(theta) + alpha / 2 ||theta + h_i - w||^2 + <theta, c - c_i>

the drift penalty, which keeps ``theta + h_i`` (the client model corrected by its drift) near ``w``,
and the gradient-correction term, a SCAFFOLD-style linear term whose gradient ``c - c_i`` replaces
the client's last-round update direction by the federation's. The linear term enters the loss with
its value subtracted (its gradient is unchanged), so it passes through gradient accumulation,
clipping and the local optimiser like the loss's own gradient. After ``K`` local optimizer steps at
learning rate ``eta`` the client ends at ``theta_i`` and, with ``Delta_i = theta_i - w``::

    h_i <- h_i + Delta_i
    c_i+ = c_i - c - Delta_i / (K eta)

and uploads ``update = Delta_i`` and ``delta_c = c_i+ - c_i``, each with its own codec and
error-feedback residual. The server, with ``S`` the round's accepted clients and ``N`` all clients,
aggregates the corrected models: the mean of the selected clients' models plus the mean drift of
all clients, ``hbar = 1/N sum_i h_i``, which it keeps as its state (each ``h_i`` grows by the
``Delta_i`` it uploads, so ``hbar`` grows by ``1/N sum_S Delta_i``)::

    hbar <- hbar + 1/N sum_S Delta_i
    w <- mean_S(theta_i) + hbar = w + mean_S(Delta_i) + hbar
    c <- c + 1/N sum_S (c_i+ - c_i)

With every client selected this is ``w = mean_i(theta_i + h_i)``, the paper's aggregation of the
corrected local models. ``alpha`` (``algorithm.options.alpha``) defaults to 0.01, the paper's and the
official code's value (``alpha_coef = 1e-2``).

Deviations from the official code, named:

* Unweighted clients. The official code weights client ``i`` by ``omega_i = n_i / mean_j n_j``: its
  penalty by ``alpha / omega_i``, the server's ``c`` by ``c / omega_i`` and its ``delta_c`` by
  ``omega_i``. A geofm client does not know the other clients' example counts, so ``omega_i = 1``,
  exact for the equal shares of the official experiments; the means are plain means over clients.
* ``K`` and ``eta`` are the client's own optimizer steps and the round's learning rate, as geofm's
  SCAFFOLD (option II) takes them; the official code uses one nominal step count for every client
  (epochs over the mean share) and the undecayed base rate.
* The local optimiser is the official code's plain SGD with weight decay (1e-3), declared as
  :attr:`FedDC.local_optimizer`, with the run's clipping; its learning rate is geofm's SGD default
  (:data:`~geofm.fl.algorithms.scaffold.SGD_BASE_LR`), not the code's 0.1. Under AdamW
  (``train.optimizer``, with a warning) ``(x - theta_i) / (K eta)`` is the mean normalised step, as
  for SCAFFOLD.
* The server's ``hbar`` is built from the updates it decoded rather than from the clients' ``h_i``:
  the same without quantisation; under a quantised uplink, error feedback carries what a round's
  packet dropped into the client's later uploads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field
from torch import Tensor

from geofm.config.base import Section
from geofm.config.federated import LocalOptimizerConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import RoundAggregate, weighted_mean
from geofm.fl.algorithms.base import Algorithm
from geofm.fl.algorithms.rounds import LocalHooks, LocalRound, LocalUpdate, ServerRound
from geofm.fl.algorithms.scaffold import SGD_BASE_LR, option_ii_control


class FedDCOptions(Section):
    """FedDC's own settings (``algorithm.options``)."""

    alpha: float = Field(default=0.01, ge=0.0, description="weight of the drift penalty alpha / 2 ||theta + h - w||^2")


class FedDC(Algorithm):
    """FedDC: up ``update`` and ``delta_c``, down ``model`` and ``control``; client state ``drift`` and ``control``."""

    name = "feddc"
    uplink = ("update", "delta_c")
    downlink = ("model", "control")
    own_server_rule = "combines the corrected models by the official code's plain means"
    Options = FedDCOptions
    local_optimizer = LocalOptimizerConfig(name="sgd", base_lr=SGD_BASE_LR, momentum=0.0, weight_decay=1e-3)
    local_optimizer_source = "Gao et al., CVPR 2022, and its official code: SGD with weight decay"

    def downlink_values(self, model: Tensor) -> dict[str, Tensor]:
        return {"model": model, "control": self.global_vector("control")}

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        alpha = self.options.alpha
        target = self.shared.split(local.received["model"] - self.client_vector(local, "drift"))
        correction = self.shared.split(local.received["control"] - self.client_vector(local, "control"))
        terms = [(p, t.to(p.device), d.to(p.device)) for p, t, d in zip(local.params, target, correction, strict=True)]

        def regulariser(batch, output) -> Tensor:
            penalty = sum(torch.sum((p.float() - t) ** 2) for p, t, _ in terms)
            linear = sum(torch.sum(p.float() * d) for p, _, d in terms)
            return alpha / 2 * penalty + linear - linear.detach()

        return LocalHooks(regulariser=regulariser)

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        if steps < 1 or local.lr <= 0:
            raise ValueError(
                f"client {local.client}: FedDC's correction state needs at least one local step at a positive "
                f"learning rate, got {steps} steps at {local.lr}"
            )
        delta = trained - local.received["model"]
        control = self.client_vector(local, "control")
        new_control = option_ii_control(control, local.received["control"], delta, steps, local.lr)
        local.state["drift"] = (self.client_vector(local, "drift") + delta).numpy()
        local.state["control"] = new_control.numpy()
        return LocalUpdate({"update": delta, "delta_c": new_control - control})

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        if self.num_clients is None:
            raise ConfigError("FedDC's server update needs the federation's number of clients")
        accepted = {p: payloads[p].updates for p in self.uplink}
        size = len(accepted["update"])
        mean_update = weighted_mean(accepted["update"], [1.0] * size)
        share = size / self.num_clients
        drift = self.global_vector("drift") + share * mean_update
        control = self.global_vector("control") + share * weighted_mean(accepted["delta_c"], [1.0] * size)
        return ServerRound(
            model + mean_update + drift,
            {
                "drift_norm": float(torch.linalg.vector_norm(drift)),
                "control_norm": float(torch.linalg.vector_norm(control)),
            },
            state={"drift": drift, "control": control},
        )


__all__ = ["FedDC", "FedDCOptions"]
