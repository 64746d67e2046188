"""FedBN: FedAvg whose normalisation layers stay on each client.

Li, Jiang, Zhang, Kamp and Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021. Clients whose data differ in their features (sensors, scanners,
seasons) keep their own normalisation layers, which absorb that shift, and federate the rest.

Write ``S`` for the shared parameters and ``N`` for the normalisation parameters (the affine
weight and bias of the normalisation modules ``Options.layers`` names), ``Theta^t`` for the
global shared parameters of round ``t`` and ``nu_k^t`` for client ``k``'s own normalisation
parameters, ``p_k = n_k / sum_j n_j`` its weight. In round ``t`` each selected client ``k``:

* starts from ``theta_k = (Theta^t on S, nu_k^t on N)``, and from its own batch-norm running
  statistics ``(mu_k, sigma2_k)``; a client that holds none yet starts from the server model's start
  values ``nu^0`` and statistics, so every client starts from the same model (Algorithm 1's
  common initialisation);
* runs its local steps on its own data (plain FedAvg steps) to ``theta_k'``;
* keeps ``nu_k^{t+1} = theta_k'|N`` and its updated statistics, and uploads
  ``Delta_k = theta_k'|S - Theta^t`` (payload ``update``) and ``nu_k^{t+1}`` (payload ``norms``).

The server takes FedAvg's step on the shared parameters only,
``Theta^{t+1} = Theta^t + sum_k p_k Delta_k`` (the configured ``aggregator`` and
``server_optimizer``), and never sends any client's normalisation values to another.

Deliberate deviations:

* **Which layers.** ``Options.layers: batchnorm`` is the paper's rule: BatchNorm layers only.
  The default, ``all``, keeps BatchNorm, LayerNorm and GroupNorm local. The backbones geofm trains
  (Swin, ViT) normalise only with LayerNorm, so under ``batchnorm`` a Swin would keep nothing of
  its own and FedBN would be FedAvg (in pretraining, where no BatchNorm exists, ``batchnorm`` is
  refused for that reason). The paper's argument is that the normalisation's affine parameters and
  statistics absorb a client's feature shift; a LayerNorm's statistics are per sample, so its
  affine parameters are where that shift can be held, and they are the natural reading of FedBN
  for these backbones.
* **Weights.** The paper averages with ``1/K``; here clients are weighted by examples as in
  FedAvg (the paper's experiments give every client the same number of samples, where both agree).
* **What the server's own model holds.** In the paper the server never sees normalisation layers,
  yet geofm's server validates a global model each round and exports one at the end. Each client
  therefore also uploads its normalisation parameters (payload ``norms``, with its own codec and
  error feedback, ``uplink_payloads.norms``) and its batch-norm statistics (beside the payloads, as
  for every algorithm); the server averages both, ``nu-bar = sum_k p_k nu_k^{t+1}``, into the model
  it validates, checkpoints and exports, and never sends them back: what it sends down (payload
  ``norms`` and the statistics) is only the start values, for clients that hold none yet. The
  clients' mean is a trained consensus for those layers, a better export than the start values,
  which under ``all`` would leave untrained normalisation in a trained network.
  The per-client models, FedBN's actual product, are evaluated by the runtime (``personalised``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import Arrays, LocalRound, LocalUpdate, ServerRound
from geofm.fl.parameter_vectors import NORM_KINDS, ParameterLayout


@dataclass(eq=False)
class NormRound(LocalRound):
    """A local round that also holds the trained module's normalisation parameters (layout order)."""

    norms: list[Tensor] = field(default_factory=list)


class FedBN(FedAvg):
    """FedAvg with client-local normalisation layers: up ``update`` and ``norms``, down ``model`` and the
    start ``norms`` (see the module docstring)."""

    name = "fedbn"
    uplink = ("update", "norms")
    downlink = ("model", "norms")
    personalised = True
    keeps_local_statistics = True

    class Options(BaseModel):
        """FedBN's settings (``algorithm.options``)."""

        model_config = ConfigDict(extra="forbid")
        layers: Literal["batchnorm", "all"] = "all"

    def __init__(self, cfg: AlgorithmConfig, layout: ParameterLayout | int, *args, **kwargs) -> None:
        # is_local is asked during the base class's construction: the kinds must be known first.
        self.norm_kinds = dict(layout.norms) if isinstance(layout, ParameterLayout) else {}
        super().__init__(cfg, layout, *args, **kwargs)
        if not self.local.names:
            raise ConfigError(
                f"algorithm.options.layers: {self.options.layers}: the model has no such normalisation "
                "parameters to keep local; FedBN would be FedAvg (use layers: all, or fedavg)"
            )
        self.rules["norms"] = replace(self.rules["norms"], num_values=self.local.numel)
        self.start: Tensor | None = None

    def is_local(self, name: str) -> bool:
        """Whether ``name`` is a parameter of a normalisation module of the kinds ``Options.layers`` names."""
        kinds = NORM_KINDS if self.options.layers == "all" else ("batchnorm",)
        return self.norm_kinds.get(name) in kinds

    # ---- server: downlink -----------------------------------------------------------------
    def start_local(self, values: Tensor) -> None:
        self.start = values

    def downlink_values(self, model: Tensor) -> dict[str, Tensor]:
        """The global shared parameters, and the start normalisation for clients that hold none yet."""
        if self.start is None:
            raise RuntimeError("FedBN's server sends the start normalisation: call start_local first")
        return {"model": model, "norms": self.start}

    # ---- client ---------------------------------------------------------------------------
    def receive(
        self, client: str, arrays: Arrays, config: Mapping[str, Any], state: Arrays
    ) -> tuple[dict[str, Tensor], Arrays]:
        """The payloads; a client without normalisation values of its own takes the start ones."""
        values, state = super().receive(client, arrays, config, state)
        state.setdefault("local", values["norms"].numpy())
        return values, state

    def local_round(
        self, client: str, received: dict[str, Tensor], module: nn.Module, state: Arrays, lr: float
    ) -> NormRound:
        local = super().local_round(client, received, module, state, lr)
        return NormRound(**vars(local), norms=self.local.parameters(module))

    def finish_local(self, local: NormRound, trained: Tensor, steps: int) -> LocalUpdate:
        """FedAvg's ``update``, and the client's trained normalisation parameters as ``norms``."""
        update = super().finish_local(local, trained, steps)
        update.payloads["norms"] = self.local.flatten(local.norms).cpu()
        return update

    # ---- server: uplink -------------------------------------------------------------------
    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """FedAvg's step on the shared parameters; the clients' mean normalisation for the server's own model."""
        outcome = super().server_update(model, payloads)
        outcome.state["norms"] = payloads["norms"].update
        return outcome

    def server_local(self) -> Tensor | None:
        return self.state.get("norms")


__all__ = ["FedBN"]
