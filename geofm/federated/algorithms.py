"""Federated algorithms as pluggable pieces: client update rule, per-client state, server update rule,
and what travels each way.

:class:`FedAvg` is the base every algorithm extends; a subclass overrides only the hooks it changes:

* :meth:`~FedAvg.local_hooks`, the client update rule: a context around each local
  forward/backward (where the parameters are evaluated) and a regulariser added to the loss;
* :meth:`~FedAvg.upload`, what a client sends: its update through the uplink codec, with error
  feedback when configured (its residual is the per-client state, serialised to arrays);
* :meth:`~FedAvg.server_update`, the server update rule: from the global model and the round's
  accepted updates to the next global model;
* :meth:`~FedAvg.downlink`, what a client receives: the global model, or its quantised change since
  the client's copy.

:class:`FedProx` adds the proximal term; :class:`FedSense` adds drift-aware perturbed local steps
(server-to-client guidance) and, on the server, K-means of the client models with similarity
distillation on public data (client-to-server guidance). Everything here is plain PyTorch; the
training glue (models, data, Flower) lives in the programs that call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from geofm.config.federated import AlgorithmConfig, CodecConfig
from geofm.federated.aggregation import RoundAggregate, Upload, UploadRules, aggregate_uploads
from geofm.federated.clustering import cluster_clients
from geofm.federated.codec import Codec, Packet, decode
from geofm.federated.feedback import ErrorFeedback, FeedbackState, UplinkReport
from geofm.federated.perturbation import Perturbation, proximal_term
from geofm.federated.robust import build_aggregator
from geofm.federated.server_optimizers import build_server_optimizer

# A server-side refinement of the new global model from the round's group models and their weights
# (FedSense's similarity distillation); returns the refined model and its mean loss.
Refiner = Callable[[Tensor, Sequence[Tensor], Sequence[float]], tuple[Tensor, float]]


def codec_of(cfg: CodecConfig) -> Codec:
    """The codec a config section describes."""
    return Codec(bits=cfg.bits, bucket_size=cfg.bucket_size, scale_norm=cfg.scale_norm, stochastic=cfg.stochastic)


@dataclass
class LocalHooks:
    """What the algorithm adds to one client's local steps.

    Attributes:
        around_gradient: a context entered around each forward/backward (parameters may be moved
            inside it and restored on exit, before the optimizer step).
        regulariser: a differentiable term added to each local loss, or None.
    """

    around_gradient: Callable[[], AbstractContextManager] = contextlib.nullcontext
    regulariser: Callable[[], Tensor] | None = None


@dataclass
class ServerRound:
    """The server update rule's result: the next global model and what to log."""

    model: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class FedAvg:
    """Federated averaging, with the configured uplink and downlink codecs.

    Args:
        cfg: the ``algorithm`` section.
        num_values: length of the model's parameter vector.
    """

    name = "fedavg"

    def __init__(
        self, cfg: AlgorithmConfig, num_values: int, declared_examples: Mapping[str, int] | None = None
    ) -> None:
        self.cfg = cfg
        self.num_values = num_values
        up = cfg.uplink
        self.feedback = ErrorFeedback(
            codec_of(up),
            alpha=up.feedback_alpha if up.error_feedback else 0.0,
            reset_every=up.feedback_reset_every,
            guard_factor=up.feedback_guard,
        )
        self.downlink_codec = codec_of(cfg.downlink)
        self.rules = UploadRules(
            num_values=num_values,
            bits=up.bits,
            norm_factor=cfg.norm_factor,
            examples_factor=cfg.examples_factor,
            declared_examples=declared_examples or {},
        )
        self.aggregator = build_aggregator(cfg.aggregator)
        self.server_optimizer = build_server_optimizer(cfg.server_optimizer, num_values)

    # ---- client side ---------------------------------------------------------------------
    def local_hooks(self, params: Sequence[Tensor], anchor: Sequence[Tensor]) -> LocalHooks:
        """The client update rule around the shared local step: plain steps for FedAvg."""
        return LocalHooks()

    def upload(
        self, delta: Tensor, state: Mapping[str, np.ndarray], generator: torch.Generator
    ) -> tuple[Packet, UplinkReport, dict[str, np.ndarray]]:
        """Encode a local update ``theta - Theta``; returns the packet, its report and the new client state.

        Without error feedback the state stays empty; with it, the state is the residual and the
        count of uploads.

        Raises:
            CodecError: the update holds NaN or Inf, or the stored state is malformed.
        """
        if not self.cfg.uplink.error_feedback:
            packet, report = self.feedback.uplink(delta, FeedbackState(), generator)
            return packet, report, {}
        feedback = FeedbackState.from_arrays(state) if state else FeedbackState()
        packet, report = self.feedback.uplink(delta, feedback, generator)
        return packet, report, feedback.to_arrays()

    # ---- server side ---------------------------------------------------------------------
    def screen(self, uploads: Sequence[Upload], recent_norms: Sequence[float] = ()) -> RoundAggregate:
        """Decode and screen the round's uploads and combine them with the configured aggregator."""
        return aggregate_uploads(uploads, self.rules, recent_norms, self.aggregator)

    def server_update(self, model: Tensor, aggregate: RoundAggregate, refine: Refiner | None) -> ServerRound:
        """The next global model: the server optimiser's step by the combined update (``Theta + Delta`` by default)."""
        return ServerRound(self.server_optimizer.step(model, aggregate.update))

    def downlink(self, model: Tensor, reference: Tensor | None, generator: torch.Generator) -> tuple[Packet, Tensor]:
        """What a client holding ``reference`` receives, and the copy it holds afterwards.

        Uncompressed (32 bits) the model itself travels. Compressed, the quantised change
        ``model - reference`` travels and the client's copy becomes ``reference + deq(Q)``; the
        part the quantiser dropped stays in ``model - copy`` and goes with the next change (error
        feedback on the server's side). A client without a copy receives the model as is.
        """
        if self.cfg.downlink.bits == 32 or reference is None:
            packet = Codec(bits=32).encode(model)
            return packet, model.clone()
        packet = self.downlink_codec.encode(model - reference, generator)
        return packet, reference + decode(packet)


