"""SimMIM random masking: square mask patches, upsampled to the backbone's token grid."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from geofm.errors import ConfigError


class MaskGenerator:
    """Draws a random mask of ``mask_ratio`` over ``mask_patch_size`` squares.

    Args:
        input_size: image side in pixels.
        mask_patch_size: side of one masked square in pixels (SimMIM/GFM: 32).
        model_patch_size: the backbone's patch size; the mask is returned at token resolution.
        mask_ratio: fraction of squares masked (rounded up).
    """

    def __init__(self, input_size: int, mask_patch_size: int = 32, model_patch_size: int = 4, mask_ratio: float = 0.6):
        if input_size % mask_patch_size:
            raise ConfigError(f"image size {input_size} is not divisible by mask_patch_size {mask_patch_size}")
        if mask_patch_size % model_patch_size:
            raise ConfigError(
                f"mask_patch_size {mask_patch_size} is not divisible by the backbone's patch size {model_patch_size}"
            )
        if not 0.0 < mask_ratio < 1.0:
            raise ConfigError(f"mask_ratio must lie in (0, 1), got {mask_ratio}")
        self.grid = input_size // mask_patch_size
        self.scale = mask_patch_size // model_patch_size
        self.mask_count = math.ceil(self.grid**2 * mask_ratio)

    @property
    def token_grid(self) -> int:
        """Side of the returned mask: the backbone's token grid."""
        return self.grid * self.scale

    def __call__(self, generator: torch.Generator | None = None) -> Tensor:
        """Return a (token_grid, token_grid) uint8 mask, 1 where the token is masked."""
        chosen = torch.randperm(self.grid**2, generator=generator)[: self.mask_count]
        mask = torch.zeros(self.grid**2, dtype=torch.uint8)
        mask[chosen] = 1
        mask = mask.view(self.grid, self.grid)
        return mask.repeat_interleave(self.scale, 0).repeat_interleave(self.scale, 1)
