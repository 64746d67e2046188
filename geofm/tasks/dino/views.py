"""DINO's multi-crop views of one image: a few large global crops and several small local ones.

Each view is a random resized crop (global: ``global_scale`` of the image's area at the model's
size; local: ``local_scale`` at ``local_size``), flips, and a Gaussian blur applied with DINO's
probabilities (1.0 for the first global view, 0.1 for the second, 0.5 for local views). DINO's colour
jitter, grayscale and solarisation act on RGB images in [0, 1]; remote-sensing samples here are
normalised bands of any count, so they are left out. Pixels without data (and bands a source lacks)
are 0, the normalised mean, as in every other sample of the pile.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.transforms import v2

from geofm.data.transforms import crop_and_flips

BLUR_SIGMA = (0.1, 2.0)


def _blur(size: int, probability: float) -> list[v2.Transform]:
    """DINO's Gaussian blur, the kernel about a tenth of the view's side (odd, at least 3)."""
    if probability <= 0.0:
        return []
    kernel = max(3, size // 10 * 2 + 1)
    return [v2.RandomApply([v2.GaussianBlur(kernel, sigma=BLUR_SIGMA)], p=probability)]


class MultiCrop:
    """The views of one image as a sample's ``global`` (G, C, size, size) and ``local`` (L, C, s, s) tensors.

    Randomness comes from torch's global generator; the pile seeds it per sample.
    """

    def __init__(
        self,
        size: int,
        local_size: int,
        global_views: int = 2,
        local_views: int = 6,
        global_scale: tuple[float, float] = (0.4, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.4),
        hflip: bool = True,
        vflip: bool = True,
    ) -> None:
        def view(side: int, scale: tuple[float, float], blur: float) -> v2.Compose:
            return v2.Compose([*crop_and_flips(side, scale, hflip, vflip), *_blur(side, blur)])

        blurs = [1.0, 0.1] + [0.5] * max(0, global_views - 2)
        self.global_views = [view(size, global_scale, blurs[i]) for i in range(global_views)]
        self.local_views = [view(local_size, local_scale, 0.5) for _ in range(local_views)]

    def __call__(self, image: Tensor, valid: Tensor) -> dict[str, Tensor]:
        image = image * valid
        views = {"global": torch.stack([v(image) for v in self.global_views])}
        if self.local_views:
            views["local"] = torch.stack([v(image) for v in self.local_views])
        return views


__all__ = ["MultiCrop"]
