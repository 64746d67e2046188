"""Server-side weight averaging: SWA and WiMA. The server validates and exports an average of its own
global models; the clients train on from the latest global model, as with FedAvg.

``swa``: stochastic weight averaging (Izmailov, Podoprikhin, Garipov, Vetrov and Wilson, "Averaging
Weights Leads to Wider Optima and Better Generalization", UAI 2018) on the server, as Caldarola,
Caputo and Ciccone apply it to federated learning ("Improving Generalization in Federated Learning
by Seeking Flat Minima", ECCV 2022; official code github.com/debcaldarola/fedsam). From round ``s``
(``start``) the rounds run in cycles of ``c`` rounds (``cycle``); round ``r``'s server step is
scaled by SWA's cyclical learning rate, falling linearly from ``lr_max`` to ``lr_min`` within each
cycle::

    t(r) = (((r - s) mod c) + 1) / c
    rho(r) = (1 - t(r)) lr_max + t(r) lr_min
    x_r = x_{r-1} + rho(r) (step_r - x_{r-1})

where ``step_r`` is FedAvg's next model (``aggregator`` and ``server_optimizer``, ``x + Delta`` by
default): ``rho`` scales the server optimiser's learning rate (exactly, for sgd, fedavgm, fedadam and
fedyogi, whose steps are linear in their rate). At the end of each cycle (``t = 1``, the
rate at ``lr_min``) the new model joins the running average, ``torch.optim.swa_utils``'s
``get_swa_avg_fn``::

    w_swa <- (n w_swa + x_r) / (n + 1),  n <- n + 1

``w_swa`` is what the server validates and exports once it exists; before the first cycle ends
it is the training model. Rounds before ``s`` are FedAvg's. rounds.jsonl logs ``server_lr``
(``rho``, 1 outside the cycles) and ``swa_models`` (``n``).

Settings: ``start`` (default: after 75% of ``federation.rounds``, the paper's and the code's
``int(0.75 * rounds)`` FedAvg rounds), ``cycle`` (default 10, the paper's experiments'
``--swa-c 10``), ``lr_max`` 1.0 (FedAvg's step) and ``lr_min`` 0.01 (the paper's ratio of
``swa_lr`` 1e-4 to the client rate 1e-2).

Deviations from the official code, named:

* The cyclical rate scales the server step; the official code cycles the clients' learning rate
  (from the client rate to ``--swa-lr``). To first order in the local rate a client's update scales
  with its rate, so the two move the global model alike; geofm's client rate follows
  ``train.lr_schedule`` unchanged.
* Models are collected at the end of each cycle, where the rate reaches ``lr_min``, as SWA's
  Algorithm 1 does. The code counts the rate's phase from round 0 (``round % c``) and collects
  at ``(round - swa_start) % c == 0``, which meet at the rate's minimum only when ``swa_start`` is
  one less than a multiple of ``c``; with the paper's ``swa_start`` 7500 and ``c`` 10 it collects
  the models of the cycles' first rounds, trained at the highest rate.
* Until the first collection the server validates the training model; the code validates a copy of
  the global model frozen at the start round, which the first collection overwrites.
* With ``cycle: 1`` the rate is ``lr_min`` every round (SWA's constant schedule); the code leaves
  the clients' rate unchanged then.

``wima``: Window-based Model Averaging (Caldarola, Caputo and Ciccone, "Window-based Model Averaging
Improves Generalization in Heterogeneous Federated Learning", ICCV Workshops 2023, arXiv 2310.01366):
the server validates and exports the mean of its last ``W`` global models (``window``, default 100),
those of rounds from ``start`` on (default 1: a window, unlike SWA, can average from the first rounds)::

    w_wima(r) = 1/W sum_{q = r - W + 1}^{r} x_q      (the mean of all of them while fewer than W)

Deviation, memory-bounded: the exact sliding mean has to drop the model of round ``r - W``, so
it needs the last ``W`` models (100 copies of a Swin-B: 35 GB). WiMA here keeps the window in ``m``
blocks of ``b = W / m`` rounds (``blocks``; ``W`` a multiple of ``m``): the sums of the last ``m``
complete blocks and of the unfinished block's ``k < b`` models, ``m + 1`` vectors the size of the
model. Once ``m`` blocks are complete, the ``b - k`` models of the oldest block still in the window
count as that block's mean::

    w_wima(r) = (S_partial + sum_{j=1}^{m} S_j - (k / b) S_1) / W

Exact while the window fills, whenever ``k = 0`` (every ``b`` rounds), and always with
``blocks = window`` (``W + 1`` vectors, the exact sliding window); the default ``blocks: 1`` keeps
two vectors, a running sum and the last complete window's.

Batch-norm running statistics (UperNet decoders) are not parameters: they travel beside the model
and the server averages the clients' (``federation.programs.server``). Either average validates and exports
with the statistics of the latest round, those of the latest global model; SWA proper recomputes
them for the averaged weights with a pass over the training data (``torch.optim.swa_utils.update_bn``),
which the server, holding no training data, cannot make.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from pydantic import Field, model_validator
from torch import Tensor
from torch.optim.swa_utils import get_swa_avg_fn

from geofm.config.base import Section
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import ServerRound

SWA_START_FRACTION = 0.75
"""The share of the rounds FedAvg runs before SWA's cycles when ``start`` is unset (the paper's)."""


class SWAOptions(Section):
    """SWA's settings (``algorithm.options``)."""

    start: int | None = Field(
        default=None, ge=1, description="first round of the cycles; null: after 75% of federation.rounds"
    )
    cycle: int = Field(default=10, ge=1, description="rounds per cycle c; the average takes each cycle's last model")
    lr_max: float = Field(default=1.0, gt=0.0, description="the server step's scale at each cycle's start")
    lr_min: float = Field(default=0.01, gt=0.0, description="the server step's scale at each cycle's end")

    @model_validator(mode="after")
    def _falling(self) -> SWAOptions:
        if self.lr_min > self.lr_max:
            raise ValueError(f"lr_min {self.lr_min} is above lr_max {self.lr_max}; the rate falls within a cycle")
        return self


