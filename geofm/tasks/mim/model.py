"""Masked image modelling on a timm backbone: mask token, feature taps and the pixel decoder.

:class:`MaskedImageModel` is the module every pretraining mode trains. Its state-dict keys follow
SimMIM/GFM (``encoder.*`` is a plain timm backbone, plus ``mask_token``, ``decoder.*`` and
``projector.*``), so the student exports directly in timm's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from timm.layers import trunc_normal_
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from geofm.models.backbones import is_swin
from geofm.tasks.mim.loss import gfm_loss


@dataclass(frozen=True)
class Tap:
    """Where intermediate features are read.

    Swin: after stage ``index`` (1-based), and with ``include_merging`` after the patch merging
    that ends it in Microsoft's layout (timm runs it at the start of the next stage; GFM distils
    there). ViT: after block ``index`` (1-based).
    """

    index: int
    include_merging: bool = False


def default_vit_tap(model: VisionTransformer) -> Tap:
    """Three quarters of the depth, the GFM/SimMIM choice for ViT distillation."""
    return Tap(max(1, round(len(model.blocks) * 3 / 4)))


def tap_channels(model: nn.Module, tap: Tap) -> int:
    """Channel count of the features at ``tap``."""
    if is_swin(model):
        stage = tap.index if tap.include_merging else tap.index - 1
        return model.feature_info[stage]["num_chs"]
    return model.embed_dim


def check_tap(model: nn.Module, tap: Tap) -> None:
    """Raise ValueError when ``tap`` lies outside ``model``."""
    if is_swin(model):
        last = len(model.layers) - (1 if tap.include_merging else 0)
        if not 1 <= tap.index <= last:
            raise ValueError(f"Swin tap after stage {tap.index} (merging={tap.include_merging}) is outside 1..{last}")
    elif not 1 <= tap.index <= len(model.blocks):
        raise ValueError(f"ViT tap after block {tap.index} is outside 1..{len(model.blocks)}")


def embed_tokens(model: nn.Module, images: Tensor, mask: Tensor | None = None, mask_token: Tensor | None = None):
    """Patch-embed ``images`` and replace masked tokens by ``mask_token``.

    Returns tokens as (B, H, W, C) for Swin and (B, N, C) for ViT, timm's own formats.
    """
    tokens = model.patch_embed(images)
    if mask is not None:
        weight = mask.to(tokens.dtype)
        weight = weight.unsqueeze(-1) if tokens.ndim == 4 else weight.flatten(1).unsqueeze(-1)
        tokens = tokens * (1 - weight) + mask_token.to(tokens.dtype) * weight
    return tokens


def run_backbone(model: nn.Module, tokens: Tensor, tap: Tap | None, stop_at_tap: bool = False):
    """Run a timm Swin or ViT from embedded tokens, mirroring its ``forward_features``.

    Returns ``(features, tapped)``: final normed features as (B, C, h, w) (None when stopped at
    the tap) and the tapped features as (B, h, w, C) (None without a tap).
    """
    tapped = None
    if is_swin(model):
        x = tokens
        for i, stage in enumerate(model.layers):
            if tap is not None and tap.include_merging and i == tap.index:
                x = tapped = stage.downsample(x)
                if stop_at_tap:
                    return None, tapped
                if isinstance(stage.blocks, nn.Sequential):  # called whole, so hooks on it (MOON, FedAlign) fire
                    x = stage.blocks(x)
                else:  # a ModuleList in timm's Swin-v2
                    for block in stage.blocks:
                        x = block(x)
            else:
                x = stage(x)
            if tap is not None and not tap.include_merging and i + 1 == tap.index:
                tapped = x
                if stop_at_tap:
                    return None, tapped
        return rearrange(model.norm(x), "b h w c -> b c h w"), tapped

    if not isinstance(model, VisionTransformer):
        raise TypeError(f"expected a timm SwinTransformer(V2) or VisionTransformer, got {type(model).__name__}")
    h, w = model.patch_embed.grid_size
    x = model.norm_pre(model.patch_drop(model._pos_embed(tokens)))
    for i, block in enumerate(model.blocks):
        x = block(x)
        if tap is not None and i + 1 == tap.index:
            tapped = rearrange(x[:, model.num_prefix_tokens :], "b (h w) c -> b h w c", h=h, w=w)
            if stop_at_tap:
                return None, tapped
    x = model.norm(x)[:, model.num_prefix_tokens :]
    return rearrange(x, "b (h w) c -> b c h w", h=h, w=w), tapped


def encoder_stride(model: nn.Module) -> int:
    """Pixels per final feature: patch size times the Swin merges; the patch size for ViT."""
    patch = model.patch_embed.patch_size[0]
    if is_swin(model):
        return patch * 2 ** (len(model.layers) - 1)
    return patch


class MaskedImageModel(nn.Module):
    """SimMIM student with optional GFM feature projection.

    Args:
        encoder: a headless timm Swin or ViT.
        in_chans: bands reconstructed by the decoder (all input bands).
        tap: where student features are distilled (None: plain SimMIM).
        distill_dim: teacher feature width; adds the linear ``projector``.
        alpha: weight of the distillation loss.
        distill_loss: ``pooled_cosine`` (GFM) or ``token_cosine`` (see :mod:`geofm.tasks.mim.loss`).
    """

    def __init__(
        self,
        encoder: nn.Module,
        in_chans: int,
        tap: Tap | None = None,
        distill_dim: int | None = None,
        alpha: float = 1.0,
        distill_loss: str = "pooled_cosine",
    ) -> None:
        super().__init__()
        if (tap is None) != (distill_dim is None):
            raise ValueError("tap and distill_dim go together: both for GFM, neither for plain SimMIM")
        if tap is not None:
            check_tap(encoder, tap)
        self.encoder = encoder
        self.tap = tap
        self.alpha = alpha
        self.distill_loss = distill_loss
        self.patch_size = encoder.patch_embed.patch_size[0]
        self.mask_token = nn.Parameter(torch.zeros(encoder.patch_embed.proj.out_channels))
        trunc_normal_(self.mask_token, std=0.02)
        stride = encoder_stride(encoder)
        self.decoder = nn.Sequential(
            nn.Conv2d(encoder.num_features, stride**2 * in_chans, kernel_size=1),
            nn.PixelShuffle(stride),
        )
        self.projector = nn.Linear(tap_channels(encoder, tap), distill_dim) if tap is not None else None

    def no_weight_decay(self) -> set[str]:
        """Parameters kept free of weight decay beyond norms and biases: mask token, position tables."""
        names = {"mask_token"}
        if hasattr(self.encoder, "no_weight_decay"):
            names |= {f"encoder.{n}" for n in self.encoder.no_weight_decay()}
        return names

    def encode(self, images: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """Masked forward: final features (B, C, h, w) and tapped features (B, h, w, C) or None."""
        tokens = embed_tokens(self.encoder, images, mask, self.mask_token)
        return run_backbone(self.encoder, tokens, self.tap)

    def reconstruct(self, images: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """Masked forward through the decoder: the reconstruction (B, C, H, W), in the normalised
        units of ``images``, and the tapped features (B, h, w, C) or None."""
        features, tapped = self.encode(images, mask)
        return self.decoder(features), tapped

    def pixel_mask(self, mask: Tensor) -> Tensor:
        """The (B, h, w) token mask at pixel resolution, (B, 1, H, W)."""
        return mask.repeat_interleave(self.patch_size, 1).repeat_interleave(self.patch_size, 2).unsqueeze(1)

    def forward(
        self,
        images: Tensor,
        mask: Tensor,
        valid: Tensor | None = None,
        teacher_features: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Return the GFM losses (``loss``, ``loss_mim``, ``loss_distill``) for one batch.

        Args:
            images: (B, C, H, W) normalised input.
            mask: (B, h, w) token mask, 1 where masked.
            valid: optional (B, C, H, W) bool validity of each pixel and band.
            teacher_features: (B, h', w', C') frozen-teacher features for distillation.
        """
        reconstruction, tapped = self.reconstruct(images, mask)
        student = self.projector(tapped) if teacher_features is not None else None
        return gfm_loss(
            reconstruction,
            images,
            self.pixel_mask(mask),
            valid,
            student,
            teacher_features,
            self.alpha,
            self.distill_loss,
        )
