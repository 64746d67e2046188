"""Shared fixtures: tiny backbones so the suite stays fast on two CPU cores."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}
TINY_VIT = {"embed_dim": 32, "depth": 4, "num_heads": 2}
SWIN_ARCH = "swin_tiny_patch4_window7_224"
VIT_ARCH = "vit_small_patch16_224"


@pytest.fixture
def tiny_swin():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(in_chans: int = 3, img_size: int = 64, window_size: int = 4):
        kwargs = backbone_kwargs(in_chans=in_chans, img_size=img_size, window_size=window_size, timm_kwargs=TINY_SWIN)
        return create_backbone(SWIN_ARCH, kwargs)

    return make


@pytest.fixture
def tiny_vit():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(in_chans: int = 3, img_size: int = 64):
        return create_backbone(VIT_ARCH, backbone_kwargs(in_chans=in_chans, img_size=img_size, timm_kwargs=TINY_VIT))

    return make
