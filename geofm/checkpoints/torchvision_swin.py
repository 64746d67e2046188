"""torchvision's Swin (``swin_t``... and ``swin_v2_t``/``_s``/``_b``), as Satlas releases it, in timm's names.

torchvision keeps a Swin in one ``features`` sequence: ``features.0`` the patch embedding (convolution
and norm), ``features.{2s+1}`` the blocks of stage ``s``, ``features.{2s+2}`` the patch merging that
starts stage ``s+1``; then ``norm`` and ``head``. Satlas wraps it (``backbone.backbone.features...``)
next to its FPN and task heads, which are dropped. The blocks compute what timm's do: the same
residual (post-)norms, merging order and, for v2, continuous position bias and cosine attention; the
v2 ``qkv.bias`` holds a k bias that torchvision zeroes at every forward, and timm keeps only
``q_bias`` and ``v_bias``. torchvision and timm differ where a stage's feature map is not a multiple
of the window: torchvision pads it with zeros that take part in attention, timm shrinks the window
to a smaller map. Image sizes whose every stage is a multiple of the window (256 px for window 8)
give the same features.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from geofm.checkpoints.layouts import BackboneSource, CheckpointLayout, weights_mapping
from geofm.data.bands import BAND_ID_TABLES

_PATCH = "features.0.0.weight"
_BLOCK = re.compile(r"^features\.(\d+)\.(\d+)\.(.+)$")
_MERGING = re.compile(r"^features\.(\d+)\.(reduction|norm)\.(.+)$")
_RENAMES = (("mlp.0.", "mlp.fc1."), ("mlp.3.", "mlp.fc2."))
SATLAS = {
    "name": "SatlasPretrain Swin-v2",
    "licence": "ODC-BY-1.0 (Satlas' weights; torchvision's own ImageNet swin_v2_* weights: BSD-3-Clause)",
    "publication": "https://arxiv.org/abs/2211.15660",
    "repo": "https://github.com/allenai/satlas",
}
_S2 = BAND_ID_TABLES["sentinel2"]
# Satlas' input bands by count (torchgeo's Swin_V2_B_Weights meta): Sentinel-2 multispectral (TCI first),
# Landsat 8/9 B01-B11, Sentinel-1; 3 bands are red, green, blue as for any unnamed RGB checkpoint.
SATLAS_BANDS = {
    9: tuple(_S2[b] for b in ("B04", "B03", "B02", "B05", "B06", "B07", "B08", "B11", "B12")),
    11: tuple(BAND_ID_TABLES["landsat8"].values()),
    2: ("vh", "vv"),
}
_BUFFERS = ("relative_position_index",)  # rebuilt by timm; relative_coords_table stays to tell the window


class TorchvisionSwinCheckpoint(CheckpointLayout):
    """A torchvision Swin or Swin-v2 state dict (`features.N...`, `norm`, `head`), bare or under a prefix, as in
    Satlas releases (`backbone.backbone.features...`, next to FPN and heads, dropped)."""

    def detect(
        self, raw: Mapping[str, Any], *, path: str | Path | None = None, teacher: bool = False
    ) -> BackboneSource | None:
        weights, _ = weights_mapping(raw)
        if weights is None:
            return None
        prefix = next((k[: -len(_PATCH)] for k in weights if isinstance(k, str) and k.endswith(_PATCH)), None)
        if prefix is None or prefix + "features.1.0.attn.qkv.weight" not in weights:
            return None
        v2 = any(isinstance(k, str) and k.startswith(prefix) and k.endswith(".attn.logit_scale") for k in weights)
        renamed, dropped = {}, []
        for key, value in weights.items():
            name = timm_name(key[len(prefix) :]) if isinstance(key, str) and key.startswith(prefix) else None
            if name is None:
                dropped.append(key)
            elif v2 and name.endswith(".attn.qkv.bias"):
                q, _, v = value.chunk(3)
                renamed[name.replace("qkv.bias", "q_bias")] = q
                renamed[name.replace("qkv.bias", "v_bias")] = v
            else:
                renamed[name] = value
        notes = [
            "torchvision Swin names -> timm" + (": attn.qkv.bias -> attn.q_bias, attn.v_bias (k bias 0)" if v2 else "")
        ]
        bands = SATLAS_BANDS.get(int(renamed["patch_embed.proj.weight"].shape[1])) if v2 else None
        if bands:
            notes.append(f"bands taken as Satlas' for {len(bands)}-band inputs: {', '.join(bands)}")
        return BackboneSource(
            "torchvision_swin",
            renamed,
            "",
            "swinv2" if v2 else "swin",
            False,
            dropped=tuple(dropped),
            bands=bands,
            notes=tuple(notes),
            release=SATLAS if v2 else None,
        )


def timm_name(key: str) -> str | None:
    """timm's name of a torchvision Swin key (None: not a backbone tensor timm holds)."""
    if key.startswith("features.0.0."):
        return "patch_embed.proj." + key[len("features.0.0.") :]
    if key.startswith("features.0.2."):
        return "patch_embed.norm." + key[len("features.0.2.") :]
    if key.startswith(("norm.", "head.")):
        return key.replace("head.", "head.fc.", 1)
    merging = _MERGING.match(key)
    if merging:
        index, module, rest = merging.groups()
        return f"layers.{int(index) // 2}.downsample.{module}.{rest}"
    block = _BLOCK.match(key)
    if block is None or int(block.group(1)) % 2 == 0:
        return None
    index, number, rest = block.groups()
    if rest.rsplit(".", 1)[-1] in _BUFFERS:
        return None
    for old, new in _RENAMES:
        rest = rest.replace(old, new, 1) if rest.startswith(old) else rest
    return f"layers.{int(index) // 2}.blocks.{number}.{rest}"


TORCHVISION_SWIN = TorchvisionSwinCheckpoint()
