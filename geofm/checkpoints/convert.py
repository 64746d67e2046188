"""Turning any known checkpoint layout into the state dict of a timm backbone.

The renaming of Microsoft's Swin keys, the resizing of relative-position-bias tables to the model's
window size, the resampling of ViT position embeddings and patch kernels are timm's own
``checkpoint_filter_fn`` (of ``swin_transformer``, ``vision_transformer`` or ``beit``); this module
picks the backbone out of the checkpoint, drops what a headless backbone does not hold, renames a
ViT stored in BEiT/SimMIM names into timm's ``VisionTransformer`` names, and places the
checkpoint's patch-embedding kernels into the bands of the model (:mod:`geofm.checkpoints.patch_bands`);
what happened to each tensor is a :class:`~geofm.checkpoints.report.LoadReport`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from timm.models import beit, swin_transformer, swin_transformer_v2, vision_transformer
from torch import Tensor, nn

from geofm.checkpoints.io import load_checkpoint_file, resolve_checkpoint_path
from geofm.checkpoints.layouts import (
    EXPORT_SIDECAR,
    BackboneSource,
    locate_backbone,
    read_export_sidecar,
    relative_position_bias,
)
from geofm.checkpoints.patch_bands import PATCH_EMBED_WEIGHT, map_bands, place_rgb
from geofm.checkpoints.report import LoadReport, summarise_keys
from geofm.errors import CheckpointFormatError

REL_POS_TABLE = "relative_position_bias_table"
BACKBONE_KWARGS_OF_FIELDS = ("num_classes", "in_chans", "img_size", "window_size")
"""The ``timm.create_model`` kwargs a config sets through fields of their own, not ``timm_kwargs``."""
# Entries of Swin/ViT checkpoints that a headless timm backbone never holds: buffers rebuilt at
# construction (Microsoft's and torchvision's checkpoints store them) and SimMIM's mask token.
NON_BACKBONE_NAMES = ("relative_position_index", "relative_coords_table", "attn_mask", "mask_token")


# timm's model class and checkpoint filter of each backbone family.
FAMILY_CLASSES = {
    "swin": (swin_transformer.SwinTransformer, swin_transformer.checkpoint_filter_fn),
    "swinv2": (swin_transformer_v2.SwinTransformerV2, swin_transformer_v2.checkpoint_filter_fn),
    "vit": (vision_transformer.VisionTransformer, vision_transformer.checkpoint_filter_fn),
    "beit": (beit.Beit, beit.checkpoint_filter_fn),
}


def model_family(model: nn.Module) -> str:
    """``"swin"``, ``"swinv2"``, ``"vit"`` or ``"beit"`` for a timm Swin, Swin-v2, ViT or BEiT model."""
    for family, (cls, _) in FAMILY_CLASSES.items():
        if isinstance(model, cls):
            return family
    raise TypeError(f"expected a timm SwinTransformer(V2), VisionTransformer or Beit, got {type(model).__name__}")


def backbone_state_dict(
    raw: dict[str, Any],
    model: nn.Module,
    *,
    rgb_positions: Sequence[int] | None = None,
    band_sources: Sequence[int | None] | None = None,
    path: str | Path | None = None,
    teacher: bool = False,
    source: BackboneSource | None = None,
) -> tuple[dict[str, Tensor], LoadReport]:
    """Extract the backbone from a loaded checkpoint in any known layout, in ``model``'s timm names.

    Args:
        raw: the mapping returned by :func:`~geofm.checkpoints.io.load_checkpoint_file`.
        model: the timm Swin/ViT/BEiT backbone the weights are meant for; its shapes (window size,
            image size, band count) decide the conversion. It is not modified.
        rgb_positions: the model's band index receiving the checkpoint's red, green and blue
            kernels; required when a 3-band checkpoint meets a model with another band count.
            The model's other bands keep their current (fresh) initialisation.
        band_sources: instead of ``rgb_positions``, for each model band the index of the checkpoint
            band whose kernel it receives, or None to keep the model's initialisation (bands matched
            by name: reordered, dropped or added).
        path: the file ``raw`` came from: recognises an export by its sidecar, names the file in errors.
        teacher: take a GFM file's teacher (``teacher.*``) rather than its student.
        source: where the backbone sits in ``raw``, made for the model's bands
            (:attr:`~geofm.checkpoints.facts.CheckpointFacts.source`); default: located in ``raw``.

    Returns:
        The converted state dict (the model's keys plus any ``unexpected`` ones) and a report.

    Raises:
        CheckpointFormatError: unknown layout, a Swin checkpoint for a ViT (or the reverse), a ViT
            with relative position bias for timm's VisionTransformer, a band count that cannot be
            adapted, or tensors whose shapes do not fit the model.
        ConfigError: if ``rgb_positions`` is needed but missing or invalid.
    """
    where = f"{path}: " if path else ""
    source = source or locate_backbone(raw, path=path, teacher=teacher)
    family = model_family(model)
    _check_family(source, family, model, where)
    target = model.state_dict()
    report = LoadReport(layout=source.layout, dropped=source.other_keys(), path=str(path) if path else None)
    report.adapted += source.notes

    state: dict[str, Tensor] = {}
    for key in source.backbone_keys():
        name = key[len(source.prefix) :]
        if _belongs_to_backbone(name, target):
            state[name] = source.weights[key]
        else:
            report.dropped.append(key)

    if source.microsoft_names:
        swin = "Swin-v2" if family == "swinv2" else "Swin"
        report.adapted.append(f"Microsoft {swin} names -> timm: layers.N.downsample moved to layers.N+1.downsample")
    filter_options = {}
    if family == "vit" and source.beit_names:
        state = _fuse_qv_biases(state)
        filter_options["adapt_layer_scale"] = True  # timm renames gamma_1/gamma_2 to ls1.gamma/ls2.gamma
        report.adapted.append(
            "BEiT/SimMIM ViT names -> timm VisionTransformer: attn.q_bias, attn.v_bias -> attn.qkv.bias "
            "(k bias 0), gamma_1/gamma_2 -> ls1.gamma/ls2.gamma"
        )
    # timm's filters resize each relative-position table to its block in the model: tables of blocks the
    # model lacks go around them, to be reported as unexpected.
    modules = dict(model.named_modules())
    outside = {k: v for k, v in state.items() if k.endswith(REL_POS_TABLE) and k.rpartition(".")[0] not in modules}
    converted = FAMILY_CLASSES[family][1]({k: v for k, v in state.items() if k not in outside}, model, **filter_options)
    converted.update(outside)
    report.adapted += _resize_notes(state, converted)

    _check_shapes(converted, target, source, model, path, where)
    if band_sources is not None:
        map_bands(converted, target, band_sources, report, where)
    else:
        place_rgb(converted, target, rgb_positions, report, where)
    report.used = [k for k in converted if k in target]
    report.missing = [k for k in target if k not in converted]
    report.unexpected = [k for k in converted if k not in target]
    return converted, report


def _check_shapes(
    converted: dict[str, Tensor],
    target: dict[str, Tensor],
    source: BackboneSource,
    model: nn.Module,
    path: str | Path | None,
    where: str,
) -> None:
    """Refuse tensors of another shape than the model's (a patch kernel's band count is adapted afterwards).

    Raises:
        CheckpointFormatError: listing the first mismatches; for an export, with the ``timm_kwargs``
            its sidecar builds it with.
    """

    def fitted(key: str, shape: torch.Size) -> tuple[int, ...]:
        return (shape[0], *shape[2:]) if key == PATCH_EMBED_WEIGHT else tuple(shape)

    mismatched = [
        f"{k} {tuple(v.shape)} vs model {tuple(target[k].shape)}"
        for k, v in converted.items()
        if k in target and fitted(k, v.shape) != fitted(k, target[k].shape)
    ]
    if not mismatched:
        return
    recorded = ""
    if source.layout == "geofm_export" and path is not None:
        sidecar = read_export_sidecar(path)
        kwargs = {k: v for k, v in sidecar["timm_kwargs"].items() if k not in BACKBONE_KWARGS_OF_FIELDS}
        recorded = f" its {EXPORT_SIDECAR} builds {sidecar['arch']} with timm_kwargs {json.dumps(kwargs)}"
    raise CheckpointFormatError(
        f"{where}{len(mismatched)} {source.layout} tensors do not fit {type(model).__name__} "
        f"(another architecture size?{recorded}): {'; '.join(mismatched[:5])}" + (" ..." if len(mismatched) > 5 else "")
    )


def _check_family(source: BackboneSource, family: str, model: nn.Module, where: str) -> None:
    """Refuse a backbone of another family; a ViT in BEiT names also fits timm's Beit."""
    if source.family == family or (source.beit_names and (source.family, family) == ("vit", "beit")):
        return
    if (source.family, family) == ("beit", "vit"):
        raise CheckpointFormatError(f"{where}{_relative_position_refusal(source)}")
    raise CheckpointFormatError(
        f"{where}the checkpoint holds a {source.family} backbone, the model is a {family} ({type(model).__name__})"
    )


