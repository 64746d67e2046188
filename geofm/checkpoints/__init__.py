"""Checkpoint loading, layout conversion, architecture inference and backbone export.

Load weights in any registered layout (``geofm list checkpoint-layouts``: timm and Microsoft Swin
state dicts, GFM and SimMIM checkpoints, geofm training files and exports, Satlas' torchvision Swin-v2, DOFA and
Prithvi) into a timm backbone, without saying which layout or architecture it is, and publish a
backbone that plain timm and torchgeo load::

    model, report, info = build_backbone("gfm.pth", bands=["red", "green", "blue", "nir"])
    print(report)
    convert_checkpoint("gfm.pth", "exports/gfm")          # backbone.safetensors + backbone.json + MODEL_CARD.md
    weights = torchgeo_weights("exports/gfm")              # a torchgeo WeightsEnum member

or, into a model built already::

    report = load_backbone_weights(model, "swin_base_patch4_window7_224_22k.pth", rgb_positions=[2, 1, 0])
    export_backbone(model, out_dir, arch=arch, create_kwargs=kwargs, metadata={"bands": bands})

or a whole pretraining module (encoder, mask token, decoder, projector), to continue pretraining::

    report = load_pretraining_model(masked_image_model, "gfm.pth", bands=["red", "green", "blue", "nir"])
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "build": [
        "build_backbone",
        "convert_checkpoint",
        "format_inspection",
        "inspect_checkpoint",
        "load_backbone_for_bands",
        "load_pretraining_model",
    ],
    "card": ["model_card"],
    "convert": ["LoadReport", "backbone_state_dict", "load_backbone_weights"],
    "export": ["export_backbone", "timm_pretrained_cfg_overlay"],
    "facts": ["read_checkpoint"],
    "infer": ["ArchSpec", "infer_architecture"],
    "io": ["load_checkpoint_file", "resolve_checkpoint_path"],
    "layouts": ["CHECKPOINT_LAYOUTS", "detect_layout", "locate_backbone", "read_export_sidecar"],
    "pretraining": ["PretrainingReport"],
    "weights_enum": ["GeoFMWeights", "torchgeo_weights"],
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use: config validation reads an export's
    ``backbone.json`` (:mod:`.layouts`) without importing torch."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


__all__ = [
    "CHECKPOINT_LAYOUTS",
    "ArchSpec",
    "GeoFMWeights",
    "LoadReport",
    "PretrainingReport",
    "backbone_state_dict",
    "build_backbone",
    "convert_checkpoint",
    "detect_layout",
    "export_backbone",
    "format_inspection",
    "infer_architecture",
    "inspect_checkpoint",
    "load_backbone_for_bands",
    "load_backbone_weights",
    "load_checkpoint_file",
    "load_pretraining_model",
    "locate_backbone",
    "model_card",
    "read_checkpoint",
    "read_export_sidecar",
    "resolve_checkpoint_path",
    "timm_pretrained_cfg_overlay",
    "torchgeo_weights",
]
