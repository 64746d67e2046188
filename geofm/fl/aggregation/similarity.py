"""Server similarity distillation: the global model learns the group models' consensus of how public images relate.

For a batch of ``p`` public images with features ``Z`` (p x d), the similarity matrix is
``S = Z Z^T / ||Z||_F``. The groups' consensus is ``S_c = sum_k w_k S_k`` with the groups' data
weights, and the global model is trained to minimise ``||S_global - S_c||_F^2 / p^2``. Only the
global model learns: the group models' features are computed under ``no_grad`` by running the
one global module with each group's parameters swapped in (:func:`torch.func.functional_call`),
so no module is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call


def similarity_matrix(features: Tensor) -> Tensor:
    """``Z Z^T / ||Z||_F`` of a (p, d) feature matrix (float32 or wider); zero features give zeros."""
    z = features.float() if features.dtype in (torch.float16, torch.bfloat16) else features
    norm = torch.linalg.matrix_norm(z)
    return z @ z.T / norm.clamp_min(torch.finfo(z.dtype).tiny)


def consensus_similarity(matrices: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum_k w_k S_k``: the weighted consensus of the groups' similarity matrices.

    Raises:
        ValueError: if the counts differ or there is no matrix.
    """
    if not matrices or len(matrices) != len(weights):
        raise ValueError(f"expected one weight per similarity matrix, got {len(matrices)} and {len(weights)}")
    return sum((w * s for s, w in zip(matrices, weights, strict=True)), torch.zeros_like(matrices[0]))


def similarity_loss(global_similarity: Tensor, consensus: Tensor) -> Tensor:
    """``||S_global - S_c||_F^2 / p^2`` for (p, p) matrices."""
    p = global_similarity.shape[0]
    return (global_similarity - consensus).pow(2).sum() / p**2


class Features(nn.Module):
    """A module whose forward is ``features_fn(module, images)``, so functional_call can swap its parameters."""

    def __init__(self, module: nn.Module, features_fn: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__()
        self.module = module
        self.features_fn = features_fn

    def forward(self, images: Tensor) -> Tensor:
        return self.features_fn(self.module, images)


def distill_similarity(
    module: nn.Module,
    group_params: Sequence[Mapping[str, Tensor]],
    group_weights: Sequence[float],
    batches: Iterable[Tensor],
    features_fn: Callable[[nn.Module, Tensor], Tensor],
    optimizer: torch.optim.Optimizer,
    steps: int,
) -> float:
    """Run ``steps`` similarity-distillation steps on the global module.

    Each step takes the next batch of public images, computes every group's features by running
    ``module`` with that group's parameters (under ``no_grad``), forms their weighted consensus,
    and takes one optimizer step on the global module's loss. The module's train/eval mode is the
    caller's choice (eval disables drop-path, so the groups' targets are deterministic).

    Args:
        module: the global model; its own parameters are the ones trained.
        group_params: per group, a name -> tensor mapping of the parameters that differ from the
            module's (e.g. :meth:`~geofm.fl.parameter_vectors.ParameterLayout.unflatten` of a group
            model); never modified.
        group_weights: each group's data weight.
        batches: public image batches, already on the module's device; at least ``steps``.
        features_fn: ``(module, images) -> (p, d)`` features, e.g. pooled encoder features.
        optimizer: optimizer over (some of) the module's parameters.
        steps: number of optimizer steps.

    Returns:
        The mean loss over the steps (before each step's update).

    Raises:
        ValueError: if ``steps`` is not positive, ``batches`` runs out before ``steps`` steps, or
            the group counts differ.
    """
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    if len(group_params) != len(group_weights) or not group_params:
        raise ValueError(
            f"expected one weight per group and at least one group, got {len(group_params)} and {len(group_weights)}"
        )
    wrapped = Features(module, features_fn)
    batch_iter = iter(batches)
    losses = []
    for step in range(steps):
        images = next(batch_iter, None)
        if images is None:
            raise ValueError(f"public batches ran out after {step} of {steps} distillation steps")
        with torch.no_grad():
            targets = [
                similarity_matrix(functional_call(wrapped, {f"module.{k}": v for k, v in params.items()}, (images,)))
                for params in group_params
            ]
            consensus = consensus_similarity(targets, group_weights)
        loss = similarity_loss(similarity_matrix(features_fn(module, images)), consensus)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses)
