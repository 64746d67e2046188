"""Publishing a backbone: timm-layout safetensors, a JSON sidecar that says how to rebuild it, and a
model card (``MODEL_CARD.md``) for people.

The export loads into plain timm without geofm::

    import json, timm
    meta = json.load(open("out/backbone.json"))
    model = timm.create_model(
        meta["arch"],
        pretrained=True,
        pretrained_cfg_overlay=dict(file="out/backbone.safetensors", **meta["timm_pretrained_cfg_overlay"]),
        **meta["timm_kwargs"],
    )

The overlay tells timm that the file has no classifier (``num_classes=0``, ``classifier=None``),
so timm keeps its strict key check instead of dropping the head and loading non-strictly, and
that the file's input convolution already has the model's band count (``input_size`` with that
count, ``first_conv=None``), so timm neither adapts it nor warns about 3-band ImageNet weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors.torch import save_file
from torch import nn

from geofm.checkpoints.card import MODEL_CARD, model_card
from geofm.checkpoints.io import EXPORT_WEIGHTS
from geofm.checkpoints.layouts import EXPORT_FORMAT, EXPORT_SIDECAR
from geofm.errors import ConfigError

EXPORT_FILES = (EXPORT_WEIGHTS, EXPORT_SIDECAR, MODEL_CARD)
"""What :func:`export_backbone` writes into its folder."""
RESERVED_KEYS = ("format", "arch", "timm_kwargs", "timm_pretrained_cfg_overlay", "num_params")


def timm_pretrained_cfg_overlay(model: nn.Module) -> dict[str, Any]:
    """The ``pretrained_cfg_overlay`` fields (besides ``file``) that make timm load an export of ``model``."""
    proj = model.patch_embed.proj
    img_size = model.patch_embed.img_size
    height, width = (img_size, img_size) if isinstance(img_size, int) else img_size
    return {
        "num_classes": 0,
        "classifier": None,
        "first_conv": None,
        "input_size": [int(proj.in_channels), int(height), int(width)],
    }


def export_backbone(
    model: nn.Module,
    out_dir: str | Path,
    *,
    arch: str,
    create_kwargs: dict[str, Any],
    metadata: dict[str, Any],
) -> Path:
    """Write ``out_dir/backbone.safetensors``, its sidecar ``out_dir/backbone.json`` and ``out_dir/MODEL_CARD.md``.

    Args:
        model: a headless timm backbone (``num_classes=0``), e.g. the pretrained student's encoder.
        out_dir: folder to write into (created if needed); existing export files are replaced.
        arch: the timm architecture name the model was created with.
        create_kwargs: the ``timm.create_model`` kwargs that rebuild the model
            (:func:`geofm.models.backbones.backbone_kwargs`).
        metadata: JSON-serialisable facts for users of the weights, shown in the model card:
            ``bands`` (in order), ``gsd`` (``[min, max]`` m/px), ``normalisation`` (per source:
            ``bands``, ``scale``, ``mean``, ``std``), ``img_size``, ``method``, ``data``, ``teacher``,
            ``steps``, ``metrics``, ``config``...

    Returns:
        The path of the safetensors file.

    Raises:
        ConfigError: if the model has a classifier, ``create_kwargs`` do not rebuild tensors of the
            model's shapes, or ``metadata`` uses a reserved key or is not JSON-serialisable.
    """
    if getattr(model, "num_classes", 0):
        raise ConfigError(
            f"export_backbone expects a headless backbone (num_classes=0), got num_classes={model.num_classes}"
        )
    clashes = sorted(set(metadata) & set(RESERVED_KEYS))
    if clashes:
        raise ConfigError(f"export metadata may not set {clashes}: these sidecar keys are written by geofm")

    state = {
        k: (v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()).contiguous()
        for k, v in model.state_dict().items()
    }
    _check_rebuilds(arch, create_kwargs, state)
    sidecar = {
        "format": EXPORT_FORMAT,
        "arch": arch,
        "timm_kwargs": create_kwargs,
        "timm_pretrained_cfg_overlay": timm_pretrained_cfg_overlay(model),
        "num_params": sum(p.numel() for p in model.parameters()),
        **metadata,
    }
    try:
        sidecar_text = json.dumps(sidecar, indent=2, default=_json_default) + "\n"
    except (TypeError, ValueError) as err:
        raise ConfigError(f"export metadata is not JSON-serialisable: {err}") from err
    card_text = model_card(json.loads(sidecar_text), EXPORT_WEIGHTS)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights_path, sidecar_path = out_dir / EXPORT_WEIGHTS, out_dir / EXPORT_SIDECAR
    _replace(weights_path, lambda tmp: save_file(state, str(tmp), metadata={"format": EXPORT_FORMAT, "arch": arch}))
    _replace(sidecar_path, lambda tmp: tmp.write_text(sidecar_text))
    _replace(out_dir / MODEL_CARD, lambda tmp: tmp.write_text(card_text))
    return weights_path


def _check_rebuilds(arch: str, create_kwargs: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Fail early if ``timm.create_model(arch, **create_kwargs)`` would not accept these tensors."""
    with torch.device("meta"):
        rebuilt = timm.create_model(arch, pretrained=False, **create_kwargs).state_dict()
    differences = [k for k in rebuilt.keys() | state.keys() if k not in rebuilt or k not in state]
    differences += [k for k in rebuilt.keys() & state.keys() if rebuilt[k].shape != state[k].shape]
    if differences:
        raise ConfigError(
            f"timm.create_model({arch!r}, **create_kwargs) does not rebuild the exported model: "
            f"{len(differences)} keys differ in name or shape, e.g. {sorted(differences)[:5]}"
        )


def _replace(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} value {value!r} is not JSON-serialisable")
