"""FedAlign: Lipschitz matching of a width-pruned final block (Mendieta, Yang, Wang, Lee, Ding and Chen,
"Local Learning Matters: Rethinking Data Heterogeneity in Federated Learning", CVPR 2022).

Each client trains its model's final stage to be as smooth at reduced width as at full width: the
stage runs as usual on its input ``f_{L-1}`` (the full-width "teacher") and once more, pruned to a
fraction ``width`` of its channels, on ``f_{L-1}`` detached (the "student"). Each run's Lipschitz
constant is estimated, per sample, from its transmitting matrix between the stage's input and
output features (``C_in`` x ``C_out``, the input pooled to the output's positions ``N`` when larger)::

    T = F_{L-1} F_L^T / N                  lambda = sqrt(top eigenvalue of T T^T)  (the top singular value of T)
    L_reg = mean over samples of (lambda_student - lambda_teacher)^2
    L = L_task + mu * (L_task / L_reg) * L_reg       (the ratio detached: L_reg weighs mu * L_task)

with ``L_task`` the task's loss (the official code's cross-entropy; masked image modelling's loss in
pretraining) and ``L_reg`` kept from 0 in the ratio's denominator.

The top eigenvalue comes from ``power_iterations`` steps of power iteration from the ones vector,
``v <- T T^T v / |T T^T v|``, the estimate being the last ``|T T^T v|``, and it is differentiated
through. The teacher's features are detached: the regulariser trains the stage's kept slices only,
through the student. Uploads and the server are FedAvg's (``update`` up, ``model`` down, the
aggregator and server optimiser of the config).

All as in the official code (``mmendiet/FedAlign``, ``methods/fedalign.py``), whose settings
(``main.py``'s defaults) are the defaults here: ``mu = 0.45``, the student at the bottom of the
width range ``[0.25, 1]`` (``width = 0.25``) and 10 power iterations.

The final stage, for every task: that of the model's ``backbone`` (finetuning) or ``encoder``
(masked image modelling), a Swin's last stage's blocks or a ViT's last block (see
:func:`~geofm.fl.algorithms.representation.final_stage`). Forward hooks capture its input and
output in each micro-step's forward (registered inside ``around_gradient``, removed when it exits);
timm's (B, H, W, C) maps and (B, N, C) tokens (prefix tokens left out) become (C, positions) features.

Deliberate deviations from the paper:

* The width pruning of a transformer stage. The official ResNets are slimmable convolutions: the
  student keeps the first ``width`` of every channel count of the block, its input and output
  included. Here each block's MLP keeps its first ``make_divisible(width * hidden)`` hidden units
  (timm's rounding to multiples of 8, the official one): ``fc1``'s rows and bias and ``fc2``'s
  columns, sliced views of the real weights through :func:`torch.func.functional_call`, so the
  gradients reach the kept slices. The residual width stays whole: layer norms normalise over it,
  so a cut one would change every normalisation rather than drop units. The attention heads stay
  whole: timm's attention splits its projections by its ``num_heads`` attribute, not a weight,
  and the MLP holds two thirds of a block's weights. A ViT has no stages: its last block is its
  final stage.
* The official code clips the gradient norm at 10 in its own step; here the run's ``train.grad_clip``
  applies as for every algorithm.

Cost: one more pass of the final stage, forward and backward, with its MLPs at ``width``, and two
Lipschitz estimates, each ``B C_in C_out (N + C_in)`` products for ``T`` and ``T T^T`` plus the power
iterations (the student's differentiated). With a Swin's wide last stage (768 channels for Swin-T)
the estimates cost about as much as the pruned pass: on CPU a step took 1.3 times FedAvg's for Swin-T
at 224 px (batch 4) and 1.6 times for the tests' tiny Swin, whose many small products dominate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from timm.layers import Mlp, make_divisible
from torch import Tensor, nn

from geofm.config.base import Section
from geofm.errors import ConfigError
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.representation import final_stage, representation_module
from geofm.fl.algorithms.rounds import Arrays, LocalHooks, LocalRound
from geofm.tasks import StepOutput


def transmitting_matrix(inputs: Tensor, outputs: Tensor) -> Tensor:
    """``T`` (B, C_in, C_out) between (B, C_in, H, W) and (B, C_out, h, w) features: the inputs pooled to
    the outputs' grid when larger, ``F_in F_out^T`` over the N positions, divided by N."""
    if inputs.shape[2] > outputs.shape[2]:
        inputs = F.adaptive_avg_pool2d(inputs, outputs.shape[2:])
    inputs, outputs = inputs.flatten(2), outputs.flatten(2)
    return inputs @ outputs.transpose(1, 2) / inputs.shape[2]


