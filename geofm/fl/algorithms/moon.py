"""MOON: model-contrastive federated learning (Li, He and Song, CVPR 2021).

Each client adds to its supervised (or self-supervised) loss a contrastive term on representations:
the representation ``z`` of the model it trains should be close to ``z_glob``, that of the round's
global model, and far from ``z_prev``, that of the model it trained in its previous round::

    l = l_sup + mu * l_con
    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

with ``sim`` the cosine similarity, ``tau`` the temperature, the mean over a micro-batch's samples,
and the global and previous models frozen (no gradients, eval mode, as in the official code). Both
frozen models see the same input as the trained one. Uploads and the server are FedAvg's (``update``
up, ``model`` down, the aggregator and server optimiser of the config).

The previous model is the client's own: its trained backbone is kept in the client state as one
vector (``moon.previous``, the size of the backbone's trainable parameters) and travels nowhere. In
a client's first round it has none and the global model stands in for it: both frozen copies are
then the same, ``sim(z, z_glob)`` equals ``sim(z, z_prev)`` whatever ``z``, and ``l_con`` is
``log 2`` with no gradient, so the first round trains as FedAvg does. The official code's first round has no previous model either (its pool of
previous models is empty) and its contrastive term, a cross-entropy over the positive logit alone,
is 0 with no gradient: the same training, only the logged loss differs by ``mu log 2``.

Representation, the same for every task: the model's ``backbone`` (finetuning) or ``encoder`` (masked
image modelling), a timm Swin or ViT. The models call it through ``forward_features``,
``forward_intermediates`` or stage by stage, never as a module, so the hooks sit on its parts that
every path calls: a forward pre-hook on ``patch_embed`` captures the backbone's input (the normalised
image), a forward hook on its final stage (see
:func:`~geofm.fl.algorithms.representation.final_stage`: a Swin's last stage's blocks,
(B, H, W, C), or a ViT's last block, (B, N, C)) captures its output, pooled to one vector per sample by the mean over
spatial positions or over the patch tokens (prefix tokens left out). The frozen copies run
``forward_intermediates`` up to the same stage, unnormalised, pooled alike, on the captured input.
The hooks are registered when the local round begins and removed when it ends.

Deliberate deviations from the paper:

* No projection head. The paper's networks map the pooled features through a two-layer MLP before
  ``l_con``; geofm's models have none, and one would add parameters that only ``l_con`` trains,
  that every client would have to federate and that the exported backbone would drop. The pooled
  last-stage features, which the task heads themselves read, stand in for it.
* In masked image modelling the trained encoder sees the masked image and the frozen copies the whole
  image: the mask token belongs to the masked image model, not to the encoder, and is put in between
  the patch embedding and the stages inside the task's forward. ``l_con`` then pulls the masked
  view's representation towards the global model's view of the whole image.

Options: ``mu`` (default 1) and ``temperature`` (default 0.5, the paper's). The paper takes
``mu = 5`` for CIFAR-10 alone (the official code's example) and 1 for CIFAR-100 and Tiny-ImageNet;
geofm's tasks, many-class remote-sensing benchmarks, dense tasks and masked image modelling on
pretrained backbones, are nearer the latter, and with ``mu = 1`` the contrastive term (``log 2``
when ``z`` is as near one copy as the other) stays on the scale of the task losses rather than
outweighing them.

Cost: each micro-batch runs the backbone three times (the trained one forward and backward, the two
frozen copies forward only), as in the paper, and the client holds two more copies of the
backbone in memory and one in its state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from geofm.config.base import Section
from geofm.errors import ConfigError
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.representation import final_stage, pooled, representation_module
from geofm.fl.algorithms.rounds import Arrays, LocalHooks, LocalRound, LocalUpdate
from geofm.fl.parameter_vectors import ParameterLayout

PREVIOUS = "moon.previous"
"""The client-state key of the client's previous trained backbone (a flat vector)."""


def representation(backbone: nn.Module, images: Tensor) -> Tensor:
    """A frozen backbone's representation of ``images``: its last stage, unnormalised, pooled (B, C)."""
    last = backbone.forward_intermediates(images, indices=1, norm=False, intermediates_only=True)[-1]
    return last.float().mean((2, 3))


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, temperature: float) -> Tensor:
    """``l_con`` of the paper, the mean over the samples: the positive pair (z, z_glob) against the
    negative pair (z, z_prev), cosine similarities over ``temperature``."""
    logits = torch.stack((F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)), dim=1)
    return F.cross_entropy(logits / temperature, torch.zeros(len(z), dtype=torch.long, device=z.device))


def frozen_copy(backbone: nn.Module, vector: Tensor | None = None) -> nn.Module:
    """A copy of ``backbone`` (its trainable parameters set to ``vector`` if given), without gradients, in eval mode."""
    twin = copy.deepcopy(backbone)
    if vector is not None:
        ParameterLayout.of(twin).assign(twin, vector)
    return twin.requires_grad_(False).eval()


