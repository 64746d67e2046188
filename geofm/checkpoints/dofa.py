"""DOFA (torchgeo's ``dofa_*``) as a fixed-band timm ViT for the bands it is given.

DOFA's patch embedding is a hypernetwork: each input band's central wavelength goes through a
sine-cosine embedding and a residual MLP (``patch_embed.fclayer``), and a transformer over these
band tokens (``patch_embed.weight_generator``) gives the convolution kernel of every band and one bias,
both depending on the whole set of bands. Run once for a band list (by central wavelength, from
:data:`geofm.data.bands.CENTRAL_WAVELENGTHS_UM`), it gives the ``patch_embed.proj`` of a timm ViT;
the blocks, ``cls_token``, ``pos_embed`` and ``fc_norm`` are timm's names already. DOFA mean-pools
the patch tokens through ``fc_norm`` (timm ``global_pool="avg"``), or with ``global_pool=False`` takes
the cls token after ``norm``; a release without its final norm becomes a ViT without one
(``final_norm=False``).

DOFA's convolution pads one pixel (``padding=1``), so its patches start one pixel up and left of
timm's: the timm ViT's features for an image are DOFA's for the image shifted one pixel down and
right (equal on ``F.pad(x, (1, 0, 1, 0))[..., :H, :W]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from geofm.checkpoints.layouts import BackboneSource, CheckpointLayout, weights_mapping
from geofm.checkpoints.structure import VIT_HEADS
from geofm.data.bands import RGB, UnknownBandError, canonical_bands, central_wavelengths
from geofm.errors import ConfigError

_GENERATOR = "patch_embed.weight_generator.fc_weight.weight"
_EMBED = "patch_embed."
RELEASE = {
    "name": "DOFA",
    "licence": "CC-BY-4.0",
    "publication": "https://arxiv.org/abs/2403.15356",
    "repo": "https://github.com/zhu-xlab/DOFA",
}


class DofaCheckpoint(CheckpointLayout):
    """A DOFA checkpoint (torchgeo's `dofa_*` or the DOFA release): a ViT whose patch embedding generates its kernel
    from the input bands' wavelengths (`patch_embed.weight_generator.*`, `patch_embed.fclayer.*`); read for the bands
    asked for (default red, green, blue)."""

    def detect(
        self, raw: Mapping[str, Any], *, path: str | Path | None = None, teacher: bool = False
    ) -> BackboneSource | None:
        weights, _ = weights_mapping(raw)
        if weights is None or not any(isinstance(k, str) and k.endswith(_GENERATOR) for k in weights):
            return None
        return self.for_bands(raw, None, None, path=path)

    def for_bands(
        self,
        raw: Mapping[str, Any],
        source: BackboneSource | None,
        bands: Sequence[str] | None,
        *,
        path: str | Path | None = None,
    ) -> BackboneSource:
        weights, _ = weights_mapping(raw)
        prefix = next(k[: -len(_GENERATOR)] for k in weights if isinstance(k, str) and k.endswith(_GENERATOR))
        backbone = {k[len(prefix) :]: v for k, v in weights.items() if isinstance(k, str) and k.startswith(prefix)}
        dropped = [k for k in weights if not (isinstance(k, str) and k.startswith(prefix))]
        dropped += [prefix + k for k in backbone if k.startswith(_EMBED)]
        try:
            names = canonical_bands(list(bands) if bands is not None else list(RGB))
            wavelengths = central_wavelengths(names, where="bands")
        except UnknownBandError as err:
            raise ConfigError(f"{path or 'checkpoint'}: DOFA makes its patch kernel from wavelengths: {err}") from err
        converted = {k: v for k, v in backbone.items() if not k.startswith(_EMBED)}
        converted["patch_embed.proj.weight"], converted["patch_embed.proj.bias"] = patch_kernel(backbone, wavelengths)
        width = int(converted["patch_embed.proj.weight"].shape[0])
        # DOFA pools its patch tokens (global_pool=True, fc_norm) unless it holds a final norm for its cls token
        structure: dict[str, Any] = {"global_pool": "token" if "norm.weight" in converted else "avg"}
        if width in VIT_HEADS:
            structure["num_heads"] = VIT_HEADS[width]
        notes = [
            f"DOFA patch embedding generated for {', '.join(names)} (wavelengths {', '.join(f'{w:g}' for w in wavelengths)} um)",
            "DOFA pads its patch convolution by one pixel, timm does not: features equal DOFA's on the image "
            "shifted one pixel down and right",
        ]
        if bands is None:
            notes.append("no bands named: made for red, green, blue (name them with --bands or data.bands)")
        return BackboneSource(
            "dofa",
            converted,
            "",
            "vit",
            False,
            dropped=tuple(dropped),
            bands=tuple(names),
            structure=structure,
            notes=tuple(notes),
            release=RELEASE,
        )


def patch_kernel(
    weights: Mapping[str, torch.Tensor], wavelengths: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution kernel ``(D, bands, p, p)`` and bias ``(D,)`` DOFA's hypernetwork gives these wavelengths (um).

    Runs torchgeo's :class:`~torchgeo.models.dofa.DOFAEmbedding` modules on the checkpoint's
    ``patch_embed.*`` tensors, as its forward does before the convolution.
    """
    from torchgeo.models.dofa import DOFAEmbedding, position_embedding  # imported once a DOFA file is read

    embed = {k[len(_EMBED) :]: v for k, v in weights.items() if k.startswith(_EMBED)}
    width = int(embed["weight_generator.fc_bias.weight"].shape[0])
    kernel_area = int(embed["weight_generator.fc_weight.weight"].shape[0]) // width
    patch = round(kernel_area**0.5)
    module = DOFAEmbedding(
        dynamic_embed_dim=int(embed["fclayer.w1.weight"].shape[0]), kernel_size=patch, embed_dim=width
    )
    module.load_state_dict(embed)
    with torch.no_grad():
        waves = torch.tensor(wavelengths, dtype=torch.float32)
        tokens = module.fclayer(position_embedding(module.dynamic_embed_dim, waves * 1000))
        weight, bias = module.weight_generator(tokens)
        kernel = weight.view(len(wavelengths), patch, patch, width).permute(3, 0, 1, 2) * module.scaler
        return kernel.contiguous(), bias.view(width) * module.scaler


DOFA = DofaCheckpoint()
