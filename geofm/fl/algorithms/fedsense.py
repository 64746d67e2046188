"""FedSense: server-to-client and client-to-server guidance around FedProx."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.clustering import cluster_clients
from geofm.fl.aggregation.similarity import distill_similarity
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.context import ServerContext
from geofm.fl.algorithms.fedprox import FedProx
from geofm.fl.algorithms.rounds import LocalHooks, LocalRound, ServerRound
from geofm.fl.local.perturbation import Perturbation


class FedSenseOptions(BaseModel):
    """FedSense's settings (``algorithm.options``): each of its components, switchable for its ablations."""

    model_config = ConfigDict(extra="forbid")

    perturbation_radius: float = Field(
        default=0.0, ge=0.0, description="server-to-client guidance: lambda of eps = lambda d / ||d||; 0: off"
    )
    proximal_beta: float = Field(default=0.0, ge=0.0, description="weight of FedProx's proximal term; 0: none")
    clusters: int | None = Field(default=None, gt=0, description="K groups of client models; null: one per client")
    distill_steps: int = Field(
        default=0, ge=0, description="server similarity-distillation steps per round (client-to-server guidance)"
    )
    distill_lr: float = Field(default=1e-5, gt=0.0, description="AdamW learning rate of the distillation")
    distill_batch_size: int = Field(default=16, gt=1, description="public images p per distillation step")


class SimilarityDistillation:
    """FedSense's server step: the new global model trained towards its groups' consensus of how the
    server's public images relate (:func:`~geofm.fl.aggregation.similarity.distill_similarity`), with an
    optimiser of its own over the task's trainable parameters that lives as long as the run."""

    def __init__(self, context: ServerContext, steps: int, lr: float, batch_size: int) -> None:
        if context.public is None:
            raise ConfigError(
                "algorithm.options.distill_steps: FedSense distils on the server's public images, and this run's task "
                "offers none (federation.public_sources)"
            )
        self.context, self.public, self.steps, self.batch_size = context, context.public, steps, batch_size
        self.optimizer = context.optimizer(self.public.trainable(context.model), lr)

    def __call__(
        self, rnd: int, model: Tensor, groups: Sequence[Tensor], weights: Sequence[float]
    ) -> tuple[Tensor, float]:
        """Distil ``model`` (a global vector) towards the group models of round ``rnd``; returns the
        distilled vector and the mean loss of the steps."""
        module, layout = self.context.model, self.context.layout
        layout.assign(module, model)
        module.eval()  # no drop-path: the groups' targets are deterministic
        params = [layout.unflatten(g) for g in groups]
        batches = self.public.batches(rnd, self.batch_size)
        loss = distill_similarity(module, params, weights, batches, self.public.features, self.optimizer, self.steps)
        return layout.flatten_module(module), loss


class FedSense(FedProx):
    """FedSense: server-to-client and client-to-server guidance.

    Client: each local gradient is taken at ``theta + lambda d / ||d||`` (``d = theta - Theta``, the
    drift from the round's global model) and applied at ``theta``; the proximal term is added when
    ``proximal_beta`` is set. Server: the client models ``Theta + delta_i`` are grouped by K-means
    (``clusters``), and the averaged model is refined by similarity distillation towards the
    groups' data-weighted consensus on public images (``distill_steps``). With ``algorithm.sam`` the
    drift perturbation applies first and SAM's ascent is taken from the perturbed point: the gradient is
    ``grad L(theta + eps + e)``, ``e`` from ``grad L(theta + eps)``, applied at ``theta``.

    The server streams: the mean, the count sketches K-means clusters (4096 values per client) and
    the group means each take one decoded update at a time, so it holds the ``clusters`` group
    models and no client's decoded update beyond the one in hand (with ``clusters`` unset every
    client is a group, and the group models grow with the clients).
    """

    name = "fedsense"
    Options = FedSenseOptions
    distillation: SimilarityDistillation | None = None  # the server's, once attached with distill_steps

    @classmethod
    def check_config(cls, cfg: AlgorithmConfig) -> None:
        super().check_config(cfg)
        if cfg.privacy is not None and cfg.privacy.mode == "central" and cls.options_of(cfg).distill_steps:
            raise ValueError(
                "options.distill_steps: central privacy noises only the round's mean update, and the similarity "
                "distillation groups the clients' own updates; set distill_steps to 0 or use local privacy"
            )

    @classmethod
    def check_public_images(cls, cfg: AlgorithmConfig, available: bool) -> None:
        if cls.options_of(cfg).distill_steps and not available:
            raise ValueError(
                "options.distill_steps: FedSense's similarity distillation trains on the server's public images, "
                "and this run has none (federation.public_sources of a pretraining run; federated finetuning has "
                "none: set distill_steps to 0)"
            )

    def attach(self, context: ServerContext) -> None:
        """Build the similarity distillation (``distill_steps`` above 0) on the server's context."""
        super().attach(context)
        options = self.options
        if options.distill_steps:
            self.distillation = SimilarityDistillation(
                context, options.distill_steps, options.distill_lr, options.distill_batch_size
            )

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        hooks = super().local_hooks(local)
        radius = self.options.perturbation_radius
        if radius:
            hooks.around_gradient = Perturbation(local.params, local.anchor, radius)
        return hooks

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        update = super().server_update(model, payloads)
        if not self.options.distill_steps:
            return update
        if self.distillation is None:
            raise RuntimeError("FedSense's distillation runs on the server's context: attach it before the rounds")
        # K-means sees distances only, and Theta is common to every client model Theta + delta_i:
        # the updates give the same groups, and a group's model is Theta plus its mean update.
        # The updates are decoded as K-means and the group means take them, one at a time (the server
        # holds the encoded uploads and the group models, whatever the number of clients).
        aggregate = payloads["update"]
        counts = [a.num_examples for a in aggregate.accepted]
        groups = cluster_clients(aggregate.updates, counts, self.options.clusters or len(counts))
        refined, loss = self.distillation(
            self.round, update.model, [model + mean for mean in groups.models], groups.weights
        )
        return ServerRound(refined, {"loss_similarity": loss, "groups": float(len(groups.models))})

    def distillation_optimizer(self) -> torch.optim.Optimizer | None:
        return None if self.distillation is None else self.distillation.optimizer


__all__ = ["FedSense", "FedSenseOptions", "SimilarityDistillation"]