@dataclass(eq=False)
class MoonRound(LocalRound):
    """A MOON client's local round: the trained backbone's hooks and captures, and its frozen copies.

    Attributes:
        prefix: the backbone's name in the model (``backbone`` or ``encoder``).
        layout: the backbone's trainable parameters.
        global_copy: the round's global backbone, frozen.
        previous_copy: the client's previous trained backbone (the global one in its first round), frozen.
        prefix_tokens: a ViT's class and register tokens, left out of the pooling.
        inputs: the backbone's inputs captured since the last regulariser call.
        outputs: its last block's outputs captured since then, one per input.
        handles: the hooks, removed when the round ends.
    """

    prefix: str = ""
    layout: ParameterLayout | None = None
    global_copy: nn.Module | None = None
    previous_copy: nn.Module | None = None
    prefix_tokens: int = 0
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)


class MoonOptions(Section):
    """MOON's settings (``algorithm.options``)."""

    mu: float = Field(default=1.0, ge=0.0, description="weight of the model-contrastive loss")
    temperature: float = Field(default=0.5, gt=0.0, description="tau of the cosine similarities")


class Moon(FedAvg):
    """MOON: FedAvg plus the model-contrastive loss ``mu * l_con`` in every local loss (details in the module
    docstring)."""

    name = "moon"
    reported_loss = "contrastive_loss"
    Options = MoonOptions

    def local_round(
        self, client: str, received: dict[str, Tensor], module: nn.Module, state: Arrays, lr: float
    ) -> MoonRound:
        """The round of ``module`` (holding the global model): frozen copies of its backbone, and hooks
        capturing the backbone's input and last block's output in every forward until :meth:`finish_local`."""
        base = super().local_round(client, received, module, state, lr)
        prefix, backbone = representation_module(module, self.name)
        layout = ParameterLayout.of(backbone)
        if not layout.names:
            raise ConfigError(f"algorithm moon trains the representation of the model's {prefix}, which is frozen")
        previous = torch.from_numpy(state[PREVIOUS].copy()) if PREVIOUS in state else None
        local = MoonRound(
            **vars(base),
            prefix=prefix,
            layout=layout,
            global_copy=frozen_copy(backbone),
            previous_copy=frozen_copy(backbone, previous),
            prefix_tokens=int(getattr(backbone, "num_prefix_tokens", 0)),
        )

        def take_output(_module, _args, output) -> None:
            if len(local.outputs) < len(local.inputs):  # one output per backbone input, none without one
                local.outputs.append(output)

        local.handles = [
            backbone.patch_embed.register_forward_pre_hook(lambda _, args: local.inputs.append(args[0])),
            final_stage(backbone, self.name).register_forward_hook(take_output),
        ]
        return local

    def local_hooks(self, local: MoonRound) -> LocalHooks:
        return LocalHooks(regulariser=self._regulariser(local))

    def _regulariser(self, local: MoonRound) -> Callable[[Any, Any], Tensor]:
        mu, temperature = self.options.mu, self.options.temperature

        def regulariser(batch, output) -> Tensor:
            """``mu * l_con`` of the forward just run, the mean over the backbone's calls in it."""
            captured = list(zip(local.inputs, local.outputs, strict=False))
            if not captured or len(local.inputs) != len(local.outputs):
                raise RuntimeError(
                    f"client {local.client}: moon needs the {local.prefix} run to its last block in every forward; "
                    f"this one gave {len(local.inputs)} inputs and {len(local.outputs)} last-block outputs"
                )
            local.inputs.clear()
            local.outputs.clear()
            losses = []
            for images, features in captured:
                with torch.no_grad():
                    z_glob = representation(local.global_copy, images)
                    z_prev = representation(local.previous_copy, images)
                z = pooled(features, local.prefix_tokens)
                losses.append(model_contrastive_loss(z, z_glob, z_prev, temperature))
            loss = torch.stack(losses).mean()
            local.losses.append(loss.detach())
            return mu * loss

        return regulariser

    def finish_local(self, local: MoonRound, trained: Tensor, steps: int) -> LocalUpdate:
        """Remove the hooks, keep the trained backbone as the next round's previous model, upload as FedAvg;
        the round's mean ``l_con`` goes to the server as ``contrastive_loss``."""
        for handle in local.handles:
            handle.remove()
        for captured in (local.handles, local.inputs, local.outputs):
            captured.clear()
        pieces = self.shared.unflatten(trained)
        local.state[PREVIOUS] = local.layout.flatten(
            {n: pieces[f"{local.prefix}.{n}"] for n in local.layout.names}
        ).numpy()
        return super().finish_local(local, trained, steps)


__all__ = ["Moon", "MoonOptions", "MoonRound", "model_contrastive_loss", "pooled", "representation"]