def top_eigenvalue(matrix: Tensor, iterations: int) -> Tensor:
    """The top eigenvalue of each symmetric PSD matrix ``K`` of a batch (B, n, n), (B,): ``iterations`` steps of
    power iteration from the ones vector, ``v <- K v / |K v|``, the estimate being the last ``|K v|``."""
    v = torch.ones(*matrix.shape[:2], 1, dtype=matrix.dtype, device=matrix.device)
    for _ in range(iterations):
        kv = matrix @ v
        norm = kv.norm(dim=1, keepdim=True)
        v = kv / norm
    return norm.flatten()


def lipschitz_estimate(inputs: Tensor, outputs: Tensor, iterations: int) -> Tensor:
    """A stage's Lipschitz constant per sample, (B,): the top singular value of its transmitting matrix ``T``,
    the square root of the top eigenvalue of ``T T^T``."""
    t = transmitting_matrix(inputs.float(), outputs.float())
    return top_eigenvalue(t @ t.transpose(1, 2), iterations).sqrt()


def feature_map(features: Tensor, prefix_tokens: int = 0) -> Tensor:
    """timm's features as (B, C, positions...): a Swin's (B, H, W, C) as (B, C, H, W), a ViT's (B, N, C)
    tokens as (B, C, N', 1) without the first ``prefix_tokens`` (class and register tokens)."""
    if features.ndim == 4:
        return features.permute(0, 3, 1, 2)
    return features[:, prefix_tokens:].transpose(1, 2).unsqueeze(-1)


def pruned_parameters(stage: nn.Module, width: float) -> dict[str, Tensor]:
    """The parameters that prune each timm ``Mlp`` of ``stage`` to its first ``make_divisible(width *
    hidden)`` hidden units, for :func:`torch.func.functional_call`: sliced views of ``fc1``'s rows and
    bias and ``fc2``'s columns."""
    sliced = {}
    for name, mlp in stage.named_modules():
        if isinstance(mlp, Mlp):
            prefix, hidden = f"{name}." if name else "", mlp.fc2.weight.shape[1]
            kept = min(hidden, make_divisible(width * hidden))
            sliced[f"{prefix}fc1.weight"] = mlp.fc1.weight[:kept]
            if mlp.fc1.bias is not None:
                sliced[f"{prefix}fc1.bias"] = mlp.fc1.bias[:kept]
            sliced[f"{prefix}fc2.weight"] = mlp.fc2.weight[:, :kept]
    return sliced


@dataclass(eq=False)
class FedAlignRound(LocalRound):
    """A FedAlign client's local round: the final stage, its captures, and the round's ``L_reg`` values.

    Attributes:
        prefix: the representation network's name in the model (``backbone`` or ``encoder``).
        stage: its final stage.
        prefix_tokens: a ViT's class and register tokens, left out of the features.
        inputs: the stage's inputs captured since the last regulariser call.
        outputs: its outputs captured since then, one per input.
        pruning: whether the pruned pass runs (its own calls are not captured).
    """

    prefix: str = ""
    stage: nn.Module | None = None
    prefix_tokens: int = 0
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    pruning: bool = False


class FedAlignOptions(Section):
    """FedAlign's settings (``algorithm.options``)."""

    mu: float = Field(default=0.45, ge=0.0, description="weight of the Lipschitz matching, relative to the task loss")
    width: float = Field(default=0.25, gt=0.0, lt=1.0, description="the pruned copy's share of each MLP's hidden units")
    power_iterations: int = Field(default=10, ge=1, description="power-iteration steps of each top eigenvalue")


