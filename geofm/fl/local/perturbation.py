"""Server-to-client guidance on the client: drift-aware perturbed local steps, and the FedProx term.

During local training a client's parameters ``theta`` drift from the round's global parameters
``Theta``. Server-to-client guidance (SCG) evaluates the loss and its gradient at
``theta + eps`` with ``eps = lambda * d / ||d||`` and ``d = theta - Theta`` taken over all
trainable parameters at once (one global norm), then applies the gradient at ``theta``: the
step looks ahead along the drift direction, as a sharpness-aware step would along the gradient.
FedProx instead adds ``beta / 2 * ||theta - Theta||^2`` to the loss.

Parameters and global parameters are passed as sequences of tensors in the same order, e.g. the
module's trainable parameters from :meth:`geofm.fl.parameter_vectors.ParameterLayout.parameters` and
:meth:`~geofm.fl.parameter_vectors.ParameterLayout.split` of the global vector.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

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


def _drift_norm(pairs: list[tuple[Tensor, Tensor]]) -> Tensor:
    """The global L2 norm of the differences of matched pairs, as a 0-dim float32 tensor on their device."""
    with torch.no_grad():
        if not pairs:
            return torch.zeros(())
        diffs = torch._foreach_sub([p.detach().float() for p, _ in pairs], [a for _, a in pairs])
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diffs)))


def drift_norm(params: Sequence[Tensor], anchor: Sequence[Tensor]) -> float:
    """The global L2 norm ``||theta - Theta||`` over all tensors (computed in float32).

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """
    return float(_drift_norm(_pairs(params, anchor)))


class MovedParameters:
    """Parameters moved for a block and restored bit for bit after it: ``with moved(shift): ...``.

    The saved copy is a buffer kept from block to block; the parameters come back from it, not by
    subtracting the shift, which would not round-trip in bf16.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self._saved: list[Tensor] | None = None

    @contextmanager
    def __call__(self, shift: Sequence[Tensor]) -> Iterator[None]:
        """Add ``shift`` (one tensor per parameter) for the block; restore the parameters on exit."""
        values = [p.detach() for p in self.params]
        with torch.no_grad():
            if self._saved is None:
                self._saved = [v.clone() for v in values]
            else:
                torch._foreach_copy_(self._saved, values)
            torch._foreach_add_(values, list(shift))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(values, self._saved)


class Perturbation:
    """Drift-aware perturbed steps for fixed parameters: ``with perturbation(): ...`` moves them to
    ``theta + radius * d / ||d||`` and restores them on exit (see :func:`perturbed`).

    Made once per round and entered at every micro-step, it keeps its two buffers (the saved
    parameters and the scaled drift) from step to step, works on all tensors at once with torch's
    ``_foreach`` kernels, and never waits for the device: the scale ``radius / ||d||`` stays a
    device tensor.

    Args:
        params: the trainable parameters ``theta`` (any floating dtype), modified in place.
        anchor: the round's global parameters ``Theta``, same order and shapes.
        radius: ``lambda``, the norm of the perturbation.

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """

    def __init__(self, params: Sequence[Tensor], anchor: Sequence[Tensor], radius: float) -> None:
        pairs = _pairs(params, anchor)
        self.params = [p for p, _ in pairs]
        self.anchor = [a for _, a in pairs]
        self.radius = radius
        self._moved = MovedParameters(self.params)
        self._drift = [torch.empty_like(a) for a in self.anchor]

    @contextmanager
    def __call__(self) -> Iterator[Tensor]:
        """Move the parameters for the block, restore them bit for bit after it; yields ``||d||`` as a 0-dim tensor."""
        values = [p.detach() for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(self._drift, values)
            torch._foreach_sub_(self._drift, self.anchor)
            norm = (
                torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self._drift))) if values else torch.zeros(())
            )
            # radius / ||d||, or 0 (no move) when there is no drift or no radius
            scale = torch.where(norm > 0, self.radius / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
            torch._foreach_mul_(self._drift, scale)
        with self._moved(self._drift):
            yield norm


def perturbed(params: Sequence[Tensor], anchor: Sequence[Tensor], radius: float) -> AbstractContextManager[Tensor]:
    """Move parameters to ``theta + radius * d / ||d||`` for a forward/backward, then restore them.

    On exit the parameters get back their exact previous values, copied from a saved copy (not
    recomputed by subtracting ``eps``, which would not round-trip in bf16). Gradients computed
    inside the block stay in ``.grad`` for the optimiser step that follows at ``theta``; call
    ``backward`` inside the block. With zero drift the parameters are not moved. For repeated
    steps, make one :class:`Perturbation` and enter it each time (its buffers are reused).

    Args:
        params: the trainable parameters ``theta`` (any floating dtype), modified in place.
        anchor: the round's global parameters ``Theta``, same order and shapes.
        radius: ``lambda``, the norm of the perturbation.

    Yields:
        The drift norm ``||d||``, a 0-dim float32 tensor on the parameters' device (``float()`` it to log).

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """
    return Perturbation(params, anchor, radius)()


def proximal_term(params: Sequence[Tensor], anchor: Sequence[Tensor], beta: float) -> Tensor:
    """FedProx's ``beta / 2 * ||theta - Theta||^2`` as a differentiable float32 scalar (no gradient to ``Theta``).

    Raises:
        LayoutMismatchError: if the two sequences differ in length or in any shape.
    """
    pairs = _pairs(params, anchor)
    if not pairs:
        return torch.zeros(())
    return beta / 2 * torch.stack([(p.float() - a).pow(2).sum() for p, a in pairs]).sum()
