"""Where algorithms that act on features (MOON, FedAlign) read a model: its representation network
(``backbone`` or ``encoder``) and that network's final stage."""

from __future__ import annotations

from torch import nn

from geofm.errors import ConfigError

REPRESENTATION_MODULES = ("backbone", "encoder")


def representation_module(module: nn.Module, algorithm: str) -> tuple[str, nn.Module]:
    """The name and module of a model's representation network: its ``backbone`` or ``encoder``.

    Raises:
        ConfigError: the model has neither (the message names ``algorithm``).
    """
    for name in REPRESENTATION_MODULES:
        found = getattr(module, name, None)
        if isinstance(found, nn.Module):
            return name, found
    raise ConfigError(
        f"algorithm {algorithm} reads the representation of a model's backbone or encoder; "
        f"{type(module).__name__} has no module named {' or '.join(REPRESENTATION_MODULES)}"
    )


def final_stage(backbone: nn.Module, algorithm: str) -> nn.Module:
    """The backbone's final stage as a module every forward path calls: a Swin's last stage's blocks
    (``layers[-1].blocks``, (B, H, W, C) in and out), or a ViT's last block (a ViT has no stages;
    (B, N, C) in and out).

    The blocks rather than the stage: GFM's tap after the last stage's patch merging runs the
    stage's merging and blocks apart, never the stage as a module.

    Raises:
        ConfigError: the backbone has neither (the message names ``algorithm``).
    """
    stages = getattr(backbone, "layers", None)
    if isinstance(stages, nn.Sequential) and len(stages) and isinstance(getattr(stages[-1], "blocks", None), nn.Module):
        return stages[-1].blocks
    blocks = getattr(backbone, "blocks", None)
    if isinstance(blocks, nn.Sequential) and len(blocks):
        return blocks[-1]
    raise ConfigError(
        f"algorithm {algorithm} reads the final stage of a Swin's layers[-1].blocks or a ViT's blocks; "
        f"{type(backbone).__name__} has neither"
    )


__all__ = ["REPRESENTATION_MODULES", "final_stage", "representation_module"]
