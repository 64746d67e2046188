"""FedMKD: multi-teacher adaptive distillation on the server, global-knowledge anchored alignment on the clients.

Li et al., "Resource-aware Federated Self-supervised Learning with Global Class Representations",
NeurIPS 2024 (official code: ``giao-kyal/FedMKD``). Each client keeps a model of its own across
rounds and trains it by its self-supervised loss; the server never averages them, and trains the
global model by distilling the clients' models, its teachers, on public images.

**Adaptive knowledge integration (server).** For a public image ``x`` with the global model's pooled
representation ``f_g(x)`` and the teachers' ``f_k(x)`` (the round's client models ``w_k = Theta +
Delta_k``), each teacher weighs by the scaled dot-product attention of the global representation
(the query) on the teachers' (the keys), as the official ``SelfAttention``, and the global model is
drawn to the weighted teachers' unit representations::

    a_k(x) = softmax_k(<f_g(x), f_k(x)> / sqrt(d))
    t(x) = sum_k a_k(x) f_k(x) / ||f_k(x)||
    L_KD = mean_x (2 - 2 cos(f_g(x), t(x)))        (a and t without gradient)

for ``distill_steps`` steps of ``distill_batch_size`` public images per round, from the previous
round's global model, with AdamW over the trainable parameters the task offers (the encoder).

**Global knowledge anchored alignment (clients).** Each local loss adds ``beta L_anchor``, the same
alignment of the client's representation to the received global model's (frozen) on the client's
images, which keeps the local representation spaces close to the global one::

    L_anchor = mean_x (2 - 2 cos(f_k(x), f_g(x)))

Representations are the pooled final stage of the representation network, on the server as the
task's public features give it, on the clients as MOON reads it (each call of the network in a
forward aligned on its own; DINO: the global and the local views).

What of the paper applies to one architecture: its point is clients of different architectures,
whose models cannot be averaged. Here every client trains the global architecture, and nothing of
the heterogeneous part is needed: no per-architecture projection of the teachers' representations
to the global width (every teacher has it), and no resource-aware choice of each client's model
size. The rest is kept as the paper has it: each client's own model lives in its state (``fedmkd.own``)
and starts its next round (the global model in its first round), uploads are its change from the
round's global model so that the server rebuilds it exactly, and the global model changes only by
distillation. On DINO (FedSense's Table 1) the global student's head, which no public feature reads,
stays at its start; each client keeps and trains its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from geofm.config.algorithm import AlgorithmConfig
from geofm.config.base import Section
from geofm.errors import ConfigError
from geofm.fl.aggregation.similarity import Features
from geofm.fl.aggregation.uploads import RoundAggregate
from geofm.fl.algorithms.context import ServerContext
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.moon import frozen_copy, representation
from geofm.fl.algorithms.representation import Capture, CapturingRound, representation_module
from geofm.fl.algorithms.rounds import Arrays, LocalHooks, LocalUpdate, ServerRound
from geofm.fl.parameter_vectors import ParameterLayout

OWN = "fedmkd.own"
"""The client-state key of the client's own model (a flat vector of the shared parameters)."""


def alignment_loss(z: Tensor, target: Tensor) -> Tensor:
    """``mean (2 - 2 cos(z, target))`` over the rows; no gradient reaches ``target``."""
    return (2.0 - 2.0 * F.cosine_similarity(z.float(), target.detach().float(), dim=-1)).mean()


def teacher_weights(student: Tensor, teachers: Tensor) -> Tensor:
    """``a_k(x) = softmax_k(<f_g(x), f_k(x)> / sqrt(d))``: (p, K) from the student's (p, d) and the teachers' (K, p, d)."""
    scores = torch.einsum("pd,kpd->pk", student.float(), teachers.float()) / math.sqrt(student.shape[-1])
    return scores.softmax(dim=1)


def integrated_target(student: Tensor, teachers: Tensor) -> Tensor:
    """``t(x) = sum_k a_k(x) f_k(x) / ||f_k(x)||`` (p, d)."""
    weights = teacher_weights(student, teachers)
    return torch.einsum("pk,kpd->pd", weights, F.normalize(teachers.float(), dim=-1))


def distill_multi_teacher(
    module: nn.Module,
    teachers: Sequence[Mapping[str, Tensor]],
    batches: Iterable[Tensor],
    features_fn: Callable[[nn.Module, Tensor], Tensor],
    optimizer: torch.optim.Optimizer,
    steps: int,
) -> float:
    """``steps`` steps of ``L_KD`` on ``module`` towards the integrated ``teachers`` (each a name -> tensor mapping
    of the parameters, swapped into the one module under ``no_grad``); the mean loss before each step."""
    wrapped, batch_iter, losses = Features(module, features_fn), iter(batches), []
    for _ in range(steps):
        images = next(batch_iter)
        with torch.no_grad():
            taught = torch.stack(
                [functional_call(wrapped, {f"module.{k}": v for k, v in p.items()}, (images,)) for p in teachers]
            )
        student = features_fn(module, images)
        loss = alignment_loss(student, integrated_target(student.detach(), taught))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses)


