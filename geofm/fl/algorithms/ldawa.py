"""L-DAWA: layer-wise divergence-aware weight aggregation (Rehman et al., ICCV 2023).

Rehman, Gao, de Gusmão, Alibeigi, Shen and Lane, "L-DAWA: Layer-wise Divergence Aware Weight
Aggregation in Federated Self-Supervised Visual Representation Learning", ICCV 2023. The server
weights each layer ``l`` of each client model ``w_k = Theta + Delta_k`` by its angular divergence
from the global model's layer, the cosine of the angle between them::

    delta_k^l = <w_k^l, Theta^l> / (||w_k^l|| ||Theta^l||)      (at most 1)
    Theta'^l  = sum_k p_k delta_k^l w_k^l

A layer is a parameter tensor (a weight and its bias are two), as in the official code, which takes
them as the arrays Flower sends. A client layer pointing away from the global one counts less; the
weights are not renormalised, so the global layer shrinks when the clients diverge. Clients train and
upload as in FedAvg (``update``, ``w_k - Theta``).

Deviations: ``p_k`` is the client's share of the round's examples, as every geofm aggregation weighs
clients; the paper and its code take ``1/K`` (the same when the clients hold as many examples). The
official code divides by zero for a global layer of zeros (a bias at its zero start, round 1): there
``delta`` is 1 and the layer is the plain weighted mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import ServerRound


def layer_cosines(model: Tensor, reference: Tensor, sizes: Sequence[int]) -> Tensor:
    """``delta^l``: the cosine of each layer of ``model`` with that of ``reference`` (flat vectors split into
    layers of ``sizes``), at most 1; 1 where either layer is all zeros."""
    pieces = zip(torch.split(model, list(sizes)), torch.split(reference, list(sizes)), strict=True)
    cosines = []
    for w, g in pieces:
        norms = torch.linalg.vector_norm(w.double()) * torch.linalg.vector_norm(g.double())
        cosines.append(torch.dot(w.double(), g.double()) / norms if norms > 0 else torch.ones((), dtype=torch.float64))
    return torch.stack(cosines).clamp(max=1.0).float()


def layer_weighted(model: Tensor, cosines: Tensor, sizes: Sequence[int]) -> Tensor:
    """``delta^l w^l`` of every layer, as a flat vector."""
    return model * torch.repeat_interleave(cosines, torch.tensor(list(sizes)))


class LDAWA(FedAvg):
    """L-DAWA: FedAvg's clients; the server weights each layer of each client model by its cosine with the
    global layer (details in the module docstring)."""

    name = "ldawa"
    own_server_rule = "weights each client layer by its cosine with the global layer"

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """``Theta'^l = sum_k p_k delta_k^l w_k^l``, one client model at a time; logs the mean ``delta``."""
        aggregate, sizes = payloads["update"], self.shared.sizes
        combined, mean_cosine = torch.zeros_like(model), 0.0
        for update, weight in zip(aggregate.updates, aggregate.weights, strict=True):
            client = model + update
            cosines = layer_cosines(client, model, sizes)
            combined.add_(layer_weighted(client, cosines, sizes), alpha=weight)
            mean_cosine += weight * float(cosines.mean())
        return ServerRound(combined, {"layer_cosine": mean_cosine})


__all__ = ["LDAWA", "layer_cosines", "layer_weighted"]
