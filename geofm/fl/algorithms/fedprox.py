"""FedProx: FedAvg with a proximal term in every local loss."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import LocalHooks, LocalRound
from geofm.fl.local.perturbation import proximal_term


class FedProxOptions(BaseModel):
    """FedProx's settings (``algorithm.options``)."""

    model_config = ConfigDict(extra="forbid")

    proximal_beta: float = Field(gt=0.0, description="weight beta of the proximal term (with 0 it is fedavg)")


class FedProx(FedAvg):
    """FedAvg plus the proximal term ``beta / 2 ||theta - Theta||^2`` in every local loss."""

    name = "fedprox"
    Options = FedProxOptions

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        beta = self.options.proximal_beta
        if not beta:
            return LocalHooks()
        return LocalHooks(regulariser=lambda batch, output: proximal_term(local.params, local.anchor, beta))


__all__ = ["FedProx", "FedProxOptions"]
