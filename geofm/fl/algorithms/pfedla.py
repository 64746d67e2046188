"""pFedLA: layer-wise personalised aggregation by per-client hypernetworks.

Ma, Zhang, Guo and Xu, "Layer-Wised Model Aggregation for Personalized Federated Learning",
CVPR 2022. The server keeps every client's latest model ``theta_j`` (the shared parameters,
grouped into ``L`` layers) and, per client ``i``, a hypernetwork ``HN_i``: an embedding
``v_i`` of ``embedding_dim`` values, an MLP of three ``hidden_dim``-wide linear layers each
followed by a ReLU, and one linear head per layer onto the ``N`` clients, its output passed
through a ReLU::

    a_i^l = ReLU(W_l MLP(v_i) + b_l)                    (N values per layer l)
    alpha_ij^l = a_ij^l / sum_k a_ik^l                  (each layer's weights sum to 1)
    theta_bar_i^l = sum_j alpha_ij^l theta_j^l          (client i's personalised model)

Client ``i`` receives ``theta_bar_i`` as its ``model`` payload (each client its own), trains
from it and uploads ``delta_i = theta_i - theta_bar_i`` (FedAvg's ``update``). ``delta_i`` is
the descent direction of the client's loss at ``theta_bar_i``, so ``-delta_i`` stands in for the
gradient ``dL_i/dtheta_bar_i``; the chain rule through the aggregation gives the gradients of
``HN_i``'s parameters ``phi_i`` and of ``v_i``, stepped by plain SGD at ``hn_lr``::

    g_phi = (d theta_bar_i / d phi_i)^T (-delta_i),    phi_i <- phi_i - hn_lr g_phi     (and v_i alike)
    theta_i <- theta_bar_i + delta_i

Since ``theta_bar_i`` is linear in ``alpha_i``, ``(d theta_bar_i / d alpha_ij^l)^T delta_i`` is
the dot product ``<delta_i^l, theta_j^l>``: the server backpropagates these ``N x L`` numbers
through ``HN_i`` and never builds a graph over model-sized vectors.

The hypernetwork, its initialisation (the embedding ``N(0, 1)``, the MLP as ``torch.nn.Linear``,
the heads ``U(0, 1)`` with zero bias so that the ReLUs start on), the per-layer normalisation by
the sum and the defaults (plain SGD, ``hn_lr`` 5e-3, ``embedding_dim`` and ``hidden_dim`` 100)
follow the public implementation github.com/KarhouTam/pFedLA (whose README says it is not the
authors' own release) and its later version in FL-bench. Deliberate deviations:

* Sign: both step ``phi_i - hn_lr (d theta_bar_i / d phi_i)^T delta_i``, which moves
  ``theta_bar_i`` away from the client's trained model; the step above descends, as pFedHN's
  official hypernetwork update does (Shamsian et al., ICML 2021).
* Parallel rounds: that code trains the selected clients one after another, each later one
  mixing the models the earlier ones just updated; here the round's clients train at once, all
  from the models at the round's start.
* A layer whose ``a_i^l`` is all zero (every ReLU off) falls back to the client's own model
  (``alpha_ii^l = 1``), as FL-bench's version does; the first version raises an error.
* Layers (``layers``): ``tensor`` makes each parameter tensor a layer (FL-bench's choice; the
  first version takes each top-level module of its small CNNs); ``module`` each module's
  parameters (a linear layer's weight and bias); ``block`` (default) a name up to its last numeric
  component (a Swin's ``layers.0.blocks.1``, and ``layers.1`` for the stage's downsampling), its
  module for names without one; ``stage`` a name up to its first numeric component (a Swin's
  ``layers.0``). A Swin-T's 173 tensors make 19 layers by ``block``, 8 by ``stage``.
* HeurpFedLA (the variant that keeps the K layers a client weighs most on itself as its own) is
  left out.

The global model the server validates and exports is the data-weighted mean of the clients'
models (each client's latest example count; clients that never uploaded are left out); the
algorithm is ``personalised``. A client never selected yet holds the run's initial model.

Server memory: ``N + 1`` model copies (each client's model and the initial one) plus ``N``
hypernetworks of ``E + 2 H^2 + (E + 3) H + L N (H + 1)`` values (``E`` = ``embedding_dim``,
``H`` = ``hidden_dim``); plain SGD keeps no optimiser state. All of it is the algorithm's
per-client state, checkpointed with the round. Every client's downlink is its own model, so a
compressed downlink (a change to a copy shared by all clients) is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import RoundAggregate, weighted_mean
from geofm.fl.algorithms.base import Algorithm
from geofm.fl.algorithms.rounds import Arrays, LocalRound, LocalUpdate, ServerRound
from geofm.fl.communication.codec import Codec
from geofm.fl.parameter_vectors import ParameterLayout

MLP_DEPTH = 3
_INDEX = re.compile(r"\.\d+(?=\.|$)")


class PFedLAOptions(BaseModel):
    """pFedLA's settings (``algorithm.options``)."""

    model_config = ConfigDict(extra="forbid")

    hn_lr: float = Field(
        default=5e-3, gt=0.0, description="SGD learning rate of each client's hypernetwork and embedding"
    )
    embedding_dim: int = Field(default=100, gt=0, description="length of each client's embedding v_i")
    hidden_dim: int = Field(default=100, gt=0, description="width of the hypernetworks' three hidden layers")
    layers: Literal["tensor", "module", "block", "stage"] = Field(
        default="block", description="how parameters group into the layers that share one aggregation weight"
    )