def _relative_position_refusal(source: BackboneSource) -> str:
    """Why a ViT with relative position bias cannot become a timm VisionTransformer, and what can."""
    shared = relative_position_bias(source.weights, source.prefix) == "shared"
    held = (
        f"one table shared by all blocks, {source.prefix}rel_pos_bias.relative_position_bias_table "
        "(SimMIM's MODEL.VIT.USE_SHARED_RPB, as in its released ViT pretraining checkpoints)"
        if shared
        else f"a table per block, {source.prefix}blocks.N.attn.relative_position_bias_table "
        "(SimMIM's MODEL.VIT.USE_RPB, as in its finetuning checkpoints; BEiT)"
    )
    return (
        f"this ViT adds relative position bias to its attention, {held}; timm's VisionTransformer (vit_*, the "
        "ViT that geofm pretrains, finetunes and distils from) has no place for it. geofm models take SimMIM/BEiT "
        "ViTs with absolute position embeddings only (SimMIM: MODEL.VIT.USE_APE True, USE_RPB False, "
        "USE_SHARED_RPB False). This file converts to timm's Beit for use with timm: "
        "geofm checkpoint convert FILE OUT_DIR"
    )


def _fuse_qv_biases(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """BEiT/SimMIM attention biases as one ``qkv.bias``: q bias, zero k bias (BEiT has none), v bias."""
    fused: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.endswith(".attn.q_bias"):
            stem = key[: -len("q_bias")]
            fused[stem + "qkv.bias"] = torch.cat([value, torch.zeros_like(value), state[stem + "v_bias"]])
        elif not key.endswith(".attn.v_bias"):
            fused[key] = value
    return fused


def load_backbone_weights(
    model: nn.Module,
    path: str | Path,
    *,
    rgb_positions: Sequence[int] | None = None,
    band_sources: Sequence[int | None] | None = None,
    strict: bool = True,
) -> LoadReport:
    """Load a checkpoint file in any known layout into a timm backbone, in place.

    Args:
        model: a timm Swin/ViT/BEiT backbone (e.g. from :func:`geofm.models.backbones.create_backbone`).
        path: a weights file, or a folder understood by :func:`~geofm.checkpoints.io.resolve_checkpoint_path`.
        rgb_positions, band_sources: see :func:`backbone_state_dict`.
        strict: raise when the model has keys the checkpoint lacks, or the reverse.

    Raises:
        CheckpointNotFoundError: if the file is missing.
        CheckpointFormatError: unknown or unsafe file, or (with ``strict``) keys that do not match.
    """
    resolved = resolve_checkpoint_path(path)
    raw = load_checkpoint_file(resolved)
    state, report = backbone_state_dict(
        raw, model, rgb_positions=rgb_positions, band_sources=band_sources, path=resolved
    )
    apply_state_dict(model, state, report, strict=strict)
    return report


def apply_state_dict(model: nn.Module, state: dict[str, Tensor], report: LoadReport, *, strict: bool = True) -> None:
    """Load the converted ``state`` of :func:`backbone_state_dict` into ``model``, in place.

    Raises:
        CheckpointFormatError: with ``strict``, if the model has keys the checkpoint lacks, or the
            reverse; the model is then left unchanged.
    """
    if strict and (report.missing or report.unexpected):
        raise CheckpointFormatError(
            f"{report.path or 'checkpoint'}: the {report.layout} checkpoint does not fit {type(model).__name__}: "
            f"missing {len(report.missing)} [{summarise_keys(report.missing)}], "
            f"unexpected {len(report.unexpected)} [{summarise_keys(report.unexpected)}]"
        )
    model.load_state_dict({k: state[k] for k in report.used}, strict=False)


def _belongs_to_backbone(name: str, target: dict[str, Tensor]) -> bool:
    if name.rsplit(".", 1)[-1] in NON_BACKBONE_NAMES:
        return False
    # a classifier of a model trained with classes belongs to a backbone only when that has a head too
    return not name.startswith("head.") or any(k.startswith("head.") for k in target)


def _resize_notes(before: dict[str, Tensor], after: dict[str, Tensor]) -> list[str]:
    """Describe tensors timm's filter resized: bias tables, position embeddings, patch kernels.

    These keys are the same in Microsoft's and timm's names, so ``before`` and ``after`` line up.
    """
    notes = []
    for key, new in after.items():
        old = before.get(key)
        if old is None or old.shape == new.shape:
            continue
        if key.endswith(REL_POS_TABLE):
            s, t = _table_side(old.shape[0]), _table_side(new.shape[0])
            notes.append(f"{key}: {s}x{s} -> {t}x{t} table (window {(s + 1) // 2} -> {(t + 1) // 2})")
        elif key == "pos_embed":
            notes.append(f"pos_embed: {old.shape[1]} -> {new.shape[1]} positions")
        elif key == PATCH_EMBED_WEIGHT and old.ndim == new.ndim == 4:
            notes.append(f"{key}: kernel {old.shape[-2]}x{old.shape[-1]} -> {new.shape[-2]}x{new.shape[-1]}")
    return notes


def _table_side(rows: int) -> int:
    """Side of a relative-position table: (2w-1)^2 rows (Swin), or (2w-1)^2 + 3 (BEiT, cls-token entries)."""
    side = math.isqrt(rows)
    return side if side * side == rows else math.isqrt(rows - 3)
