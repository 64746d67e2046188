"""FedSense: server-to-client and client-to-server guidance around FedProx."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from geofm.config.federated import AlgorithmConfig
from geofm.federated.aggregation import RoundAggregate
from geofm.federated.algorithms.base import LocalHooks, LocalRound, Refiner, ServerRound
from geofm.federated.algorithms.fedprox import FedProx
from geofm.federated.clustering import cluster_clients
from geofm.federated.perturbation import Perturbation


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

    @classmethod
    def check_config(cls, cfg: AlgorithmConfig) -> None:
        super().check_config(cfg)
        if cfg.privacy is not None and cfg.privacy.mode == "central" and cfg.distill_steps:
            raise ValueError(
                "distill_steps: central privacy noises only the round's mean update, and the similarity "
                "distillation groups the clients' own updates; set distill_steps to 0 or use local privacy"
            )

    def local_hooks(self, local: LocalRound) -> LocalHooks:
        hooks = super().local_hooks(local)
        radius = self.cfg.perturbation_radius
        if radius:
            hooks.around_gradient = Perturbation(local.params, local.anchor, radius)
        return hooks

    def server_update(
        self, model: Tensor, payloads: Mapping[str, RoundAggregate], refine: Refiner | None
    ) -> ServerRound:
        update = super().server_update(model, payloads, refine)
        if not self.cfg.distill_steps or refine is None:
            return update
        # K-means sees distances only, and Theta is common to every client model Theta + delta_i:
        # the updates give the same groups, and a group's model is Theta plus its mean update.
        # The updates are decoded as K-means and the group means take them, one at a time (the server
        # holds the encoded uploads and the group models, whatever the number of clients).
        aggregate = payloads["update"]
        counts = [a.num_examples for a in aggregate.accepted]
        groups = cluster_clients(aggregate.updates, counts, self.cfg.clusters or len(counts))
        refined, loss = refine(update.model, [model + mean for mean in groups.models], groups.weights)
        return ServerRound(refined, {"loss_similarity": loss, "groups": float(len(groups.models))})


__all__ = ["FedSense"]