class WiMAOptions(Section):
    """WiMA's settings (``algorithm.options``)."""

    start: int = Field(default=1, ge=1, description="first round whose global model enters the window")
    window: int = Field(default=100, ge=1, description="W: the global models averaged")
    blocks: int = Field(default=1, ge=1, description="m: the window's blocks kept as sums; m = W is exact")

    @model_validator(mode="after")
    def _divides(self) -> WiMAOptions:
        if self.window % self.blocks:
            raise ValueError(f"window {self.window} is not a multiple of blocks {self.blocks}")
        return self


class _ServerAverage(FedAvg):
    """FedAvg whose server validates and exports an average of its global models from ``options.start``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        start = self.options.start
        if start is not None and self.num_rounds is not None and start > self.num_rounds:
            raise ConfigError(
                f"algorithm.options.start: round {start} is after the run's last round {self.num_rounds} "
                "(federation.rounds): the average would never start"
            )

    @property
    def start(self) -> int:
        """The first round of the averaging."""
        if self.options.start is not None:
            return self.options.start
        if self.num_rounds is None:
            raise ConfigError(f"{self.name}: options.start is unset and the number of rounds is unknown")
        return math.floor(SWA_START_FRACTION * self.num_rounds) + 1


class SWA(_ServerAverage):
    """SWA on the server: a cyclical server step from ``start``, each cycle's last model averaged (details in the
    module docstring)."""

    name = "swa"
    Options = SWAOptions

    def server_lr(self, rnd: int) -> float:
        """``rho(rnd)``: the scale of round ``rnd``'s server step (1 before ``start``)."""
        if rnd < self.start:
            return 1.0
        t = ((rnd - self.start) % self.options.cycle + 1) / self.options.cycle
        return (1 - t) * self.options.lr_max + t * self.options.lr_min

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        step = super().server_update(model, payloads).model
        lr = self.server_lr(self.round)
        new = step if lr == 1.0 else model + lr * (step - model)
        count = int(self.state.get("swa.models", 0))
        state = {}
        if self.round >= self.start and (self.round - self.start + 1) % self.options.cycle == 0:
            average = new if count == 0 else get_swa_avg_fn()(self.state["swa.model"], new, count)
            count += 1
            state = {"swa.model": average, "swa.models": torch.tensor(count)}
        return ServerRound(new, {"server_lr": lr, "swa_models": float(count)}, state)

    def evaluated_model(self, model: Tensor) -> Tensor:
        return self.state.get("swa.model", model)


class WiMA(_ServerAverage):
    """WiMA: the server validates and exports the mean of its last ``window`` global models (details in the
    module docstring)."""

    name = "wima"
    Options = WiMAOptions

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        outcome = super().server_update(model, payloads)
        if self.round < self.start:
            return ServerRound(outcome.model, {"wima_models": 0.0})
        size = self.options.window // self.options.blocks
        partial = self.state.get("wima.partial", torch.zeros_like(outcome.model)) + outcome.model
        count = int(self.state.get("wima.partial_models", 0)) + 1
        blocks = self.state.get("wima.blocks", outcome.model.new_zeros(0, outcome.model.numel()))
        if count == size:
            blocks = torch.cat([blocks[max(0, len(blocks) + 1 - self.options.blocks) :], partial[None]])
            partial, count = torch.zeros_like(partial), 0
        state = {"wima.partial": partial, "wima.partial_models": torch.tensor(count), "wima.blocks": blocks}
        return ServerRound(
            outcome.model, {"wima_models": float(min(len(blocks) * size + count, self.options.window))}, state
        )

    def evaluated_model(self, model: Tensor) -> Tensor:
        if "wima.blocks" not in self.state:
            return model
        return window_mean(
            self.state["wima.blocks"],
            self.state["wima.partial"],
            int(self.state["wima.partial_models"]),
            self.options.window,
            self.options.blocks,
        )


def window_mean(blocks: Tensor, partial: Tensor, count: int, window: int, kept: int) -> Tensor:
    """The window's mean from the sums of its complete ``blocks`` (oldest first, at most ``kept``) and of the
    unfinished block's ``count`` models (``partial``); the oldest block's models still in the window count as
    its mean once ``kept`` blocks are complete (module docstring)."""
    size = window // kept
    if len(blocks) < kept:
        return (blocks.sum(0) + partial) / (len(blocks) * size + count)
    return (blocks.sum(0) - (count / size) * blocks[0] + partial) / window


__all__ = ["SWA", "SWAOptions", "WiMA", "WiMAOptions", "window_mean"]
