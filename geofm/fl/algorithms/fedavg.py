"""FedAvg: local steps from the global model, the combined updates stepped by the server optimiser."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from geofm.fl.aggregation.server_optimizers import build_server_optimizer
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.base import Algorithm
from geofm.fl.algorithms.rounds import LocalRound, LocalUpdate, ServerRound


class FedAvg(Algorithm):
    """Federated averaging: up ``update`` (``theta - Theta``), down ``model``; the round's combined
    update ``Delta`` (``aggregator``) moves the model through ``server_optimizer`` (``Theta + Delta`` by default)."""

    name = "fedavg"
    uplink = ("update",)
    downlink = ("model",)
    reported_loss: ClassVar[str | None] = None
    """The name under which a client reports the round's mean regulariser value (``LocalRound.losses``)
    and ``rounds.jsonl`` logs the clients' mean, weighted as their updates (MOON, FedAlign)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server_optimizer = build_server_optimizer(self.cfg.server_optimizer, self.num_values)
        self._optimizer_before: dict[str, Any] | None = None

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        update = LocalUpdate({"update": trained - local.received["model"]})
        if self.reported_loss and local.losses:
            update.metadata[self.reported_loss] = float(torch.stack(local.losses).mean())
        return update

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """The next global model: the server optimiser's step by the combined update."""
        self._optimizer_before = copy.deepcopy(self.server_optimizer.state_dict())
        return self.reporting(ServerRound(self.server_optimizer.step(model, payloads["update"].update)), payloads)

    def reporting(self, outcome: ServerRound, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """``outcome`` with the clients' mean :attr:`reported_loss` among its metrics, where they report one."""
        reported = payloads["update"].reported_mean(self.reported_loss) if self.reported_loss else None
        if reported is not None:
            outcome.metrics[self.reported_loss] = reported
        return outcome

    def discard(self) -> None:
        if self._optimizer_before is not None:
            self.server_optimizer.load_state_dict(self._optimizer_before)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "server_optimizer": self.server_optimizer.state_dict()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        super().load_state_dict(saved)
        if "server_optimizer" in saved:  # absent from checkpoints of older versions: a fresh state
            self.server_optimizer.load_state_dict(saved["server_optimizer"])


__all__ = ["FedAvg"]