def layer_names(names: Sequence[str], rule: str) -> list[str]:
    """The layer of each parameter name under ``rule`` (see the module docstring)."""
    if rule == "tensor":
        return list(names)
    modules = [name.rpartition(".")[0] or name for name in names]
    if rule == "module":
        return modules
    layers = []
    for name, module in zip(names, modules, strict=True):
        indices = list(_INDEX.finditer(name))
        layers.append(name[: indices[-1 if rule == "block" else 0].end()] if indices else module)
    return layers


def init_hypernetwork(layers: int, clients: int, options: PFedLAOptions, seed: int) -> dict[str, Tensor]:
    """A fresh hypernetwork's tensors, drawn from a generator seeded by ``seed`` (the client's index)."""
    generator = torch.Generator().manual_seed(seed)
    hn = {"embedding": torch.randn(options.embedding_dim, generator=generator)}
    width = options.embedding_dim
    for k in range(MLP_DEPTH):  # torch.nn.Linear's initialisation
        bound = 1 / math.sqrt(width)
        hn[f"mlp.{k}.weight"] = (torch.rand(options.hidden_dim, width, generator=generator) * 2 - 1) * bound
        hn[f"mlp.{k}.bias"] = (torch.rand(options.hidden_dim, generator=generator) * 2 - 1) * bound
        width = options.hidden_dim
    hn["head.weight"] = torch.rand(layers * clients, options.hidden_dim, generator=generator)
    hn["head.bias"] = torch.zeros(layers * clients)
    return hn


def aggregation_weights(hn: Mapping[str, Tensor], layers: int, client: int) -> Tensor:
    """``alpha_i``: each layer's weights over the clients (``layers x N``), normalised to sum to 1.

    A layer whose ReLU outputs are all zero falls back to the client's own model.
    """
    x = hn["embedding"]
    for k in range(MLP_DEPTH):
        x = torch.relu(hn[f"mlp.{k}.weight"] @ x + hn[f"mlp.{k}.bias"])
    raw = torch.relu(hn["head.weight"] @ x + hn["head.bias"]).view(layers, -1)
    total = raw.sum(dim=1, keepdim=True)
    own = torch.nn.functional.one_hot(torch.tensor(client), raw.shape[1]).to(raw.dtype).expand_as(raw)
    return torch.where(total > 0, raw / total.clamp_min(torch.finfo(raw.dtype).tiny), own)


