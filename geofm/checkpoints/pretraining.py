"""The modules of a pretraining checkpoint beyond its backbone: mask token, pixel decoder, projector.

GFM and SimMIM files and geofm's own training checkpoints hold, next to the student backbone, what
continual pretraining needs to go on where it stopped: the mask token that replaces masked patches,
the pixel decoder (a 1x1 convolution to ``stride**2 * bands`` channels followed by a pixel shuffle)
and, for GFM, the linear projector of student features onto the teacher's width. They are found in
each layout (the mask token next to the backbone keys, ``encoder.mask_token``, in GFM and SimMIM
files, at the top of geofm's training module; decoder and projector at the top in all) and converted to geofm's training-module names (``mask_token``,
``decoder.0.*``, ``projector.*``):

* the mask token, ``(1, 1, C)`` in GFM/SimMIM files, becomes geofm's ``(C,)``;
* the decoder's output channels follow the band mapping of the patch embedding: each model band
  gets the ``stride**2`` output channels (and biases) of the checkpoint band of the same name, and
  bands the checkpoint lacks keep their fresh initialisation;
* the projector is taken when its shape fits (the same student tap and teacher width).

GFM projects the student's average-pooled features and geofm each token before pooling; a linear
map commutes with the average, so the same weights give the same pooled distillation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from geofm.checkpoints.layouts import BackboneSource
from geofm.checkpoints.patch_bands import PATCH_EMBED_WEIGHT
from geofm.checkpoints.report import LoadReport

MASK_TOKEN = "mask_token"
DECODER = ("decoder.0.weight", "decoder.0.bias")
PROJECTOR = ("projector.weight", "projector.bias")


@dataclass
class PretrainingReport:
    """What a pretraining module received from a checkpoint.

    Attributes:
        backbone: the load report of the encoder.
        restored: the modules besides the encoder taken from the checkpoint, with how they were adapted.
        fresh: the modules (or decoder bands) left at their fresh initialisation, and why.
    """

    backbone: LoadReport
    restored: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [str(self.backbone)]
        if self.restored:
            lines.append(f"  restored with the encoder: {'; '.join(self.restored)}")
        if self.fresh:
            lines.append(f"  starting fresh: {'; '.join(self.fresh)}")
        return "\n".join(lines)


def pretraining_state(
    source: BackboneSource,
    target: Mapping[str, Tensor],
    bands: Sequence[str],
    band_sources: Sequence[int | None] | None,
) -> tuple[dict[str, Tensor], list[str], PretrainingReport]:
    """The mask token, decoder and projector of a checkpoint, in the names and shapes of ``target``.

    Args:
        source: where the backbone sits in the checkpoint (:func:`~geofm.checkpoints.layouts.locate_backbone`).
        target: the pretraining module's state dict (``mask_token``, ``decoder.0.*``, ``projector.*`` if any).
        bands: the model's input bands, which its decoder reconstructs.
        band_sources: for each model band, the checkpoint band it corresponds to (None: not in the
            checkpoint); None when the bands are the checkpoint's, in order.

    Returns:
        The tensors to load (``target``'s names), the checkpoint keys they came from, and a report
        (its ``backbone`` is left for the caller to set).
    """
    report = PretrainingReport(LoadReport(layout=source.layout))
    state: dict[str, Tensor] = {}
    used: list[str] = []
    weights = source.weights

    token_key = next((k for k in (source.prefix + MASK_TOKEN, MASK_TOKEN) if k in weights), None)
    _restore_mask_token(weights, token_key, target, state, used, report)

    have = int(weights[source.prefix + PATCH_EMBED_WEIGHT].shape[1])
    sources = list(band_sources) if band_sources is not None else list(range(have))
    _restore_decoder(weights, target, bands, sources, have, state, used, report)

    if PROJECTOR[0] in target:
        _restore_projector(weights, target, state, used, report)
    return state, used, report


def _restore_mask_token(
    weights: Mapping[str, Tensor],
    key: str | None,
    target: Mapping[str, Tensor],
    state: dict[str, Tensor],
    used: list[str],
    report: PretrainingReport,
) -> None:
    want = target[MASK_TOKEN]
    if key is None:
        report.fresh.append("mask_token (not in the checkpoint)")
        return
    token = weights[key]
    if token.numel() != want.numel():
        report.fresh.append(f"mask_token (the checkpoint's has shape {_shape(token)}, the model's {_shape(want)})")
        return
    state[MASK_TOKEN] = token.reshape(want.shape)
    used.append(key)
    reshaped = f", {_shape(token)} -> {_shape(want)}" if token.shape != want.shape else ""
    report.restored.append(f"mask_token (from {key}{reshaped})")


def _restore_decoder(
    weights: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    bands: Sequence[str],
    sources: list[int | None],
    have: int,
    state: dict[str, Tensor],
    used: list[str],
    report: PretrainingReport,
) -> None:
    """The decoder's output channels, band by band: ``stride**2`` consecutive channels per band (pixel shuffle)."""
    weight_key = DECODER[0]
    if weight_key not in weights:
        report.fresh.append("decoder (not in the checkpoint)")
        return
    weight, want = weights[weight_key], target[weight_key]
    area = want.shape[0] // len(bands)  # stride**2 outputs per band
    if weight.shape[1:] != want.shape[1:] or weight.shape[0] != area * have:
        report.fresh.append(
            f"decoder (the checkpoint's maps {weight.shape[1]} channels to {weight.shape[0]} outputs for its {have} "
            f"bands, the model's {want.shape[1]} channels to {area} outputs per band: another encoder width or stride)"
        )
        return
    for key in DECODER:
        fresh = target[key].detach().to("cpu", weights[key].dtype, copy=True)
        for band, source in enumerate(sources):
            if source is not None:
                fresh[band * area : (band + 1) * area] = weights[key][source * area : (source + 1) * area]
        state[key] = fresh
        used.append(key)
    missing = [band for band, source in zip(bands, sources, strict=True) if source is None]
    kept = [band for band, source in zip(bands, sources, strict=True) if source is not None]
    report.restored.append(f"decoder (output bands {', '.join(kept)})")
    if missing:
        report.fresh.append(f"decoder output bands {', '.join(missing)} (not in the checkpoint)")


def _restore_projector(
    weights: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    state: dict[str, Tensor],
    used: list[str],
    report: PretrainingReport,
) -> None:
    if not all(key in weights for key in PROJECTOR):
        report.fresh.append("projector (not in the checkpoint)")
        return
    weight, want = weights[PROJECTOR[0]], target[PROJECTOR[0]]
    if weight.shape != want.shape or weights[PROJECTOR[1]].shape != target[PROJECTOR[1]].shape:
        report.fresh.append(
            f"projector (the checkpoint's maps {weight.shape[1]} to {weight.shape[0]} channels, the model's "
            f"{want.shape[1]} to {want.shape[0]}: another student tap or teacher width)"
        )
        return
    for key in PROJECTOR:
        state[key] = weights[key]
        used.append(key)
    report.restored.append("projector")


def _shape(tensor: Tensor) -> str:
    return "x".join(str(n) for n in tensor.shape)
