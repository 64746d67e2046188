"""Checkpoint loading, layout conversion and backbone export.

Load weights in any known layout (timm, Microsoft Swin, GFM, SimMIM, geofm training or export)
into a timm backbone, and publish a backbone that plain timm loads::

    report = load_backbone_weights(model, "swin_base_patch4_window7_224_22k.pth", rgb_positions=[2, 1, 0])
    print(report)
    export_backbone(model, out_dir, arch=arch, create_kwargs=kwargs, metadata={"bands": bands})
"""

from geofm.checkpoints.convert import LoadReport, backbone_state_dict, load_backbone_weights
from geofm.checkpoints.export import export_backbone, read_export_sidecar, timm_pretrained_cfg_overlay
from geofm.checkpoints.io import load_checkpoint_file, resolve_checkpoint_path
from geofm.checkpoints.layouts import LAYOUTS, detect_layout, locate_backbone

__all__ = [
    "LAYOUTS",
    "LoadReport",
    "backbone_state_dict",
    "detect_layout",
    "export_backbone",
    "load_backbone_weights",
    "load_checkpoint_file",
    "locate_backbone",
    "read_export_sidecar",
    "resolve_checkpoint_path",
    "timm_pretrained_cfg_overlay",
]
