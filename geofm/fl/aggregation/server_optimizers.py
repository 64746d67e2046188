"""Server optimisers: how the round's combined client update moves the global model.

The combined update ``Delta`` (the weighted mean of the accepted client updates, or a robust
combination of them, see :mod:`~geofm.fl.aggregation.robust`) is treated as a negative pseudo-gradient,
as in Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2:

* ``sgd``: ``x <- x + lr Delta``; lr 1.0 is FedAvg (the default).
* ``fedavgm``: server momentum (Hsu et al., 2019), ``v <- momentum v + Delta; x <- x + lr v``, by
  :class:`torch.optim.SGD` (momentum, no dampening), whose update is exactly that.
* ``fedadam``, ``fedyogi``: ``m <- beta1 m + (1 - beta1) Delta``; ``v <- beta2 v + (1 - beta2) Delta^2``
  (Adam) or ``v <- v - (1 - beta2) Delta^2 sign(v - Delta^2)`` (Yogi); ``x <- x + lr m / (sqrt(v) + tau)``,
  with ``m = 0`` and ``v = tau^2`` before the first round (the paper asks ``v >= tau^2``). Written
  from these equations: :class:`torch.optim.Adam` divides ``m`` and ``v`` by ``1 - beta^t`` (bias
  correction, absent from the paper) and starts ``v`` at 0, and torch has no Yogi.

Flower's strategies (FedAvgM, FedAdam, FedYogi) implement the same rules, but on the lists of numpy
layers a Flower Strategy receives, and only the Flower adapter may import ``flwr``. geofm computes
them on its own flat parameter vector, after its own screening and combination of the uploads, so
that the rule is the same in a simulation, a deployment and a test, and its state is saved with
the server checkpoint.

An optimiser's state lives beside the global model; ``state_dict``/``load_state_dict`` carry it
through checkpoints. Each optimiser's own settings (``momentum``, ``beta1``, ``beta2``, ``tau``) are
its ``Options``, read from ``algorithm.server_optimizer.options``. A plug-in registers a class in
the ``geofm.server_optimizers`` entry-point group: ``from_config(cfg: ServerOptimizerConfig,
num_values)`` builds an object with the same three methods; its ``Options`` (a pydantic model,
optional) checks ``cfg.options``, read back by ``cfg.options_of()``, and its ``check(cfg)``
(optional) refuses what it cannot use.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from geofm.config.algorithm import ServerOptimizerConfig
from geofm.registry import Registry


class ServerOptimizer(Protocol):
    """Moves the global model by the round's combined update, keeping its own state."""

    def step(self, model: Tensor, update: Tensor) -> Tensor:
        """The next global model (a new tensor) from ``model`` and the combined update."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


SERVER_OPTIMIZERS: Registry = Registry("server optimiser", "geofm.server_optimizers")
"""How the round's combined update moves the global model (``algorithm.server_optimizer.name``)."""


class TorchSGD:
    """``sgd`` and ``fedavgm``: :class:`torch.optim.SGD` on the model vector, fed ``-Delta`` as gradient.

    With momentum 0 and lr 1.0 each step is ``x + Delta`` exactly (``-1 * -Delta`` is exact), FedAvg.
    The parameter is made on the first step or load, so that clients building the algorithm hold
    no copy of the model here.
    """

    def __init__(self, num_values: int, lr: float = 1.0, momentum: float = 0.0) -> None:
        self.num_values, self.lr, self.momentum = num_values, lr, momentum
        self._optimizer: torch.optim.SGD | None = None

    def _sgd(self) -> torch.optim.SGD:
        if self._optimizer is None:
            param = torch.nn.Parameter(torch.zeros(self.num_values))
            self._optimizer = torch.optim.SGD([param], lr=self.lr, momentum=self.momentum)
        return self._optimizer

    def step(self, model: Tensor, update: Tensor) -> Tensor:
        sgd = self._sgd()
        param = sgd.param_groups[0]["params"][0]
        with torch.no_grad():
            param.copy_(model)
        param.grad = -update
        sgd.step()
        param.grad = None
        return param.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return self._sgd().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # torch keeps the given buffers as they are (same dtype and device): copy them, so the caller's stay unchanged.
        self._sgd().load_state_dict(copy.deepcopy(state))


