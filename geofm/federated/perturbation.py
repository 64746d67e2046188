"""Server-to-client guidance on the client: drift-aware perturbed local steps, and the FedProx term.

During local training a client's parameters ``theta`` drift from the round's global parameters
``Theta``. Server-to-client guidance (SCG) evaluates the loss and its gradient at
``theta + eps`` with ``eps = lambda * d / ||d||`` and ``d = theta - Theta`` taken over all
trainable parameters at once (one global norm), then applies the gradient at ``theta``: the
step looks ahead along the drift direction, as a sharpness-aware step would along the gradient.
FedProx instead adds ``beta / 2 * ||theta - Theta||^2`` to the loss.

Parameters and global parameters are passed as sequences of tensors in the same order, e.g. the
module's trainable parameters from :meth:`geofm.federated.flat.ParameterLayout.parameters` and
:meth:`~geofm.federated.flat.ParameterLayout.split` of the global vector.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from geofm.errors import LayoutMismatchError


def _pairs(params: Sequence[Tensor], anchor: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Parameters matched with their global values (moved to the parameter's device, float32)."""
    if len(params) != len(anchor):
        raise LayoutMismatchError(f"got {len(params)} parameters but {len(anchor)} global tensors")
    for i, (p, a) in enumerate(zip(params, anchor, strict=True)):
        if p.shape != a.shape:
            raise LayoutMismatchError(f"parameter {i} has shape {tuple(p.shape)}, its global tensor {tuple(a.shape)}")
    return [(p, a.detach().to(device=p.device, dtype=torch.float32)) for p, a in zip(params, anchor, strict=True)]


def _drift_norm(pairs: list[tuple[Tensor, Tensor]]) -> float:
    """The global L2 norm of the differences of matched pairs."""
    with torch.no_grad():
        norms = [torch.linalg.vector_norm(p.detach().float() - a) for p, a in pairs]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def drift_norm(params: Sequence[Tensor], anchor: Sequence[Tensor]) -> float:
    """The global L2 norm ``||theta - Theta||`` over all tensors (computed in float32).

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """
    return _drift_norm(_pairs(params, anchor))


@contextmanager
def perturbed(params: Sequence[Tensor], anchor: Sequence[Tensor], radius: float) -> Iterator[float]:
    """Move parameters to ``theta + radius * d / ||d||`` for a forward/backward, then restore them.

    On exit the parameters get back their exact previous values, copied from a saved copy (not
    recomputed by subtracting ``eps``, which would not round-trip in bf16). Gradients computed
    inside the block stay in ``.grad`` for the optimiser step that follows at ``theta``; call
    ``backward`` inside the block. With zero drift the parameters are not moved.

    Args:
        params: the trainable parameters ``theta`` (any floating dtype), modified in place.
        anchor: the round's global parameters ``Theta``, same order and shapes.
        radius: ``lambda``, the norm of the perturbation.

    Yields:
        The drift norm ``||d||`` (for logging).

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """
    pairs = _pairs(params, anchor)
    with torch.no_grad():
        saved = [p.detach().clone() for p, _ in pairs]
        norm = _drift_norm(pairs)
        if norm > 0.0 and radius != 0.0:
            for p, a in pairs:
                p.add_(p.float() - a, alpha=radius / norm)
    try:
        yield norm
    finally:
        with torch.no_grad():
            for (p, _), value in zip(pairs, saved, strict=True):
                p.copy_(value)


def proximal_term(params: Sequence[Tensor], anchor: Sequence[Tensor], beta: float) -> Tensor:
    """FedProx's ``beta / 2 * ||theta - Theta||^2`` as a differentiable float32 scalar (no gradient to ``Theta``).

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """
    pairs = _pairs(params, anchor)
    if not pairs:
        return torch.zeros(())
    return beta / 2 * torch.stack([(p.float() - a).pow(2).sum() for p, a in pairs]).sum()
