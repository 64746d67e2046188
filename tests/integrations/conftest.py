"""Tiny geofm exports for the framework integrations: a micro Swin or ViT with bands and statistics."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import EXPORT_BANDS as BANDS
from tests.conftest import EXPORT_NORMALISATION as NORMALISATION
from tests.conftest import SWIN_ARCH, TINY_SWIN, TINY_VIT, VIT_ARCH


@pytest.fixture
def make_export(tmp_path):
    """``make_export(family="swin", bands=BANDS, img_size=64, **metadata)``: a seeded micro backbone's export folder."""
    import torch

    from geofm.checkpoints import export_backbone
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(family: str = "swin", bands=tuple(BANDS), img_size: int = 64, name: str = "export", **metadata) -> Path:
        if family == "swin":
            arch, kwargs = (
                SWIN_ARCH,
                backbone_kwargs(in_chans=len(bands), img_size=img_size, window_size=4, timm_kwargs=TINY_SWIN),
            )
        else:
            arch, kwargs = VIT_ARCH, backbone_kwargs(in_chans=len(bands), img_size=img_size, timm_kwargs=TINY_VIT)
        torch.manual_seed(0)
        model = create_backbone(arch, kwargs)
        metadata = {"bands": list(bands), "normalisation": NORMALISATION, "method": "gfm", **metadata}
        export_backbone(model, tmp_path / name, arch=arch, create_kwargs=kwargs, metadata=metadata)
        return tmp_path / name

    return make
