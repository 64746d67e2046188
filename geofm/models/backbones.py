"""Backbones through timm: Swin (v1 and v2) and ViT with any band count, image size and window size.

The model returned by :func:`create_backbone` is a plain timm model (``num_classes=0``), so its
``state_dict`` is in timm's key layout and exports load into ``timm.create_model`` unchanged.

Config validation imports this module, so timm and torch are imported by the functions that use
them: a config error is reported without loading them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from geofm.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

# timm modules of each family; a Swin-v2 trains, distils and exports as a Swin does (hierarchical
# stages of windowed attention, patch merging at the start of each stage but the first).
FAMILIES = {"swin": ("swin_transformer", "swin_transformer_v2"), "vit": ("vision_transformer",)}


@functools.cache
def _registered(module: str) -> frozenset[str]:
    import timm

    return frozenset(timm.list_models(module=module))


def backbone_family(arch: str) -> str:
    """Return ``"swin"`` (Swin v1 or v2) or ``"vit"`` for a registered timm architecture name.

    Raises:
        ConfigError: if ``arch`` is not a timm Swin or ViT architecture.
    """
    for family, modules in FAMILIES.items():
        if any(arch in _registered(module) for module in modules):
            return family
    beit = (
        f": {arch} is timm's Beit, a ViT with relative position bias, which geofm converts (geofm checkpoint "
        "convert) but does not train; a SimMIM/BEiT ViT with absolute position embeddings loads into vit_*"
        if arch in _registered("beit")
        else ""
    )
    raise ConfigError(
        f"unknown backbone architecture {arch!r}: expected a timm Swin or ViT name such as "
        f"swin_base_patch4_window7_224, swinv2_base_window8_256 or vit_base_patch16_224 (see "
        f"timm.list_models('swin*')){beit}"
    )


def is_swin(model: nn.Module) -> bool:
    """Whether ``model`` is a timm Swin, v1 (``SwinTransformer``) or v2 (``SwinTransformerV2``)."""
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    return isinstance(model, (SwinTransformer, SwinTransformerV2))


@dataclass(frozen=True)
class ArchInfo:
    """Shape facts of an architecture that do not depend on image size."""

    family: str
    patch_size: int
    depth: int  # stages for Swin, blocks for ViT
    embed_dims: tuple[int, ...]  # per stage for Swin, one entry for ViT


@functools.cache
def _arch_info(arch: str, kwargs_json: str) -> ArchInfo:
    import timm
    import torch

    family = backbone_family(arch)
    with torch.device("meta"):
        model = timm.create_model(arch, pretrained=False, num_classes=0, **json.loads(kwargs_json))
    patch = model.patch_embed.patch_size
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    if family == "swin":
        dims = tuple(stage.blocks[0].norm1.normalized_shape[0] for stage in model.layers)
        return ArchInfo(family, int(patch), len(model.layers), dims)
    return ArchInfo(family, int(patch), len(model.blocks), (model.embed_dim,))


def arch_info(arch: str, timm_kwargs: dict[str, Any] | None = None) -> ArchInfo:
    """Patch size, depth and widths of ``arch`` with ``timm_kwargs`` applied (built on the meta device)."""
    return _arch_info(arch, json.dumps(timm_kwargs or {}, sort_keys=True))


def patch_size_of(arch: str, timm_kwargs: dict[str, Any] | None = None) -> int:
    return arch_info(arch, timm_kwargs).patch_size


def stage_count_of(arch: str, timm_kwargs: dict[str, Any] | None = None) -> int:
    return arch_info(arch, timm_kwargs).depth


def backbone_kwargs(
    *,
    in_chans: int,
    img_size: int,
    window_size: int | None = None,
    timm_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``timm.create_model`` kwargs of a headless backbone; exports record exactly these."""
    kwargs = {"num_classes": 0, "in_chans": in_chans, "img_size": img_size, **(timm_kwargs or {})}
    if window_size is not None:
        kwargs["window_size"] = window_size
    return kwargs


def backbone_config_fields(create_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``img_size``, ``window_size`` (if any) and ``timm_kwargs`` of a backbone config that give
    these :func:`backbone_kwargs` (as an export records them), whatever the bands."""
    kwargs = {k: v for k, v in create_kwargs.items() if k not in ("num_classes", "in_chans")}
    fields = {key: kwargs.pop(key) for key in ("img_size", "window_size") if key in kwargs}
    return {**fields, "timm_kwargs": kwargs}


def create_backbone(arch: str, kwargs: dict[str, Any], drop_path_rate: float = 0.0) -> nn.Module:
    """Build a randomly initialised timm backbone from :func:`backbone_kwargs`."""
    import timm

    backbone_family(arch)
    return timm.create_model(arch, pretrained=False, drop_path_rate=drop_path_rate, **kwargs)


def resize_input(model: nn.Module, img_size: int) -> None:
    """Make a timm Swin or ViT take ``img_size`` x ``img_size`` inputs, in place (timm's ``set_input_size``).

    A Swin (v1 or v2) keeps the window each stage has now, so on larger inputs every relative position table
    is used as it was trained and only the attention masks are rebuilt (there are more windows,
    shifted where a stage now has more than one); a stage whose feature map becomes smaller than
    its window gets a window of the map's size, its table resized by timm. A ViT's absolute
    position embedding is resampled to the new patch grid (timm, bicubic).

    Raises:
        ValueError: if ``img_size`` is not positive.
    """
    if img_size <= 0:
        raise ValueError(f"an input size must be positive, got {img_size}")
    size = (img_size, img_size)
    if is_swin(model):
        model.set_input_size(img_size=size, window_size=[stage.blocks[0].window_size for stage in model.layers])
    else:
        model.set_input_size(img_size=size)


def feature_pyramid(model: nn.Module, images: torch.Tensor, indices: int | list[int] = 4) -> list[torch.Tensor]:
    """Multi-scale NCHW feature maps for dense heads (Swin: one per stage; ViT: chosen blocks)."""
    return model.forward_intermediates(images, indices=indices, intermediates_only=True)


def set_fused_attention(model: nn.Module, enabled: bool) -> int:
    """Switch every timm attention module in ``model`` to torch's fused ``scaled_dot_product_attention`` or back.

    timm reads its global switch (``timm.layers.set_fused_attn``) when a module is built, and for
    Swin only in its experimental mode; this sets the choice on modules already built. Both paths
    compute the same attention up to float rounding.

    Returns:
        The number of attention modules switched.
    """
    modules = [m for m in model.modules() if hasattr(m, "fused_attn")]
    for m in modules:
        m.fused_attn = enabled
    return len(modules)


def prefer_fused_attention(model: nn.Module, device: torch.device) -> None:
    """Use torch's fused attention for training on ``device`` where it pays.

    On CUDA GPUs the fused kernels (flash, memory-efficient) avoid materialising the attention
    matrix and its softmax for backward. On CPUs, Swin's masked window attention trains about 5%
    slower fused than explicit in fp32 (``geofm bench``), so there timm's own choice stands
    (explicit for Swin, fused for ViT).
    """
    if device.type == "cuda":
        set_fused_attention(model, True)
