"""Fourier Magnitude Filtering (FMF) of FedDiff: drop the generated samples least like their client's data.

Each client sends ``M_c``, the mean over its images of the magnitude of their 2-D Fourier transform
(per band, orthonormal, so that a magnitude has the image's L2 norm). The server scores every sample
``z`` generated from client ``c``'s model by ``|| |F(z)| - M_c ||_2`` and drops, per client, the
``gamma`` percent with the highest scores (Mendieta, Sun and Chen, WACV 2025: about 5 % is a good
default, 1-10 % helps).

Under differential privacy the mean is a bounded mean: each image's magnitude is clipped to L2 norm
``B`` (one image moves the sum by at most ``B``), the sum gets ``N(0, (z B)^2)`` per coordinate, and
is divided by the client's number of images, which travels in the clear with its per-class counts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from geofm.fl.privacy.client_level import clip_update, gaussian_noise


def fourier_magnitude(images: Tensor) -> Tensor:
    """``|F(x)|`` of (N, C, H, W) images, per band, orthonormal (float32, the input's shape)."""
    return torch.fft.fft2(images.float(), norm="ortho").abs()


def magnitude_sum(images: Tensor, bound: float | None = None) -> Tensor:
    """The sum of the images' Fourier magnitudes, each first clipped to L2 norm ``bound`` when one is given."""
    magnitudes = fourier_magnitude(images)
    if bound is not None:
        magnitudes = torch.stack([clip_update(m, bound) for m in magnitudes])
    return magnitudes.sum(0)


def private_mean(
    total: Tensor, count: int, bound: float, noise_multiplier: float, generator: torch.Generator
) -> Tensor:
    """The bounded mean of ``count`` clipped magnitudes whose sum is ``total``: ``(total + N(0, (z B)^2)) / count``."""
    return (total + gaussian_noise(total, noise_multiplier * bound, generator)) / count


def magnitude_bound(bound_per_pixel: float, shape: tuple[int, ...]) -> float:
    """``B``: a per-pixel RMS bound as the L2 bound of a whole (C, H, W) magnitude."""
    return bound_per_pixel * math.sqrt(math.prod(shape))


def fmf_scores(samples: Tensor, mean: Tensor) -> Tensor:
    """``|| |F(z)| - M ||_2`` of each (N, C, H, W) sample against the client's mean magnitude (C, H, W)."""
    return (fourier_magnitude(samples) - mean.float()).flatten(1).norm(dim=1)


def kept(scores: np.ndarray, gamma: float) -> np.ndarray:
    """Which samples stay: all but the ``floor(gamma / 100 * N)`` with the highest scores (ties broken by position)."""
    scores = np.asarray(scores)
    dropped = math.floor(gamma / 100 * len(scores))
    keep = np.ones(len(scores), dtype=bool)
    if dropped:
        keep[np.argsort(-scores, kind="stable")[:dropped]] = False
    return keep


__all__ = ["fmf_scores", "fourier_magnitude", "kept", "magnitude_bound", "magnitude_sum", "private_mean"]
