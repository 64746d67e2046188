"""Tiny Swin/ViT backbones and their weights in the layouts checkpoints come in.

Tests reach the builders through the ``kit`` fixture (``kit.make_swin()``, ``kit.features(model)``...).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from geofm.models.backbones import backbone_kwargs, create_backbone

SWIN = "swin_tiny_patch4_window7_224"
VIT = "vit_small_patch16_224"
# two blocks in the first stages so that shifted windows (and their attn_mask) exist at 64 px
SWIN_KWARGS = {"embed_dim": 16, "depths": [2, 2, 2, 1], "num_heads": [1, 2, 4, 8]}
VIT_KWARGS = {"embed_dim": 32, "depth": 4, "num_heads": 2}
IMG = 64


def swin_kwargs(in_chans: int = 3, window_size: int = 4, img_size: int = IMG) -> dict:
    return backbone_kwargs(in_chans=in_chans, img_size=img_size, window_size=window_size, timm_kwargs=SWIN_KWARGS)


def vit_kwargs(in_chans: int = 3, img_size: int = IMG) -> dict:
    return backbone_kwargs(in_chans=in_chans, img_size=img_size, timm_kwargs=VIT_KWARGS)


def make_swin(in_chans: int = 3, window_size: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return create_backbone(SWIN, swin_kwargs(in_chans, window_size)).eval()


def make_vit(in_chans: int = 3, img_size: int = IMG, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return create_backbone(VIT, vit_kwargs(in_chans, img_size)).eval()


def features(model: nn.Module, in_chans: int = 3, seed: int = 1) -> torch.Tensor:
    images = torch.randn(2, in_chans, IMG, IMG, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.forward_features(images)


def microsoft_swin_state(model: nn.Module, num_classes: int = 10) -> dict[str, torch.Tensor]:
    """A timm Swin's weights in Microsoft's names, with the buffers and classifier the releases hold."""
    state = {}
    for key, value in model.state_dict().items():
        key = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", key)
        state[key] = value.clone()
    for name, buffer in model.named_buffers():  # relative_position_index and attn_mask, not persistent in timm
        state[name] = buffer.clone()
    assert any(k.endswith("attn_mask") for k in state) and any(k.endswith("relative_position_index") for k in state)
    state["head.weight"] = torch.randn(num_classes, model.num_features)
    state["head.bias"] = torch.zeros(num_classes)
    return state


def prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


def decoder_state(prefix: str = "decoder.") -> dict[str, torch.Tensor]:
    return {prefix + "0.weight": torch.randn(48, 128, 1, 1), prefix + "0.bias": torch.zeros(48)}


@pytest.fixture
def kit():
    """The builders and constants of this module."""
    return SimpleNamespace(**{name: value for name, value in globals().items() if not name.startswith("_")})


@pytest.fixture
def save(tmp_path: Path):
    """Write an object with torch.save under tmp_path and return the file's path."""

    def write(obj, name: str = "ckpt.pth") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)
        return path

    return write