@dataclass(eq=False)
class FedMKDRound(CapturingRound):
    """A FedMKD client's round: its representation network's calls captured, and the global one frozen."""

    global_network: nn.Module | None = None


class FedMKDOptions(Section):
    """FedMKD's settings (``algorithm.options``)."""

    anchor_weight: float = Field(default=1.0, ge=0.0, description="beta of the clients' anchored alignment")
    distill_steps: int = Field(default=10, ge=1, description="server distillation steps per round")
    distill_lr: float = Field(default=1e-4, gt=0.0, description="AdamW learning rate of the distillation")
    distill_batch_size: int = Field(default=16, gt=1, description="public images per distillation step")


class FedMKD(FedAvg):
    """FedMKD: clients keep their own models, aligned to the global one; the server distils them into the
    global model on public images (details in the module docstring)."""

    name = "fedmkd"
    Options = FedMKDOptions
    reported_loss = "anchor_loss"
    own_server_rule = "trains the global model by distilling the client models on public images"
    optimizer: torch.optim.Optimizer | None = None  # the server's distillation optimiser, once attached

    @classmethod
    def check_public_images(cls, cfg: AlgorithmConfig, available: bool) -> None:
        if not available:
            raise ValueError(
                "name: FedMKD distils the client models into the global one on the server's public images, and "
                "this run has none (federation.public_sources of a pretraining run)"
            )

    # ---- client ----------------------------------------------------------------------------
    def restore_local(self, module: nn.Module, state: Arrays) -> None:
        """The client's own model, from its second round on (its first starts from the global model)."""
        super().restore_local(module, state)
        if OWN in state:
            self.shared.assign(module, torch.from_numpy(state[OWN].copy()))

    def local_round(
        self, client: str, received: dict[str, Tensor], module: nn.Module, state: Arrays, lr: float
    ) -> FedMKDRound:
        """The round of the client's model, its representation network captured, the received global one frozen
        (copied before the capture's hooks are attached, so that the copy's calls are not captured)."""
        base = super().local_round(client, received, module, state, lr)
        prefix, network = representation_module(module, self.name)
        layout, pieces = ParameterLayout.of(network), self.shared.unflatten(received["model"])
        anchor = frozen_copy(network, layout.flatten({n: pieces[f"{prefix}.{n}"] for n in layout.names}))
        capture = Capture.attach(module, self.name)
        return FedMKDRound(**vars(base), capture=capture, global_network=anchor)

    def local_hooks(self, local: FedMKDRound) -> LocalHooks:
        weight = self.options.anchor_weight

        def regulariser(batch: Any, output: Any) -> Tensor:
            """``beta L_anchor``, the mean over the representation network's calls in the forward just run."""
            losses = []
            for images, z in local.capture.take(self.name):
                with torch.no_grad():
                    anchor = representation(local.global_network, images)
                losses.append(alignment_loss(z, anchor))
            loss = torch.stack(losses).mean()
            local.losses.append(loss.detach())
            return weight * loss

        return LocalHooks(regulariser=regulariser)

    def finish_local(self, local: FedMKDRound, trained: Tensor, steps: int) -> LocalUpdate:
        """Keep the trained model as the client's own; upload its change from the global model."""
        local.capture.remove()
        local.state[OWN] = trained.numpy().copy()
        return super().finish_local(local, trained, steps)

    # ---- server ----------------------------------------------------------------------------
    def attach(self, context: ServerContext) -> None:
        """The distillation's optimiser over the task's trainable parameters."""
        super().attach(context)
        if context.public is None:
            raise ConfigError("algorithm fedmkd distils on the server's public images; this run's task offers none")
        self.optimizer = context.optimizer(context.public.trainable(context.model), self.options.distill_lr)

    def server_update(self, model: Tensor, payloads: Mapping[str, RoundAggregate]) -> ServerRound:
        """The global model distilled from the client models ``Theta + Delta_k``; logs ``loss_distill``."""
        if self.context is None or self.optimizer is None:
            raise RuntimeError("FedMKD distils on the server's context: attach it before the rounds")
        aggregate, options = payloads["update"], self.options
        layout, module, public = self.context.layout, self.context.model, self.context.public
        teachers = [layout.unflatten(model + update) for update in aggregate.updates]
        layout.assign(module, model)
        module.eval()  # no drop-path: the teachers' targets are deterministic
        batches = public.batches(self.round, options.distill_batch_size)
        loss = distill_multi_teacher(module, teachers, batches, public.features, self.optimizer, options.distill_steps)
        return self.reporting(ServerRound(layout.flatten_module(module), {"loss_distill": loss}), payloads)

    def distillation_optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizer


__all__ = [
    "OWN",
    "FedMKD",
    "FedMKDOptions",
    "FedMKDRound",
    "alignment_loss",
    "distill_multi_teacher",
    "integrated_target",
    "teacher_weights",
]