class PFedLA(Algorithm):
    """pFedLA: each client's model is a layer-wise mix of all clients' models, by weights its hypernetwork
    learns from the client's updates; up ``update``, down ``model`` (each client its own)."""

    name = "pfedla"
    uplink = ("update",)
    downlink = ("model",)
    own_server_rule = "mixes the clients' models by its hypernetworks' weights and keeps no combined update"
    Options = PFedLAOptions
    personalised = True

    def __init__(
        self,
        cfg: AlgorithmConfig,
        layout: ParameterLayout | int,
        declared_examples: Mapping[str, int] | None = None,
        num_clients: int | None = None,
        num_rounds: int | None = None,
    ) -> None:
        super().__init__(cfg, layout, declared_examples, num_clients, num_rounds)
        groups = layer_names(self.shared.names, self.options.layers)
        self.layers = list(dict.fromkeys(groups))
        # Runs of consecutive values in one layer: (start, end, layer index).
        self.runs: list[tuple[int, int, int]] = []
        start = 0
        for group, size in zip(groups, self.shared.sizes, strict=True):
            layer = self.layers.index(group)
            if self.runs and self.runs[-1][2] == layer and self.runs[-1][1] == start:
                self.runs[-1] = (self.runs[-1][0], start + size, layer)
            else:
                self.runs.append((start, start + size, layer))
            start += size

    @classmethod
    def check_config(cls, cfg: AlgorithmConfig) -> None:
        super().check_config(cfg)
        if cfg.downlink_for("model").bits != 32:
            raise ValueError(
                "downlink.bits: pfedla sends each client its own personalised model, not a change to a copy "
                "every client shares; leave downlink.bits (and downlink_payloads.model.bits) at 32"
            )

    # ---- server state -----------------------------------------------------------------------
    def _index(self, client: str) -> int:
        """The client's column in every ``alpha`` (its place in the order clients were first sent to)."""
        if client not in self.client_state:
            if self.num_clients is None:
                raise ConfigError("pFedLA's server needs the federation's number of clients")
            if len(self.client_state) >= self.num_clients:
                raise ConfigError(
                    f"pFedLA: client {client!r} would be client {len(self.client_state) + 1} of a federation "
                    f"of {self.num_clients} ({sorted(self.client_state)})"
                )
            index = len(self.client_state)
            hn = init_hypernetwork(len(self.layers), self.num_clients, self.options, seed=index)
            self.client_state[client] = {"index": torch.tensor([index]), **{f"hn.{k}": v for k, v in hn.items()}}
        return int(self.client_state[client]["index"][0])

    def _hypernetwork(self, client: str) -> dict[str, Tensor]:
        return {k.removeprefix("hn."): v for k, v in self.client_state[client].items() if k.startswith("hn.")}

    def _models(self) -> list[Tensor]:
        """``theta_j`` of every client column: its latest model, or the initial model before it has one."""
        models = [self.state["initial"]] * self.num_clients
        for values in self.client_state.values():
            if "model" in values:
                models[int(values["index"][0])] = values["model"]
        return models

    def _mix(self, alpha: Tensor, models: Sequence[Tensor]) -> Tensor:
        """``theta_bar^l = sum_j alpha_j^l theta_j^l`` for every layer ``l``."""
        mixed = torch.zeros(self.num_values)
        for start, end, layer in self.runs:
            for j, model in enumerate(models):
                mixed[start:end] += alpha[layer, j] * model[start:end]
        return mixed

    def personalised_model(self, client: str) -> Tensor:
        """``theta_bar_i``, the model the client is sent this round."""
        alpha = aggregation_weights(self._hypernetwork(client), len(self.layers), self._index(client))
        return self._mix(alpha.detach(), self._models())

    # ---- server: downlink ---------------------------------------------------------------------
    def send(
        self, model: Tensor, rnd: int, clients: Sequence[str], generator: torch.Generator
    ) -> dict[str, tuple[Arrays, dict[str, Any]]]:
        """Each client's personalised model, whole; the first round's global model starts every client's."""
        self.state.setdefault("initial", model.clone())
        for client in sorted(clients):
            self._index(client)
        encode = Codec(bits=32).encode
        return {
            c: (
                {f"model.{k}": v for k, v in encode(self.personalised_model(c)).to_arrays().items()},
                {"downlink": "model"},
            )
            for c in clients
        }

    # ---- client -----------------------------------------------------------------------------
    def finish_local(self, local: LocalRound, trained: Tensor, steps: int) -> LocalUpdate:
        return LocalUpdate({"update": trained - local.received["model"]})

    # ---- server: update -----------------------------------------------------------------------
    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """Step each accepted client's hypernetwork by its update, set its model to ``theta_bar_i + delta_i``,
        and the global model to the data-weighted mean of the clients' models."""
        models = self._models()
        client_state: dict[str, dict[str, Tensor]] = {}
        self_weights = []
        for upload in payloads["update"].accepted:
            index, delta = self._index(upload.client), upload.update
            hn = {k: v.clone().requires_grad_(True) for k, v in self._hypernetwork(upload.client).items()}
            alpha = aggregation_weights(hn, len(self.layers), index)
            # <delta^l, theta_j^l>: the surrogate gradient -delta through the linear mix, per layer and client.
            dots = torch.zeros(len(self.layers), self.num_clients)
            for start, end, layer in self.runs:
                for j, theta in enumerate(models):
                    dots[layer, j] += torch.dot(delta[start:end], theta[start:end])
            grads = torch.autograd.grad(-(alpha * dots).sum(), list(hn.values()))
            stepped = {
                f"hn.{k}": (v - self.options.hn_lr * g).detach() for (k, v), g in zip(hn.items(), grads, strict=True)
            }
            alpha = alpha.detach()
            theta = self._mix(alpha, models) + delta
            client_state[upload.client] = {
                **stepped,
                "model": theta,
                "examples": torch.tensor([upload.num_examples]),
            }
            self_weights.append(float(alpha[:, index].mean()))
        examples = {c: v for c, v in self.client_state.items() if "examples" in v}
        examples.update(client_state)
        global_model = weighted_mean(
            [v["model"] for v in examples.values()], [float(v["examples"][0]) for v in examples.values()]
        )
        metrics = {"self_weight": sum(self_weights) / len(self_weights), "layers": float(len(self.layers))}
        return ServerRound(global_model, metrics, client_state=client_state)


__all__ = ["PFedLA", "PFedLAOptions", "aggregation_weights", "init_hypernetwork", "layer_names"]
