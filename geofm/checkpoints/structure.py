"""Architecture facts read from the shapes of a Swin (v1, v2), ViT or BEiT backbone's weights and from a GFM/SimMIM
config."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from geofm.checkpoints.layouts import SWIN_FAMILIES
from geofm.errors import CheckpointFormatError

_SWIN_BLOCK = re.compile(r"^layers\.(\d+)\.blocks\.(\d+)\.")
_VIT_BLOCK = re.compile(r"^blocks\.(\d+)\.")
SWIN_V2_WINDOW = 8  # timm's and torchvision's Swin-v2 window at 256 px
VIT_HEADS = {384: 6, 768: 12, 1024: 16, 1280: 16}
"""Attention heads of the ViT widths the field releases (small, base, large, huge), for layouts whose files say none."""


def structure_from_weights(family: str, weights: Mapping[str, Tensor]) -> tuple[dict[str, Any], list[str]]:
    """Architecture facts readable from the shapes of a backbone's tensors (Microsoft or timm names).

    Returns:
        The facts as ``timm.create_model`` kwargs (``num_heads`` None where unreadable) and notes on
        what had to be assumed.

    Raises:
        CheckpointFormatError: if a tensor the architecture is read from is missing.
    """
    kernel = weights["patch_embed.proj.weight"]
    structure: dict[str, Any] = {
        "in_chans": int(kernel.shape[1]),
        "patch_size": int(kernel.shape[-1]),
        "embed_dim": int(kernel.shape[0]),
    }
    try:
        if family in SWIN_FAMILIES:
            return _swin_structure(weights, structure)
        return _vit_structure(family, weights, structure)
    except (KeyError, ValueError) as err:
        raise CheckpointFormatError(
            f"cannot read the {family} architecture from the weights: {err!r} is missing or odd (an incomplete backbone?)"
        ) from err


def _swin_structure(weights: Mapping[str, Tensor], s: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    last_block: dict[int, int] = {}
    for key in weights:
        found = _SWIN_BLOCK.match(key)
        if found:
            stage, block = int(found.group(1)), int(found.group(2))
            last_block[stage] = max(last_block.get(stage, 0), block)
    stages = sorted(last_block)
    heads, windows = _swin_attention(weights, [f"layers.{i}.blocks.0.attn." for i in stages])
    if windows is None:
        windows = [SWIN_V2_WINDOW] * len(stages)
        notes.append(f"window_size {SWIN_V2_WINDOW} assumed: a timm Swin-v2's window is not stored in its weights")
    window = max(windows)
    s.update(
        depths=[last_block[i] + 1 for i in stages],
        num_heads=heads,
        window_size=window,
        mlp_ratio=weights["layers.0.blocks.0.mlp.fc1.weight"].shape[0] / s["embed_dim"],
        qkv_bias="layers.0.blocks.0.attn.qkv.bias" in weights or "layers.0.blocks.0.attn.q_bias" in weights,
    )
    grid = _swin_grid(weights, windows, window)
    if grid is None:
        grid = window * 2 ** (len(stages) - 1)
        notes.append(
            f"img_size {grid * s['patch_size']} assumed (window {window} in the last stage): "
            "a Swin's image size is not stored in its weights"
        )
    s["img_size"] = grid * s["patch_size"]
    return s, notes


def _swin_attention(weights: Mapping[str, Tensor], attention: list[str]) -> tuple[list[int], list[int] | None]:
    """Heads and window of each stage (keys of its first block's attention): from the relative-position
    tables of a Swin; from the temperatures (``logit_scale``) and coordinate tables of a Swin-v2, whose
    window is unknown where the coordinate tables were not saved (timm's)."""
    if attention[0] + "logit_scale" not in weights:
        tables = [weights[a + "relative_position_bias_table"] for a in attention]
        return [int(t.shape[1]) for t in tables], [(_table_side(t.shape[0]) + 1) // 2 for t in tables]
    heads = [int(weights[a + "logit_scale"].shape[0]) for a in attention]
    if attention[0] + "relative_coords_table" not in weights:
        return heads, None
    return heads, [(int(weights[a + "relative_coords_table"].shape[1]) + 1) // 2 for a in attention]


def _swin_grid(weights: Mapping[str, Tensor], windows: list[int], window: int) -> int | None:
    """Side of the first stage's patch grid, when the weights reveal it."""
    for key, value in weights.items():  # Microsoft's files keep shifted blocks' masks: (windows, N, N)
        if key.startswith("layers.0.") and key.endswith("attn_mask") and value.ndim == 3:
            return math.isqrt(int(value.shape[0])) * windows[0]
    for stage, stage_window in enumerate(windows):  # a stage smaller than the window has a clamped window
        if stage_window < window:
            return stage_window * 2**stage
    return None


def _vit_structure(family: str, weights: Mapping[str, Tensor], s: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    blocks = {int(m.group(1)) for m in map(_VIT_BLOCK.match, weights) if m}
    s.update(
        depth=max(blocks) + 1,
        mlp_ratio=weights["blocks.0.mlp.fc1.weight"].shape[0] / s["embed_dim"],
        num_heads=None,
        global_pool="avg" if "fc_norm.weight" in weights else "token",
    )
    if family == "vit":  # a ViT released without its last norm (DOFA's MAE encoder)
        s["final_norm"] = "norm.weight" in weights or "fc_norm.weight" in weights
    if family == "beit":
        shared = weights.get("rel_pos_bias.relative_position_bias_table")
        table = weights.get("blocks.0.attn.relative_position_bias_table", shared)
        s.update(
            qkv_bias="blocks.0.attn.q_bias" in weights,
            init_values=0.1 if "blocks.0.gamma_1" in weights else None,
            use_abs_pos_emb="pos_embed" in weights,
            use_rel_pos_bias="blocks.0.attn.relative_position_bias_table" in weights,
            use_shared_rel_pos_bias=shared is not None,
        )
        if table is not None:
            s["num_heads"] = int(table.shape[1])
        grid = (_table_side(table.shape[0]) + 1) // 2 if table is not None else None
        prefix = 1
    else:
        s.update(  # timm's names, or BEiT/SimMIM's (q_bias and v_bias, gamma_1 and gamma_2)
            qkv_bias="blocks.0.attn.qkv.bias" in weights or "blocks.0.attn.q_bias" in weights,
            class_token="cls_token" in weights,
            reg_tokens=int(weights["reg_token"].shape[1]) if "reg_token" in weights else 0,
            init_values=1e-5 if "blocks.0.ls1.gamma" in weights or "blocks.0.gamma_1" in weights else None,
            pre_norm="norm_pre.weight" in weights,
            no_embed_class=False,
        )
        grid, prefix = None, int(s["class_token"]) + s["reg_tokens"]
    pos_embed = weights.get("pos_embed")
    if pos_embed is not None:
        positions = int(pos_embed.shape[1])
        side = math.isqrt(positions - prefix)
        if side * side == positions - prefix:
            grid = side
        elif family == "vit" and math.isqrt(positions) ** 2 == positions:
            grid, s["no_embed_class"] = math.isqrt(positions), True
    if grid is None:
        grid = 224 // s["patch_size"]
        notes.append(f"img_size {grid * s['patch_size']} assumed: no position table tells the image size")
    s["img_size"] = grid * s["patch_size"]
    return s, notes


def _table_side(rows: int) -> int:
    side = math.isqrt(rows)
    return side if side * side == rows else math.isqrt(rows - 3)


def apply_source_config(family: str, config: Mapping[str, Any], s: dict[str, Any], notes: list[str]) -> bool:
    """Fill in from a GFM/SimMIM config what the weights cannot tell (image size, window, ViT heads)."""
    model = config.get("MODEL") or {}
    kind = str(model.get("TYPE", "")).lower()
    section = model.get("SWIN") if family == "swin" else model.get("VIT")
    if (family == "swin" and kind.startswith("vit")) or (family != "swin" and kind.startswith("swin")):
        notes.append(f"checkpoint config says MODEL.TYPE {kind!r} but the weights hold a {family}: config not used")
        return False
    used = False
    img = (config.get("DATA") or {}).get("IMG_SIZE")
    if isinstance(img, int):
        s["img_size"], used = img, True
        notes[:] = [n for n in notes if not n.startswith("img_size")]
    if isinstance(section, Mapping):
        if family == "swin" and isinstance(section.get("WINDOW_SIZE"), int):
            s["window_size"], used = section["WINDOW_SIZE"], True
        if family != "swin" and s.get("num_heads") is None and isinstance(section.get("NUM_HEADS"), int):
            s["num_heads"], used = section["NUM_HEADS"], True
        key = "NUM_HEADS" if family == "swin" else "EMBED_DIM"
        recorded = section.get(key)
        readable = s["num_heads"] if family == "swin" else s["embed_dim"]
        if recorded is not None and _listify(recorded) != _listify(readable):
            notes.append(
                f"checkpoint config MODEL.{'SWIN' if family == 'swin' else 'VIT'}.{key} {recorded} "
                f"differs from the weights ({readable}): the weights win"
            )
    return used


def _listify(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value
