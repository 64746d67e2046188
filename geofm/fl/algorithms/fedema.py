"""FedEMA: divergence-aware EMA of the global model into each client's own (Zhuang, Wen and Zhang, ICLR 2022).

Zhuang, Wen and Zhang, "Divergence-aware Federated Self-Supervised Learning", ICLR 2022. Each client
keeps the online network it trained last round, ``W_k^{r-1}``, and starts round ``r`` not from the
global model ``W_g^r`` but from their moving average, weighted by how far they have drifted apart::

    mu = min(lambda_k ||W_g^r - W_k^{r-1}||, 1)
    W_k^r = mu W_k^{r-1} + (1 - mu) W_g^r

A client far from the global model keeps more of its own. ``lambda_k`` is the autoscaler
``tau / ||W_g^r - W_k^{r-1}||`` at the client's first round with a model of its own (the paper's round
after the first), so that its first ``mu`` is ``tau``; it stays fixed after (``options.scaler`` fixes
one for every client instead). The uploads and the server are FedAvg's: the client uploads
``W_k' - W_g^r``, so the server's mean is the data-weighted mean of the trained online networks.

On DINO (FedSense's Table 1 builds it there): the online network is the student (backbone and
projection head). BYOL's predictor, which the paper moves by the same EMA, has no counterpart of its
own in DINO: the projection head plays its role and moves with the backbone, and the divergence is
taken over the whole student (BYOL's online encoder includes its projector). The EMA teacher plays
BYOL's target network: it starts each round from the student the client starts from (the mixed one),
where BYOL's target network carries over from the client's last round; geofm restarts every DINO
teacher with the round's starting student so that only the student lives between rounds. A client
that missed rounds mixes the global model with the model it last trained, however old, as the paper's
method writes it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from geofm.config.base import Section
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import Arrays, LocalRound, LocalUpdate, ServerRound

PREVIOUS = "fedema.previous"
"""The client-state key of the online network the client trained last round (a flat vector)."""
SCALER = "fedema.scaler"
"""The client-state key of its autoscaled ``lambda_k``."""
EMA_MU = "ema_mu"
"""The name of a client's ``mu`` in its metadata and of the clients' mean in ``rounds.jsonl``."""


def ema_decay(scaler: float, divergence: float) -> float:
    """``mu = min(lambda ||W_g - W_k||, 1)``."""
    return min(scaler * divergence, 1.0)


def autoscaler(tau: float, divergence: float) -> float:
    """``lambda_k = tau / ||W_g - W_k||``, the scaler whose first ``mu`` is ``tau``."""
    return tau / divergence


def ema_start(previous: Tensor, global_model: Tensor, mu: float) -> Tensor:
    """``mu W_k^{r-1} + (1 - mu) W_g^r``: where the client's online network starts its round."""
    return mu * previous + (1.0 - mu) * global_model


class FedEMAOptions(Section):
    """FedEMA's settings (``algorithm.options``)."""

    tau: float = Field(
        default=0.7, gt=0.0, le=1.0, description="the autoscaler's first mu (lambda_k = tau / divergence)"
    )
    scaler: float | None = Field(
        default=None, gt=0.0, description="a fixed lambda for every client; null: the autoscaler"
    )


class FedEMA(FedAvg):
    """FedEMA: each client starts from the divergence-weighted EMA of its last trained model and the
    global one; FedAvg's uploads and server (details in the module docstring)."""

    name = "fedema"
    Options = FedEMAOptions
    mu: float | None = None  # this client's round's decay, once restore_local has mixed

    def restore_local(self, module: nn.Module, state: Arrays) -> None:
        """Move ``module`` (holding the global model) to ``mu W_k^{r-1} + (1 - mu) W_g^r`` when the client
        kept a model last round; its autoscaler is set the first time."""
        super().restore_local(module, state)
        if PREVIOUS not in state:
            return
        global_model = self.shared.flatten_module(module)
        previous = torch.from_numpy(state[PREVIOUS].copy())
        divergence = float(torch.linalg.vector_norm(global_model - previous))
        scaler = self.options.scaler
        if scaler is None and SCALER not in state and divergence > 0.0:
            state[SCALER] = np.array([autoscaler(self.options.tau, divergence)])
        if scaler is None:
            scaler = float(state[SCALER][0]) if SCALER in state else 0.0
        self.mu = ema_decay(scaler, divergence)
        self.shared.assign(module, ema_start(previous, global_model, self.mu))

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        """Keep the trained online network for the next round's EMA; upload as FedAvg, with ``ema_mu``."""
        local.state[PREVIOUS] = trained.numpy().copy()
        update = super().finish_local(local, trained, steps)
        if self.mu is not None:
            update.metadata[EMA_MU] = self.mu
        return update

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """FedAvg's step; ``rounds.jsonl`` logs the clients' weighted mean ``mu`` (from the second round)."""
        outcome = super().server_update(model, payloads)
        mu = payloads["update"].reported_mean(EMA_MU)
        if mu is not None:
            outcome.metrics[EMA_MU] = mu
        return outcome


__all__ = ["EMA_MU", "PREVIOUS", "SCALER", "FedEMA", "FedEMAOptions", "autoscaler", "ema_decay", "ema_start"]
