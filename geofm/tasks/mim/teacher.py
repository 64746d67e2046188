"""The frozen ImageNet teacher of GFM, truncated where its features are distilled."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geofm.models.backbones import backbone_kwargs, create_backbone, is_swin
from geofm.tasks.mim.model import Tap, check_tap, default_vit_tap, embed_tokens, run_backbone, tap_channels

if TYPE_CHECKING:  # the config schema (pydantic) stays out of the model code's imports
    from geofm.config import TeacherConfig


class FrozenTeacher(nn.Module):
    """A backbone cut after ``tap`` that never trains.

    Its parameters have ``requires_grad=False``, it stays in eval mode whatever ``train()`` is
    called with, and it runs under ``torch.inference_mode``. Keep it out of the optimizer and out
    of training checkpoints: it is rebuilt from its weights file. It computes in the dtype of its
    weights: after ``teacher.to(device, torch.bfloat16)`` (see :func:`teacher_dtype`) matrix
    products run in bfloat16 under autocast, the resize in the input's precision, and the features
    come back as float32 either way.

    Args:
        backbone: a timm Swin or ViT holding the teacher's weights.
        tap: where to cut.
        band_indices: input bands the teacher sees (red, green, blue).
        img_size: the teacher's input size; images are resized to it.
        resize_mode: interpolation of that resize, ``bilinear`` (GFM) or ``bicubic``.
        align_corners: the resize's ``align_corners`` (GFM: True).
    """

    def __init__(
        self,
        backbone: nn.Module,
        tap: Tap,
        band_indices: list[int],
        img_size: int,
        resize_mode: str = "bilinear",
        align_corners: bool = True,
    ) -> None:
        super().__init__()
        check_tap(backbone, tap)
        self.out_channels = tap_channels(backbone, tap)
        _drop_after_tap(backbone, tap)
        self.backbone = backbone
        self.tap = tap
        self.img_size = img_size
        self.resize_mode = resize_mode
        self.align_corners = align_corners
        self.register_buffer("band_indices", torch.tensor(band_indices), persistent=False)
        self.requires_grad_(False)
        super().train(False)

    def train(self, mode: bool = True) -> FrozenTeacher:
        """The teacher stays in eval mode."""
        return self

    def forward(self, images: Tensor) -> Tensor:
        """Features (B, h, w, C) of the unmasked ``images`` (all input bands, normalised)."""
        dtype = self.backbone.patch_embed.proj.weight.dtype
        with torch.inference_mode():
            x = images.index_select(1, self.band_indices)
            if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
                x = F.interpolate(
                    x, size=(self.img_size, self.img_size), mode=self.resize_mode, align_corners=self.align_corners
                )
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
                tokens = embed_tokens(self.backbone, x.to(dtype))
                _, tapped = run_backbone(self.backbone, tokens, self.tap, stop_at_tap=True)
        # Copied outside inference mode: a plain tensor the distillation loss may save for backward.
        return tapped.to(torch.float32, copy=True)


def _drop_after_tap(model: nn.Module, tap: Tap) -> None:
    """Remove the modules the truncated forward never reaches, to save memory."""
    if is_swin(model):
        keep = tap.index + 1 if tap.include_merging else tap.index
        model.layers = model.layers[:keep]
        if tap.include_merging:
            model.layers[-1].blocks = nn.Sequential()  # no blocks; iterable as Swin-v2's ModuleList
    else:
        model.blocks = model.blocks[: tap.index]
    model.norm = nn.Identity()
    model.head = nn.Identity()


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively: a CUDA GPU with bf16, or a CPU where oneDNN has bf16 kernels."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def teacher_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The teacher's compute dtype for ``teacher.precision`` on ``device`` (``auto``: bf16 where native)."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def teacher_tap(cfg: TeacherConfig, backbone: nn.Module) -> Tap:
    """The configured tap: a Swin stage (with its merging by default) or a ViT block."""
    if is_swin(backbone):
        return Tap(cfg.stage, cfg.include_merging)
    return Tap(cfg.block) if cfg.block is not None else default_vit_tap(backbone)


def teacher_channels(cfg: TeacherConfig) -> int:
    """Width of the configured teacher's features at its tap, from its architecture alone (no weights read)."""
    kwargs = backbone_kwargs(
        in_chans=3, img_size=cfg.img_size, window_size=cfg.window_size, timm_kwargs=cfg.timm_kwargs
    )
    with torch.device("meta"):
        backbone = create_backbone(cfg.arch, kwargs)
    return tap_channels(backbone, teacher_tap(cfg, backbone))