class FedAlign(FedAvg):
    """FedAlign: FedAvg plus ``mu (L_task / L_reg) L_reg`` in every local loss, matching the final block's Lipschitz
    constant at a reduced width (details in the module docstring)."""

    name = "fedalign"
    reported_loss = "lipschitz_loss"
    Options = FedAlignOptions

    def local_round(
        self, client: str, received: dict[str, Tensor], module: nn.Module, state: Arrays, lr: float
    ) -> FedAlignRound:
        """The round of ``module``: the final stage of its backbone or encoder, checked to be trained and
        to hold timm MLPs to prune."""
        base = super().local_round(client, received, module, state, lr)
        prefix, backbone = representation_module(module, self.name)
        stage = final_stage(backbone, self.name)
        if not any(p.requires_grad for p in stage.parameters()):
            raise ConfigError(f"algorithm fedalign trains the final stage of the model's {prefix}, which is frozen")
        mlps = [m for m in stage.modules() if isinstance(m, Mlp)]
        if not mlps or any(not isinstance(m.norm, nn.Identity) for m in mlps):
            raise ConfigError(
                f"algorithm fedalign prunes the hidden units of the timm Mlp blocks (without a hidden norm) of the "
                f"final stage of the model's {prefix}; {type(stage).__name__} has {len(mlps)} such Mlp"
            )
        return FedAlignRound(
            **vars(base), prefix=prefix, stage=stage, prefix_tokens=int(getattr(backbone, "num_prefix_tokens", 0))
        )

    def local_hooks(self, local: FedAlignRound) -> LocalHooks:
        return LocalHooks(around_gradient=lambda: self._capturing(local), regulariser=self._regulariser(local))

    @staticmethod
    @contextlib.contextmanager
    def _capturing(local: FedAlignRound) -> Iterator[None]:
        """Hooks on the final stage capturing its input and output in the micro-step's forwards."""

        def take_input(_module, args) -> None:
            if not local.pruning:
                local.inputs.append(args[0])

        def take_output(_module, _args, output) -> None:
            if not local.pruning and len(local.outputs) < len(local.inputs):
                local.outputs.append(output)

        handles = [local.stage.register_forward_pre_hook(take_input), local.stage.register_forward_hook(take_output)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            local.inputs.clear()
            local.outputs.clear()

    def _regulariser(self, local: FedAlignRound) -> Callable[[Any, StepOutput], Tensor]:
        mu = self.options.mu

        def regulariser(batch, output: StepOutput) -> Tensor:
            """``mu (L_task / L_reg) L_reg`` of the forward just run, ``L_reg`` the mean over the stage's calls in it."""
            captured = list(zip(local.inputs, local.outputs, strict=False))
            if not captured or len(local.inputs) != len(local.outputs):
                raise RuntimeError(
                    f"client {local.client}: fedalign needs the {local.prefix}'s final stage run in every forward; "
                    f"this one gave {len(local.inputs)} inputs and {len(local.outputs)} outputs"
                )
            local.inputs.clear()
            local.outputs.clear()
            loss = torch.stack([self.lipschitz_loss(local, x, y) for x, y in captured]).mean()
            local.losses.append(loss.detach())
            scaled = loss / loss.detach().clamp_min(torch.finfo(loss.dtype).tiny)  # 1 in value, 0 where L_reg is
            return mu * output.losses["loss"].detach().float() * scaled

        return regulariser

    def lipschitz_loss(self, local: FedAlignRound, inputs: Tensor, outputs: Tensor) -> Tensor:
        """``L_reg`` of one call of the final stage: the pruned stage run on its detached input, the squared
        difference of the two runs' Lipschitz estimates, the mean over samples."""
        inputs, iterations = inputs.detach(), self.options.power_iterations
        local.pruning = True
        try:
            pruned = torch.func.functional_call(
                local.stage, pruned_parameters(local.stage, self.options.width), (inputs,)
            )
        finally:
            local.pruning = False
        features = feature_map(inputs, local.prefix_tokens)
        student = lipschitz_estimate(features, feature_map(pruned, local.prefix_tokens), iterations)
        with torch.no_grad():
            teacher = lipschitz_estimate(features, feature_map(outputs, local.prefix_tokens), iterations)
        return F.mse_loss(student, teacher)


__all__ = [
    "FedAlign",
    "FedAlignOptions",
    "FedAlignRound",
    "feature_map",
    "lipschitz_estimate",
    "pruned_parameters",
    "top_eigenvalue",
    "transmitting_matrix",
]
