"""Prithvi (EO-2.0's ``PrithviMAE``, and 1.0) as a timm ViT for one time step.

Prithvi's encoder is a timm ViT over video: a 3-D patch embedding (``Conv3d``, kernel ``(t, p, p)``
over ``(bands, time, height, width)``) and a fixed 3-D sine-cosine position embedding whose last
quarter of channels encodes the frame (``pos_embed``, cls first, tokens frame by frame). Its blocks,
``cls_token`` and ``norm`` are timm's names (EO-2.0 under ``encoder.``). For one time step the kernel
loses its time axis (a tubelet of ``t`` frames is summed: the image repeated over it) and the
position embedding keeps the first frame's tokens, which is what Prithvi computes for a single frame.

Not kept: the time and location encodings of the EO-2.0 TL models (``temporal_embed_enc``,
``location_embed_enc``: they need acquisition dates and coordinates a timm ViT does not take), and the
MAE decoder (``decoder.*`` in EO-2.0, ``decoder_*`` and ``mask_token`` in 1.0): a transformer at its own
width whose mask token lives in the decoder's space, where geofm's masked image modelling replaces
masked patches at the encoder's input and reconstructs pixels with one linear map, so no tensor of
it has a counterpart there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from geofm.checkpoints.layouts import BackboneSource, CheckpointLayout, weights_mapping
from geofm.checkpoints.structure import VIT_HEADS
from geofm.errors import CheckpointFormatError

_KERNEL = "patch_embed.proj.weight"
# Harmonized Landsat Sentinel-2 bands Prithvi was pretrained on (B02, B03, B04, B8A/B05, B11/B06, B12/B07).
HLS_BANDS = ("blue", "green", "red", "nir08", "swir16", "swir22")
# The releases by version: EO-2.0 nests the encoder under `encoder.`, 1.0 keeps it at the top.
RELEASES = {
    "encoder.": {
        "name": "Prithvi-EO-2.0",
        "licence": "Apache-2.0",
        "publication": "https://arxiv.org/abs/2412.02732",
        "repo": "https://github.com/NASA-IMPACT/Prithvi-EO-2.0",
    },
    "": {
        "name": "Prithvi-EO-1.0 (Prithvi-100M)",
        "licence": "Apache-2.0",
        "publication": "https://arxiv.org/abs/2310.18660",
        "repo": "https://github.com/NASA-IMPACT/hls-foundation-os",
    },
}
_ENCODER_PARTS = ("patch_embed.", "cls_token", "pos_embed", "blocks.", "norm.")


class PrithviCheckpoint(CheckpointLayout):
    """A Prithvi MAE checkpoint (EO-2.0: `encoder.*` with a 3-D `patch_embed.proj` and `pos_embed`, `decoder.*`;
    1.0: the same at the top with `decoder_*`): the encoder for one time step; the MAE decoder is dropped."""

    def detect(
        self, raw: Mapping[str, Any], *, path: str | Path | None = None, teacher: bool = False
    ) -> BackboneSource | None:
        weights, _ = weights_mapping(raw)
        if weights is None:
            return None
        prefix = next(
            (
                k[: -len(_KERNEL)]
                for k, v in weights.items()
                if isinstance(k, str) and k.endswith(_KERNEL) and getattr(v, "ndim", 0) == 5
            ),
            None,
        )
        if prefix is None or prefix + "blocks.0.attn.qkv.weight" not in weights:
            return None
        encoder = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        converted = {k: v for k, v in encoder.items() if k.startswith(_ENCODER_PARTS)}
        dropped = tuple(k for k in weights if not k.startswith(prefix) or k[len(prefix) :] not in converted)
        kernel = converted[_KERNEL]
        converted[_KERNEL] = kernel.sum(2)
        notes = [
            f"Prithvi 3-D patch embedding -> 2-D for one time step (kernel {tuple(kernel.shape)} -> "
            f"{tuple(converted[_KERNEL].shape)}" + (", tubelet frames summed)" if kernel.shape[2] > 1 else ")")
        ]
        if "pos_embed" not in converted:
            raise CheckpointFormatError(f"{path or 'checkpoint'}: a Prithvi checkpoint without {prefix}pos_embed")
        converted["pos_embed"], frames = first_frame(converted["pos_embed"])
        if frames > 1:
            notes.append(f"pos_embed: the first of {frames} frames' positions kept")
        if any(k.startswith(("temporal_embed_enc", "location_embed_enc")) for k in encoder):
            notes.append("time and location encodings dropped (a timm ViT takes no dates or coordinates)")
        if any("decoder" in k for k in dropped):
            notes.append("the MAE decoder is dropped: geofm's masked image modelling has no counterpart of it")
        width = int(kernel.shape[0])
        return BackboneSource(
            "prithvi",
            converted,
            "",
            "vit",
            False,
            dropped=dropped,
            bands=HLS_BANDS if kernel.shape[1] == len(HLS_BANDS) else None,
            structure={"num_heads": VIT_HEADS[width]} if width in VIT_HEADS else {},
            notes=tuple(notes),
            release=RELEASES.get(prefix),
        )


def first_frame(pos_embed: Tensor) -> tuple[Tensor, int]:
    """The cls position and the first frame's tokens of a 3-D sine-cosine position embedding, and the frame count.

    The frame's sine-cosine takes the last quarter of the channels (Prithvi's ``get_3d_sincos_pos_embed``);
    the first frame's tokens are those whose frame part equals the first token's.
    """
    time_part = pos_embed[0, 1:, -(pos_embed.shape[-1] // 16 * 4) :]
    same = (time_part - time_part[0]).abs().amax(-1) < 1e-6
    tokens = int(same.long().cumprod(0).sum())
    return pos_embed[:, : 1 + tokens].clone(), (pos_embed.shape[1] - 1) // tokens


PRITHVI = PrithviCheckpoint()
