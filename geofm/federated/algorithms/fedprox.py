"""FedProx: FedAvg with a proximal term in every local loss."""

from __future__ import annotations

from geofm.federated.algorithms.base import LocalHooks, LocalRound
from geofm.federated.algorithms.fedavg import FedAvg
from geofm.federated.perturbation import proximal_term


class FedProx(FedAvg):
    """FedAvg plus the proximal term ``beta / 2 ||theta - Theta||^2`` in every local loss."""

    name = "fedprox"

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        beta = self.cfg.proximal_beta
        if not beta:
            return LocalHooks()
        return LocalHooks(regulariser=lambda batch, output: proximal_term(local.params, local.anchor, beta))


__all__ = ["FedProx"]
