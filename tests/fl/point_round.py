"""A client's round of the federated client (:class:`~geofm.fl.client_round.ClientRound`) on a point
``y`` trained on ``f(y) = ||y - b||^2 / 2`` (gradient ``y - b``), for checking algorithms against their
papers' numbers on the engine the runtime trains with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.config.federated import LocalTrainConfig
from geofm.fl.client_round import ClientRound, RoundResult
from geofm.tasks import StepOutput


class Point(nn.Module):
    """y, trained on f(y) = ||y - b||^2 / 2 for the micro-batch b, whose gradient is y - b."""

    def __init__(self) -> None:
        super().__init__()
        self.y = nn.Parameter(torch.zeros(2))

    def forward(self, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.y - target) ** 2).sum()


class PointTask:
    """The task interface a client round reads, for :class:`Point`: each micro-batch is a target b."""

    log_keys = ("loss",)

    def build_model(self, initial_weights: bool = True) -> Point:
        return Point()

    def prepare(self, model: Point) -> None:
        pass

    def param_groups(self, model: Point) -> None:
        return None

    def forward(self, engine, target: torch.Tensor) -> StepOutput:
        return StepOutput({"loss": engine(target)})

    def after_step(self, model: Point, progress: float) -> None:
        pass


@dataclass
class Run:
    seed: int = 0


@dataclass
class Federation:
    rounds: int = 1


@dataclass
class PointConfig:
    """What a client round reads of a federated config: the algorithm, plain SGD steps, the seed."""

    algorithm: AlgorithmConfig
    train: LocalTrainConfig
    run: Run = field(default_factory=Run)
    federation: Federation = field(default_factory=Federation)


def point_round(
    cfg: AlgorithmConfig, name: str, arrays, config, state, target: torch.Tensor, steps: int, lr: float
) -> RoundResult:
    """Client ``name``'s round from the server's ``arrays`` and ``config`` (with its ``round``): ``steps`` SGD
    steps (no momentum, no weight decay) at ``lr`` towards ``target``."""
    train = LocalTrainConfig(
        micro_batch_size=1,
        local_epochs=None,
        local_steps=steps,
        precision="fp32",
        optimizer={"name": "sgd", "base_lr": lr, "momentum": 0.0, "weight_decay": 0.0},
    )
    local = ClientRound(PointTask(), PointConfig(cfg, train), name, int(config["round"]), lr)
    result = local.run(arrays, config, state, [[target]] * steps)
    assert result is not None, "one process: rank 0 answers"
    return result
