"""SCAFFOLD: stochastic controlled averaging (Karimireddy et al., ICML 2020, Algorithm 1).

Each client keeps a control variate ``c_i`` (its state, zero at first); the server keeps ``c``
(zero at first) and sends it with the model ``x``. A client's local steps follow the corrected
gradient ``g(y) - c_i + c``: the correction is added to the loss as the linear term
``<c - c_i, y>``, whose gradient is exactly ``c - c_i`` (its value is subtracted again, so the
logged loss is unchanged). It therefore passes through gradient accumulation, clipping and any
local optimiser like the loss's own gradient. After ``K`` local optimizer steps at learning rate
``eta_l`` the client takes option II of the paper::

    c_i+ = c_i - c + (x - y_i) / (K * eta_l)

and uploads ``delta_y = y_i - x`` and ``delta_c = c_i+ - c_i``, two payloads with their own
codecs and error-feedback residuals. The server, with ``S`` the round's accepted clients and
``N`` all clients::

    x <- x + eta_g * mean_S(delta_y)        c <- c + |S| / N * mean_S(delta_c)

Means are plain means over clients, the paper's rule: ``c`` then stays the mean of all clients'
``c_i``. Option II reuses the round's own progress ``(x - y_i) / (K eta_l)``, the average corrected
gradient over the round, instead of option I's extra pass over the client's data for a gradient
at ``x``: it costs no more computation than FedAvg. ``eta_l`` is the round's learning rate (the
schedule's value for the round).

The local optimiser is the paper's plain SGD (no momentum, no weight decay: its analysis and
experiments), declared as :attr:`Scaffold.local_optimizer`: with it, option II's estimate is
exactly the mean corrected gradient. Under AdamW (``train.optimizer: {name: adamw}``, with a
warning) each step moves a coordinate by about ``eta_l`` whatever its gradient's size, so the
estimate is the mean normalised step, about 1 per coordinate (``control_norm`` near the square root
of the parameter count), and the correction ``c - c_i`` built from it swamps the loss's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from geofm.config.federated import LocalOptimizerConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import RoundAggregate, weighted_mean
from geofm.fl.algorithms.base import Algorithm
from geofm.fl.algorithms.rounds import LocalHooks, LocalRound, LocalUpdate, ServerRound

SGD_BASE_LR = 0.05
"""The SGD learning rate per ``train.lr_reference_batch`` images that SCAFFOLD, FedDC, FedNova and FedGloSS
declare: the papers' rates (0.01-0.1 at batches of 32-64) are for their networks; this one learns the
demo's finetuning (a micro Swin, batch 8) within its 8 rounds."""


def option_ii_control(c_i: Tensor, c: Tensor, delta: Tensor, steps: int, lr: float) -> Tensor:
    """A client's next control variate by option II: ``c_i - c + (x - y_i) / (K eta_l)``, with
    ``delta = y_i - x`` its round's change after ``steps`` (K) steps at rate ``lr`` (eta_l)."""
    return c_i - c - delta / (steps * lr)


class ScaffoldOptions(BaseModel):
    """SCAFFOLD's settings (``algorithm.options``)."""

    model_config = ConfigDict(extra="forbid")

    server_lr: float = Field(default=1.0, gt=0.0, description="the server's step eta_g on the mean update")


class Scaffold(Algorithm):
    """SCAFFOLD, option II: up ``delta_y`` and ``delta_c``, down ``model`` and ``control``; ``options.server_lr`` is eta_g."""

    name = "scaffold"
    uplink = ("delta_y", "delta_c")
    downlink = ("model", "control")
    own_server_rule = "combines the uploads by the paper's plain means and steps by options.server_lr"
    Options = ScaffoldOptions
    local_optimizer = LocalOptimizerConfig(name="sgd", base_lr=SGD_BASE_LR, momentum=0.0, weight_decay=0.0)
    local_optimizer_source = "Karimireddy et al., ICML 2020: plain local SGD"

    def downlink_values(self, model: Tensor) -> dict[str, Tensor]:
        return {"model": model, "control": self.global_vector("control")}

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        correction = self.shared.split(local.received["control"] - self.client_vector(local, "control"))
        pairs = [(p, d.to(p.device)) for p, d in zip(local.params, correction, strict=True)]

        def regulariser(batch, output) -> Tensor:
            linear = sum(torch.sum(p.float() * d) for p, d in pairs)
            return linear - linear.detach()

        return LocalHooks(regulariser=regulariser)

    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        if steps < 1:
            raise ValueError(f"client {local.client}: SCAFFOLD needs at least one local step, got {steps}")
        x, c, c_i = local.received["model"], local.received["control"], self.client_vector(local, "control")
        c_new = option_ii_control(c_i, c, trained - x, steps, local.lr)
        local.state["control"] = c_new.numpy()
        return LocalUpdate({"delta_y": trained - x, "delta_c": c_new - c_i})

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        if self.num_clients is None:
            raise ConfigError("SCAFFOLD's server update needs the federation's number of clients")
        accepted = {p: payloads[p].updates for p in self.uplink}
        size = len(accepted["delta_y"])
        delta_y = weighted_mean(accepted["delta_y"], [1.0] * size)
        delta_c = weighted_mean(accepted["delta_c"], [1.0] * size)
        control = self.global_vector("control") + (size / self.num_clients) * delta_c
        return ServerRound(
            model + self.options.server_lr * delta_y,
            {"control_norm": float(torch.linalg.vector_norm(control))},
            state={"control": control},
        )


__all__ = ["Scaffold", "ScaffoldOptions", "option_ii_control"]
