"""Decoders on a backbone's features: UperNet for dense tasks, a ViT feature pyramid, a super-resolution decoder.

UperNet is segmentation_models_pytorch's ``UPerNetDecoder`` and ``SegmentationHead``, fed by the
backbone's own ``forward_intermediates`` instead of an smp encoder, so the backbone stays one plain
timm model whose state dict is the one geofm loads and exports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.nn.functional as F
from segmentation_models_pytorch.base import SegmentationHead
from segmentation_models_pytorch.decoders.upernet.decoder import UPerNetDecoder
from timm.layers import LayerNorm2d
from torch import Tensor, nn

PYRAMID_STRIDES = (4, 8, 16, 32)


class SimpleFeaturePyramid(nn.Module):
    """Features at strides 4, 8, 16 and 32 from a plain ViT's single-stride block outputs (ViTDet style).

    Each level takes one block output at the patch stride ``p`` and rescales it by factors of 2:
    transposed convolutions (LayerNorm and GELU between them) to go finer, identity at ``p``,
    max pooling to go coarser. With ``p = 16``: two deconvolutions (stride 4), one (8), identity
    (16), 2x2 max pooling (32).
    """

    def __init__(self, channels: int, patch_size: int, strides: Sequence[int] = PYRAMID_STRIDES) -> None:
        """Initialise a new SimpleFeaturePyramid instance.

        Args:
            channels: width of the block outputs (kept at every level).
            patch_size: stride of the block outputs, a power of 2.
            strides: the strides to produce, one per input block output.

        Raises:
            ValueError: if a stride is not ``patch_size`` times a power of 2.
        """
        super().__init__()
        self.strides = tuple(strides)
        self.levels = nn.ModuleList(self._level(channels, patch_size, stride) for stride in self.strides)

    @staticmethod
    def _level(channels: int, patch_size: int, stride: int) -> nn.Module:
        steps = math.log2(patch_size / stride)
        if steps != int(steps):
            raise ValueError(f"stride {stride} is not patch size {patch_size} times a power of 2")
        steps = int(steps)
        if steps == 0:
            return nn.Identity()
        if steps < 0:
            return nn.MaxPool2d(kernel_size=2**-steps, stride=2**-steps)
        layers: list[nn.Module] = []
        for i in range(steps):
            if i:
                layers += [LayerNorm2d(channels), nn.GELU()]
            layers.append(nn.ConvTranspose2d(channels, channels, kernel_size=2, stride=2))
        return nn.Sequential(*layers)

    def forward(self, features: Sequence[Tensor]) -> list[Tensor]:
        """One (B, C, H/s, W/s) map per stride, level ``i`` from ``features[i]`` (B, C, H/p, W/p)."""
        if len(features) != len(self.levels):
            raise ValueError(f"expected {len(self.levels)} block outputs, got {len(features)}")
        return [level(f) for level, f in zip(self.levels, features, strict=True)]


class UperNetHead(nn.Module):
    """UperNet (segmentation_models_pytorch) on features at strides 4-32: logits at the input resolution."""

    def __init__(self, channels: Sequence[int], num_classes: int, decoder_channels: int, first_stride: int) -> None:
        """Initialise a new UperNetHead instance.

        Args:
            channels: widths of the features, finest first.
            num_classes: output channels.
            decoder_channels: UperNet's width.
            first_stride: stride of the finest feature; the head upsamples the decoder output by it.
        """
        super().__init__()
        # smp's decoder takes an encoder's whole feature list and skips its first two entries (strides 1, 2).
        self.decoder = UPerNetDecoder(encoder_channels=(0, 0, *channels), decoder_channels=decoder_channels)
        self.segmentation_head = SegmentationHead(decoder_channels, num_classes, kernel_size=1, upsampling=first_stride)

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        """Logits (B, num_classes, H, W) from features finest first."""
        return self.segmentation_head(self.decoder([None, None, *features]))


class SuperresHead(nn.Module):
    """A SimMIM-style decoder to the input resolution, then a PixelShuffle upsampler by the scale factor.

    The decoder is SimMIM's: a 1x1 convolution to ``stride**2 * hidden`` channels and a PixelShuffle
    by the backbone's output stride, giving ``hidden`` channels at the input resolution. The upsampler
    is a 3x3 convolution to ``hidden * scale**2`` channels, a PixelShuffle by ``scale``, GELU and a
    3x3 convolution to the output bands. With a ``residual`` map, the input upsampled bicubically and
    mapped to the output bands by it (a fixed 1x1 convolution) is added.
    """

    def __init__(
        self,
        in_channels: int,
        stride: int,
        out_channels: int,
        hidden: int,
        scale_factor: int,
        residual: tuple[Tensor, Tensor] | None,
    ) -> None:
        """Initialise a new SuperresHead instance.

        Args:
            in_channels: width of the backbone's last feature map.
            stride: its stride relative to the input.
            out_channels: bands of the output.
            hidden: channels at the input resolution.
            scale_factor: output / input resolution.
            residual: weights (out_channels, input bands) and bias (out_channels,) taking the
                upsampled input to the output bands, or None for no residual. Fixed, and not saved
                with the weights: it follows from the config.
        """
        super().__init__()
        self.scale_factor = scale_factor
        self.decoder = nn.Sequential(nn.Conv2d(in_channels, stride**2 * hidden, kernel_size=1), nn.PixelShuffle(stride))
        self.upsampler = nn.Sequential(
            nn.Conv2d(hidden, hidden * scale_factor**2, kernel_size=3, padding=1),
            nn.PixelShuffle(scale_factor),
            nn.GELU(),
            nn.Conv2d(hidden, out_channels, kernel_size=3, padding=1),
        )
        weight, bias = residual if residual is not None else (None, None)
        self.register_buffer("residual_weight", None if weight is None else weight[..., None, None], persistent=False)
        self.register_buffer("residual_bias", bias, persistent=False)

    def forward(self, features: Tensor, image: Tensor) -> Tensor:
        """The high-resolution image (B, C', H*s, W*s) from the last features and the input (B, C, H, W)."""
        out = self.upsampler(self.decoder(features))
        if self.residual_weight is not None:
            upsampled = F.interpolate(image, scale_factor=self.scale_factor, mode="bicubic", align_corners=False)
            out = out + F.conv2d(upsampled, self.residual_weight, self.residual_bias)
        return out
