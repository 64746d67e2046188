"""A frozen teacher built from its checkpoint: the backbone of its architecture, its weights in red, green, blue order."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from geofm.checkpoints.build import load_backbone_for_bands
from geofm.data.bands import RGB
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.tasks.mim.teacher import FrozenTeacher, teacher_tap

if TYPE_CHECKING:
    from geofm.config import TeacherConfig

log = logging.getLogger("geofm.checkpoints")


def build_teacher(cfg: TeacherConfig, band_indices: list[int]) -> FrozenTeacher:
    """Build the teacher from its local weights file, in any layout ``geofm checkpoint`` reads.

    A GFM checkpoint gives its teacher (``teacher.*``), never its student; other files hold one
    backbone. Every tensor of ``cfg.arch`` must come from the file and every backbone tensor of the
    file must fit it; what was loaded and adapted is logged. The teacher sees red, green, blue in
    that order; a checkpoint with named bands in another order (a geofm export of a BGR model, say)
    has its kernels rearranged to match.

    Raises:
        CheckpointNotFoundError: when ``cfg.checkpoint`` does not exist.
        CheckpointFormatError: when the file's layout or keys do not fit ``cfg.arch`` (a missing or
            unexpected key included).
    """
    kwargs = backbone_kwargs(
        in_chans=3, img_size=cfg.img_size, window_size=cfg.window_size, timm_kwargs=cfg.timm_kwargs
    )
    backbone = create_backbone(cfg.arch, kwargs)
    report = load_backbone_for_bands(backbone, cfg.checkpoint, RGB, strict=True, teacher=True)
    log.info("teacher loaded from %s: %s", cfg.checkpoint, report)
    return FrozenTeacher(
        backbone, teacher_tap(cfg, backbone), band_indices, cfg.img_size, cfg.resize_mode, cfg.align_corners
    )