class AdaptiveServerOptimizer:
    """``fedadam`` (``yogi=False``) and ``fedyogi`` (``yogi=True``), Reddi et al. Algorithm 2 (module docstring)."""

    def __init__(
        self, num_values: int, lr: float, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, yogi: bool = False
    ) -> None:
        self.num_values, self.lr, self.yogi = num_values, lr, yogi
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.m: Tensor | None = None
        self.v: Tensor | None = None

    def step(self, model: Tensor, update: Tensor) -> Tensor:
        if self.m is None or self.v is None:
            self.m = torch.zeros(self.num_values)
            self.v = torch.full((self.num_values,), self.tau**2)
        self.m.mul_(self.beta1).add_(update, alpha=1 - self.beta1)
        square = update * update
        if self.yogi:
            self.v.sub_(square * torch.sign(self.v - square), alpha=1 - self.beta2)
        else:
            self.v.mul_(self.beta2).add_(square, alpha=1 - self.beta2)
        return model + self.lr * self.m / (self.v.sqrt() + self.tau)

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.v = (None if state[key] is None else state[key].clone() for key in ("m", "v"))


class ServerSGD(TorchSGD):
    """``x <- x + lr Delta``; lr 1.0 is FedAvg (the default)."""

    @classmethod
    def from_config(cls, cfg: ServerOptimizerConfig, num_values: int) -> TorchSGD:
        return cls(num_values, cfg.lr or 1.0)


class MomentumOptions(BaseModel):
    """``fedavgm``'s settings (``algorithm.server_optimizer.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0, description="server momentum")


class FedAvgM(TorchSGD):
    """Server momentum (Hsu et al., 2019): ``v <- momentum v + Delta; x <- x + lr v``."""

    Options = MomentumOptions

    @classmethod
    def from_config(cls, cfg: ServerOptimizerConfig, num_values: int) -> TorchSGD:
        return cls(num_values, cfg.lr or 1.0, cfg.options_of().momentum)


class AdaptiveOptions(BaseModel):
    """``fedadam``'s and ``fedyogi``'s settings (``algorithm.server_optimizer.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0, description="decay of the first moment")
    beta2: float = Field(default=0.99, ge=0.0, lt=1.0, description="decay of the second moment")
    tau: float = Field(default=1e-3, gt=0.0, description="adaptivity, added to sqrt(v)")


class FedAdam(AdaptiveServerOptimizer):
    """FedAdam (Reddi et al., 2021): Adam on the server, without bias correction; it needs ``lr``."""

    Options = AdaptiveOptions
    yogi = False

    @classmethod
    def check(cls, cfg: ServerOptimizerConfig) -> None:
        """Refuse a config without ``lr``: the paper gives it no default."""
        if cfg.lr is None:
            raise ValueError(f"{cfg.name} needs lr (Reddi et al. tune it between 1e-3 and 1)")

    @classmethod
    def from_config(cls, cfg: ServerOptimizerConfig, num_values: int) -> AdaptiveServerOptimizer:
        options = cfg.options_of()
        return cls(num_values, cfg.lr, options.beta1, options.beta2, options.tau, yogi=cls.yogi)


class FedYogi(FedAdam):
    """FedYogi (Reddi et al., 2021): Yogi's additive second-moment update on the server; it needs ``lr``."""

    yogi = True


SERVER_OPTIMIZERS.register("sgd", ServerSGD)
SERVER_OPTIMIZERS.register("fedavgm", FedAvgM)
SERVER_OPTIMIZERS.register("fedadam", FedAdam)
SERVER_OPTIMIZERS.register("fedyogi", FedYogi)


def build_server_optimizer(cfg: ServerOptimizerConfig, num_values: int) -> ServerOptimizer:
    """The server optimiser ``cfg.name`` names, for a model of ``num_values`` parameters."""
    return SERVER_OPTIMIZERS.get(cfg.name).from_config(cfg, num_values)


__all__ = [
    "SERVER_OPTIMIZERS",
    "AdaptiveOptions",
    "AdaptiveServerOptimizer",
    "FedAdam",
    "FedAvgM",
    "FedYogi",
    "MomentumOptions",
    "ServerOptimizer",
    "ServerSGD",
    "TorchSGD",
    "build_server_optimizer",
]
