"""What the server offers an algorithm's server side: its model, what travels, the task's public images.

The server hands a :class:`ServerContext` to :meth:`~geofm.fl.algorithms.base.Algorithm.attach`
once, before the first round. An algorithm that trains the global model on the server (FedSense's
similarity distillation) builds its optimiser from it and keeps that optimiser in its own
:meth:`~geofm.fl.algorithms.base.Algorithm.state_dict`; no other algorithm needs to know.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from geofm.fl.parameter_vectors import ParameterLayout


@dataclass(frozen=True)
class PublicImages:
    """The server's public images, as a task with a public source offers them.

    Attributes:
        batches: ``(round, batch size) -> `` endless batches of images (on the model's device),
            reshuffled per round and the same on a rerun of the round.
        features: ``(model, images) -> (batch, d)`` the model's pooled features of the images.
        trainable: ``model -> `` the parameters a server-side step trains (e.g. the encoder's).
    """

    batches: Callable[[int, int], Iterator[Tensor]]
    features: Callable[[nn.Module, Tensor], Tensor]
    trainable: Callable[[nn.Module], Iterable[nn.Parameter]]


@dataclass(frozen=True)
class ServerContext:
    """The server's side of a run, for an algorithm's server-side steps.

    Attributes:
        model: the server's model; the values in ``layout`` are the global model's (a step assigns
            them before it trains and flattens them after).
        layout: the shared parameters, in the order of the global model vector.
        public: the task's public images, or None where the config names no public source.
    """

    model: nn.Module
    layout: ParameterLayout
    public: PublicImages | None

    def optimizer(self, parameters: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """The optimiser of a server-side step over ``parameters`` (AdamW, torch's defaults but ``lr``)."""
        return torch.optim.AdamW(parameters, lr=lr)


__all__ = ["PublicImages", "ServerContext"]
