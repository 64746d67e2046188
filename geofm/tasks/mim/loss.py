"""The GFM objective: masked L1 reconstruction plus alpha times negative cosine distillation.

Written once and used by every pretraining mode (central and each federated client). Losses
are computed in float32 whatever the engine's precision.

The distillation term follows GFM by default (``pooled_cosine``): the student's projected and the
teacher's features at the tap are average-pooled over their token grids to one vector per image,
and the loss is the batch mean of one negative cosine per image. ``token_cosine`` is the alternative
of a negative cosine per token position (the teacher's grid resampled to the student's), kept as a
named option for ablations: it asks the student to match the teacher's spatial layout as well.
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


DISTILL_LOSSES = ("pooled_cosine", "token_cosine")


def pooled_negative_cosine_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """GFM's distillation: ``-mean_b cos(mean_hw student_b, mean_hw teacher_b)``.

    Args:
        student: (B, h, w, C) projected student features.
        teacher: (B, h', w', C) teacher features; the grids may differ (pooling removes them).
    """
    return -F.cosine_similarity(student.float().mean(dim=(1, 2)), teacher.float().mean(dim=(1, 2)), dim=-1).mean()


def negative_cosine_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean negative cosine similarity between (B, h, w, C) token maps, position by position.

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
    distill_loss: str = "pooled_cosine",
) -> dict[str, Tensor]:
    """``loss = mim + alpha * distill``; plain SimMIM when there are no teacher features.

    ``distill_loss`` is ``pooled_cosine`` (GFM) or ``token_cosine``, see the module docstring.
    """
    mim = masked_l1_loss(reconstruction, images, pixel_mask, valid)
    if teacher_features is None:
        distill = torch.zeros((), device=mim.device)
        total = mim
    else:
        if distill_loss == "pooled_cosine":
            distill = pooled_negative_cosine_loss(student_features, teacher_features)
        elif distill_loss == "token_cosine":
            distill = negative_cosine_loss(student_features, teacher_features)
        else:
            raise ValueError(f"unknown distill_loss {distill_loss!r}; expected one of {DISTILL_LOSSES}")
        total = mim + alpha * distill
    return {"loss": total, "loss_mim": mim.detach(), "loss_distill": distill.detach()}
