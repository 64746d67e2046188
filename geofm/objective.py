"""The GFM objective: masked L1 reconstruction plus alpha times negative cosine distillation.

Written once and used by every pretraining mode (central and each federated client). Losses
are computed in float32 whatever the engine's precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor


def masked_l1_loss(reconstruction: Tensor, images: Tensor, pixel_mask: Tensor, valid: Tensor | None = None) -> Tensor:
    """L1 over masked pixels, divided by the number of bands (SimMIM's normalisation).

    Args:
        reconstruction: (B, C, H, W) decoder output.
        images: (B, C, H, W) normalised input.
        pixel_mask: (B, 1, H, W), 1 where the pixel was masked.
        valid: optional (B, C, H, W) bool, False for nodata pixels and bands a source lacks;
            those are left out, so the loss is the mean L1 over valid masked (pixel, band) pairs.
            With every pixel valid this equals SimMIM's ``sum(l1 * mask) / sum(mask) / C``.
    """
    weight = pixel_mask.float().expand_as(images)
    if valid is not None:
        weight = weight * valid.float()
    l1 = F.l1_loss(reconstruction.float(), images.float(), reduction="none")
    return (l1 * weight).sum() / (weight.sum() + 1e-5)


def negative_cosine_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean negative cosine similarity between (B, h, w, C) token maps.

    The teacher map is resampled to the student's token grid when the two differ (for instance a
    ViT student at stride 16 against a Swin teacher at stride 32).
    """
    teacher = teacher.float()
    if teacher.shape[1:3] != student.shape[1:3]:
        teacher = rearrange(teacher, "b h w c -> b c h w")
        teacher = F.interpolate(teacher, size=student.shape[1:3], mode="bilinear", align_corners=False)
        teacher = rearrange(teacher, "b c h w -> b h w c")
    return -F.cosine_similarity(student.float(), teacher, dim=-1).mean()


def gfm_loss(
    reconstruction: Tensor,
    images: Tensor,
    pixel_mask: Tensor,
    valid: Tensor | None = None,
    student_features: Tensor | None = None,
    teacher_features: Tensor | None = None,
    alpha: float = 1.0,
) -> dict[str, Tensor]:
    """``loss = mim + alpha * distill``; plain SimMIM when there are no teacher features."""
    mim = masked_l1_loss(reconstruction, images, pixel_mask, valid)
    if teacher_features is None:
        distill = torch.zeros((), device=mim.device)
        total = mim
    else:
        distill = negative_cosine_loss(student_features, teacher_features)
        total = mim + alpha * distill
    return {"loss": total, "loss_mim": mim.detach(), "loss_distill": distill.detach()}
