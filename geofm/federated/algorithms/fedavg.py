"""FedAvg: local steps from the global model, data-weighted averaging of the updates."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from geofm.federated.aggregation import RoundAggregate
from geofm.federated.algorithms.base import Algorithm, LocalRound, LocalUpdate, Refiner, ServerRound


class FedAvg(Algorithm):
    """Federated averaging: up ``update`` (``theta - Theta``), down ``model``."""

    name = "fedavg"
    uplink = ("update",)
    downlink = ("model",)

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        return LocalUpdate({"update": trained - local.received["model"]})

    def server_update(
        self, model: Tensor, payloads: Mapping[str, RoundAggregate], refine: Refiner | None
    ) -> ServerRound:
        """The next global model: ``Theta + sum_i w_i delta_i``."""
        return ServerRound(model + payloads["update"].update)


__all__ = ["FedAvg"]
