"""Sharpness-aware local steps: SAM and ASAM as the ascent of the training loop's micro-step.

SAM (Foret, Kleiner, Mobahi, Neyshabur, "Sharpness-Aware Minimization for Efficiently Improving
Generalization", ICLR 2021) minimises ``max_{||e|| <= rho} L(w + e)`` by its first-order solution::

    g = grad L(w)        e = rho g / ||g||        gradient grad L(w + e), applied at w

ASAM (Kwon, Kim, Park, Choi, "ASAM: Adaptive Sharpness-Aware Minimization for Scale-Invariant
Learning of Deep Neural Networks", ICML 2021) measures the neighbourhood relative to the weights'
scale, ``T_w = |w| + eta`` elementwise::

    e = rho T_w^2 g / ||T_w g||

As in the official ASAM code (SamsungLabs/ASAM, ``asam.py``), ``T_w`` applies to the parameters
whose name holds ``weight`` and is 1 for the others (biases, position tables, tokens). ``||.||`` is
one global norm over all tensors; a zero gradient moves nothing.

:class:`SharpnessAscent` is a :attr:`~geofm.fl.algorithms.rounds.LocalHooks.ascent`: given a
micro-batch's loss as a closure, it takes the first gradient with :func:`torch.autograd.grad` (the
engine's accumulated gradients stay untouched), moves the parameters by ``e`` for the real forward
and backward, and restores them bit for bit on exit, before the optimizer step. The first forward
runs on forked random generators (torch's on every device the parameters use, and numpy's, which
timm's Mixup draws from), so the real forward redraws the same drop-path, dropout and mixing values
and the run's random stream goes on as if the step had one forward. Inside an ``around_gradient``
context that moves the parameters (FedSense's drift perturbation), the ascent starts from the moved
point: the gradient is ``grad L(w + e_drift + e)`` with ``e`` from ``grad L(w + e_drift)``, applied at
``w`` once both contexts have restored it.

Both passes run the module in training mode, as the official SAM, ASAM and FedSAM code does: batch-norm
running statistics (a UperNet decoder's) take one more update per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from geofm.fl.local.perturbation import MovedParameters


@contextmanager
def replayed_randomness(devices: Sequence[int]) -> Iterator[None]:
    """Run a block on forked generators: torch's (CPU and the CUDA ``devices``) and numpy's global one
    are back at their entry state after it, so what follows draws the same values again."""
    numpy_state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=list(devices)):
            yield
    finally:
        np.random.set_state(numpy_state)


class SharpnessAscent:
    """SAM's (or ASAM's) ascent for fixed parameters: ``with ascent(closure): ...`` (see the module docstring).

    Made once per local round and entered at every micro-step; it keeps its buffer of saved
    parameters from step to step, works on all tensors at once with ``_foreach`` kernels, and never
    waits for the device: the scale ``rho / ||T g||`` stays a device tensor.

    Args:
        params: the trainable shared parameters ``w`` (any floating dtype), moved in place.
        rho: the radius of the ascent.
        eta: ASAM's offset of ``T_w = |w| + eta``; None: SAM.
        scaled: for ASAM, whether each parameter takes ``T_w`` (default: all); see :func:`asam_scaled`.
    """

    def __init__(
        self, params: Sequence[Tensor], rho: float, eta: float | None = None, scaled: Sequence[bool] | None = None
    ) -> None:
        self.params = list(params)
        self.rho, self.eta = rho, eta
        scaled = [True] * len(self.params) if scaled is None else list(scaled)
        if len(scaled) != len(self.params):
            raise ValueError(f"scaled names {len(scaled)} parameters, got {len(self.params)}")
        self.scaled = [i for i, s in enumerate(scaled) if s] if eta is not None else []
        self.devices = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        self._moved = MovedParameters(self.params)

    def step(self, closure: Callable[[], Tensor]) -> tuple[list[Tensor], Tensor]:
        """The ascent ``e`` per parameter (float32) and the norm ``||T g||``, from the closure's loss at ``w``."""
        with replayed_randomness(self.devices):
            grads = torch.autograd.grad(closure(), self.params, allow_unused=True)
        with torch.no_grad():
            ascent = [
                torch.zeros_like(p, dtype=torch.float32) if g is None else g.float()
                for p, g in zip(self.params, grads, strict=True)
            ]
            if self.scaled:
                scale = torch._foreach_abs([self.params[i].detach().float() for i in self.scaled])
                torch._foreach_add_(scale, self.eta)
                chosen = [ascent[i] for i in self.scaled]
                torch._foreach_mul_(chosen, scale)  # T g
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ascent)))
            if self.scaled:
                torch._foreach_mul_(chosen, scale)  # T^2 g
            # rho / ||T g||, or 0 (no move) for a zero gradient
            torch._foreach_mul_(
                ascent, torch.where(norm > 0, self.rho / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
            )
        return ascent, norm

    @contextmanager
    def __call__(self, closure: Callable[[], Tensor]) -> Iterator[Tensor]:
        """Move the parameters by the ascent for the block, restore them bit for bit after it; yields ``||T g||``."""
        if not self.params:
            yield torch.zeros(())
            return
        ascent, norm = self.step(closure)
        with self._moved(ascent):
            yield norm


def asam_scaled(names: Sequence[str]) -> list[bool]:
    """Which parameters take ASAM's ``T_w``: those whose name holds ``weight``, as the official code has it."""
    return ["weight" in name for name in names]


__all__ = ["SharpnessAscent", "asam_scaled", "replayed_randomness"]