class FedProx(FedAvg):
    """FedAvg plus the proximal term ``beta / 2 ||theta - Theta||^2`` in every local loss."""

    name = "fedprox"

    def local_hooks(self, params: Sequence[Tensor], anchor: Sequence[Tensor]) -> LocalHooks:
        beta = self.cfg.proximal_beta
        return LocalHooks(regulariser=(lambda: proximal_term(params, anchor, beta)) if beta else None)


class FedSense(FedProx):
    """FedSense: server-to-client and client-to-server guidance.

    Client: each local gradient is taken at ``theta + lambda d / ||d||`` (``d = theta - Theta``, the
    drift from the round's global model) and applied at ``theta``; the proximal term is added when
    ``proximal_beta`` is set. Server: the client models ``Theta + delta_i`` are grouped by K-means
    (``clusters``), and the averaged model is refined by similarity distillation towards the
    groups' data-weighted consensus on public images (``distill_steps``).
    """

    name = "fedsense"

    def local_hooks(self, params: Sequence[Tensor], anchor: Sequence[Tensor]) -> LocalHooks:
        hooks = super().local_hooks(params, anchor)
        radius = self.cfg.perturbation_radius
        if radius:
            hooks.around_gradient = Perturbation(params, anchor, radius)
        return hooks

    def server_update(self, model: Tensor, aggregate: RoundAggregate, refine: Refiner | None) -> ServerRound:
        update = super().server_update(model, aggregate, refine)
        if not self.cfg.distill_steps or refine is None:
            return update
        # K-means sees distances only, and Theta is common to every client model Theta + delta_i:
        # the updates give the same groups, and a group's model is Theta plus its mean update.
        updates = [a.update for a in aggregate.accepted]
        groups = cluster_clients(
            updates,
            [a.num_examples for a in aggregate.accepted],
            self.cfg.clusters or len(updates),
        )
        refined, loss = refine(update.model, [model + mean for mean in groups.models], groups.weights)
        return ServerRound(refined, {"loss_similarity": loss, "groups": float(len(groups.models))})


ALGORITHMS: dict[str, type[FedAvg]] = {cls.name: cls for cls in (FedAvg, FedProx, FedSense)}


def build_algorithm(
    cfg: AlgorithmConfig, num_values: int, declared_examples: Mapping[str, int] | None = None
) -> FedAvg:
    """The algorithm ``cfg.name`` names."""
    return ALGORITHMS[cfg.name](cfg, num_values, declared_examples)


__all__ = [
    "ALGORITHMS",
    "FedAvg",
    "FedProx",
    "FedSense",
    "LocalHooks",
    "Refiner",
    "ServerRound",
    "build_algorithm",
    "codec_of",
]
