"""Which checkpoint layout a loaded file is in, told from its keys alone.

The layouts are the entries of :data:`CHECKPOINT_LAYOUTS` (``geofm list checkpoint-layouts``);
each entry's docstring says what its files hold. :func:`locate_backbone` tells the built-in
layouts apart by one decision tree over the keys, in a fixed order (a geofm training file's
``module``, then GFM and SimMIM pretraining files by their ``encoder.*`` next to ``teacher.*`` or
``decoder.*``, then a bare backbone by its names and the training state beside it); a plug-in's
layout (entry-point group ``geofm.checkpoint_layouts``) is tried after them, by its
:meth:`CheckpointLayout.detect`.

Backbone families: ``swin`` (timm's ``SwinTransformer``), ``swinv2`` (timm's ``SwinTransformerV2``), ``vit`` (timm's ``VisionTransformer``)
and ``beit`` (timm's ``Beit``: a ViT with relative position bias, per block or one table shared by
all blocks). SimMIM's and BEiT's ViT code names a ViT's weights its own way (``q_bias``/``v_bias``
next to a bias-free ``qkv``, ``gamma_1``/``gamma_2`` layer scales): such a ViT without relative
position bias is a ``vit`` in BEiT names (:attr:`BackboneSource.beit_names`), with it a ``beit``.

A GFM file holds two backbones, the student (``encoder.*``) and its teacher (``teacher.*``); the
other layouts one. ``locate_backbone(raw, teacher=True)`` picks the teacher of a GFM file.

The released models of other code bases (torchvision's Swin as in Satlas, DOFA, Prithvi) are
layouts of their own modules (:mod:`~geofm.checkpoints.torchvision_swin`, :mod:`~geofm.checkpoints.dofa`,
:mod:`~geofm.checkpoints.prithvi`): their :meth:`CheckpointLayout.detect` renames the backbone into
timm's names, so everything downstream reads a timm backbone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from geofm.errors import CheckpointFormatError, CheckpointNotFoundError, ConfigError
from geofm.models.backbones import backbone_config_fields
from geofm.registry import Registry

EXPORT_FORMAT = "geofm-backbone/1"
EXPORT_SIDECAR = "backbone.json"  # next to backbone.safetensors

# Keys identifying a backbone state dict, and the one that tells Microsoft's Swin names from timm's:
# Microsoft's stage 0 ends with a patch merging, timm's stage 0 has none (timm tests the same key).
_PATCH_EMBED = "patch_embed.proj.weight"
_MICROSOFT_SWIN = "layers.0.downsample.reduction.weight"
# Key endings of a ViT in BEiT/SimMIM names (never in timm's VisionTransformer): q/v biases, layer scales.
_BEIT_NAMES = (".attn.q_bias", ".gamma_1")
# Relative position bias of a ViT: a table per block, or one shared by all blocks.
_BLOCK_REL_POS = ".attn.relative_position_bias_table"
_SHARED_REL_POS = "rel_pos_bias.relative_position_bias_table"
# Key ending of Swin-v2's attention (learned temperature), which Swin v1 lacks.
_SWIN_V2 = ".attn.logit_scale"
SWIN_FAMILIES = ("swin", "swinv2")
# Keys a training script stores next to the weights (SimMIM/Swin `save_checkpoint`).
_TRAINING_STATE = ("optimizer", "lr_scheduler", "epoch", "config", "max_accuracy")


@dataclass(frozen=True)
class BackboneSource:
    """Where the backbone sits inside a loaded checkpoint.

    Attributes:
        layout: a name of :data:`CHECKPOINT_LAYOUTS`.
        weights: the mapping holding the backbone keys (maybe next to other modules' keys).
        prefix: prefix of the backbone keys in ``weights`` (``"encoder."`` or ``""``).
        family: ``"swin"``, ``"swinv2"``, ``"vit"`` or ``"beit"``.
        microsoft_names: the keys follow Microsoft's Swin names rather than timm's.
        beit_names: a ViT's keys follow BEiT/SimMIM names (``q_bias``/``v_bias``, ``gamma_1``/``gamma_2``).
        dropped: keys of the file left out of ``weights`` by a layout that renamed the backbone.
        bands: the band names of the patch embedding, where the layout defines them.
        structure: architecture facts the layout knows and the weights do not tell (a ViT's ``num_heads``...).
        notes: what the layout assumed, adapted or left out on the way (a load report's ``adapted``).
        release: the released model the file is (``name``, ``licence``, ``publication``, ``repo``), where
            the layout tells it; its licence travels into exports and their model card.
    """

    layout: str
    weights: Mapping[str, Any]
    prefix: str
    family: str
    microsoft_names: bool
    beit_names: bool = False
    dropped: tuple[str, ...] = ()
    bands: tuple[str, ...] | None = None
    structure: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    release: Mapping[str, str] | None = None

    def backbone_keys(self) -> list[str]:
        return [k for k in self.weights if k.startswith(self.prefix)]

    def other_keys(self) -> list[str]:
        return [*self.dropped, *(k for k in self.weights if not k.startswith(self.prefix))]


class CheckpointLayout:
    """A layout of checkpoint files: what they hold, and for a plug-in's layout how to find the backbone in one."""

    def detect(
        self, raw: Mapping[str, Any], *, path: str | Path | None = None, teacher: bool = False
    ) -> BackboneSource | None:
        """Where the backbone sits in ``raw`` if it is in this layout, else None (as :func:`locate_backbone`).

        The built-in layouts return None: :func:`locate_backbone` tells them apart before it asks the others.
        """
        return None

    def for_bands(
        self,
        raw: Mapping[str, Any],
        source: BackboneSource,
        bands: Sequence[str] | None,
        *,
        path: str | Path | None = None,
    ) -> BackboneSource:
        """The backbone of ``raw`` (found as ``source``) made for the input ``bands`` (None: none asked
        for): ``source`` itself where the patch embedding has fixed bands; a wavelength-conditioned
        layout (DOFA) makes its patch kernel here."""
        return source


class TimmCheckpoint(CheckpointLayout):
    """A timm Swin/ViT/BEiT state dict, bare or under `state_dict`/`model`, possibly with a classifier `head`."""


class MicrosoftSwinCheckpoint(CheckpointLayout):
    """A Swin state dict in Microsoft's names (`layers.N.downsample` ends stage N), bare or under `model`, as in the
    official ImageNet releases."""


class GfmCheckpoint(CheckpointLayout):
    """A GFM pretraining checkpoint: `model` holds `encoder.*` (the student Swin in Microsoft's names, with
    `mask_token`), `teacher.*` (the frozen teacher Swin), `decoder.*` and `projector.*`."""


class SimmimCheckpoint(CheckpointLayout):
    """A SimMIM checkpoint, Swin or ViT: pretraining (`model` holds `encoder.*` with `mask_token`, and `decoder.*`)
    or finetuning (`model` holds a Microsoft Swin or SimMIM's BEiT-style ViT, next to the training state)."""


class GeofmTrainCheckpoint(CheckpointLayout):
    """A geofm DeepSpeed model-states file: `module` holds the training module (`encoder.*` a timm backbone,
    `decoder.*`, `projector.*`, `mask_token`)."""


class GeofmExportCheckpoint(CheckpointLayout):
    """A geofm export: `backbone.safetensors` (timm names) next to its `backbone.json`."""


CHECKPOINT_LAYOUTS: Registry[CheckpointLayout] = Registry("checkpoint layout", "geofm.checkpoint_layouts")
"""What a checkpoint file holds and where its backbone sits, told from its keys.

Entries are :class:`CheckpointLayout` instances."""
CHECKPOINT_LAYOUTS.register("timm", TimmCheckpoint())
CHECKPOINT_LAYOUTS.register("microsoft_swin", MicrosoftSwinCheckpoint())
CHECKPOINT_LAYOUTS.register("gfm", GfmCheckpoint())
CHECKPOINT_LAYOUTS.register("simmim", SimmimCheckpoint())
CHECKPOINT_LAYOUTS.register("geofm_train", GeofmTrainCheckpoint())
CHECKPOINT_LAYOUTS.register("geofm_export", GeofmExportCheckpoint())
CHECKPOINT_LAYOUTS.register("torchvision_swin", "geofm.checkpoints.torchvision_swin:TORCHVISION_SWIN")
CHECKPOINT_LAYOUTS.register("dofa", "geofm.checkpoints.dofa:DOFA")
CHECKPOINT_LAYOUTS.register("prithvi", "geofm.checkpoints.prithvi:PRITHVI")


def export_sidecar_path(weights_path: str | Path) -> Path:
    """The JSON sidecar next to an exported weights file (``backbone.safetensors`` -> ``backbone.json``)."""
    return Path(weights_path).with_suffix(".json")


def sidecar_of(path: str | Path) -> Path:
    """Where the sidecar of an export is, given the export folder (or a pretraining run's, which
    holds its export), its safetensors file or the JSON itself."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path / EXPORT_SIDECAR
    return path if path.suffix == ".json" else export_sidecar_path(path)


def read_export_sidecar(path: str | Path) -> dict[str, Any]:
    """Read an export's sidecar, given the export folder, its safetensors file or the JSON itself.

    Raises:
        CheckpointNotFoundError: if the sidecar is missing.
        CheckpointFormatError: if it is not JSON or not a ``geofm-backbone/1`` sidecar.
    """
    path = sidecar_of(path)
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"export sidecar not found: {path} (written next to the weights by export_backbone)"
        )
    try:
        sidecar = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(sidecar, dict) or sidecar.get("format") != EXPORT_FORMAT:
        found = sidecar.get("format") if isinstance(sidecar, dict) else type(sidecar).__name__
        raise CheckpointFormatError(f"{path}: expected a {EXPORT_FORMAT} sidecar, found format {found!r}")
    return sidecar


def export_architecture(path: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The backbone config fields an export's sidecar records (``arch``, ``img_size``, ``window_size``
    for a Swin, ``timm_kwargs``), and the sidecar's path; None where ``path`` (see :func:`sidecar_of`)
    has no sidecar. Reads JSON only (no torch).

    Raises:
        CheckpointFormatError: if the sidecar is not JSON or not a ``geofm-backbone/1`` sidecar.
    """
    sidecar_path = sidecar_of(path)
    if not sidecar_path.is_file():
        return None
    sidecar = read_export_sidecar(sidecar_path)
    return sidecar_path, {"arch": sidecar["arch"], **backbone_config_fields(sidecar["timm_kwargs"])}


@dataclass(frozen=True)
class BandStatistics:
    """An export's pretraining normalisation for some bands: ``(value * scale - mean) / std`` per band.

    Attributes:
        source: the pretraining source whose statistics these are (None: the sidecar records none).
        scale: the factor from that source's raw values to the values ``mean`` and ``std`` are in.
        mean, std: per band, in the order asked for.
    """

    source: str | None
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]


def export_band_statistics(
    sidecar: Mapping[str, Any], bands: Sequence[str], source: str | None = None
) -> BandStatistics | None:
    """The normalisation an export's backbone was pretrained with, for ``bands`` (in that order).

    The statistics are those of ``source`` (a key of the sidecar's ``normalisation``), by default
    of the first source that has all of ``bands``. Reads JSON only (no torch).

    Returns:
        None where the sidecar records no statistics per source and ``source`` is None.

    Raises:
        ConfigError: ``source`` unknown, or no source (or not ``source``) has statistics for all of ``bands``.
    """
    normalisation = sidecar.get("normalisation")
    if not isinstance(normalisation, Mapping) or not normalisation:
        if source is not None:
            raise ConfigError(
                f"the export records no normalisation per source (and bands), so source {source!r} is unknown"
            )
        return None
    if source is not None and source not in normalisation:
        raise ConfigError(f"unknown source {source!r}: the export has statistics for {sorted(normalisation)}")
    names = [source] if source is not None else list(normalisation)
    for candidate in names:
        stats = normalisation[candidate]
        have = list(stats.get("bands") or [])
        if all(b in have for b in bands):
            return BandStatistics(
                source=candidate,
                scale=float(stats.get("scale", 1.0)),
                mean=tuple(float(stats["mean"][have.index(b)]) for b in bands),
                std=tuple(float(stats["std"][have.index(b)]) for b in bands),
            )
    covered = {n: normalisation[n].get("bands") for n in names}
    raise ConfigError(
        f"no source's statistics cover all the model's bands {list(bands)} (sources: {covered}); pass source=... "
        "to normalise as one of them, or add statistics for the missing bands"
    )


def detect_layout(raw: Mapping[str, Any], *, path: str | Path | None = None) -> str:
    """Name the layout of a loaded checkpoint (see :data:`CHECKPOINT_LAYOUTS`).

    Args:
        raw: the mapping returned by :func:`~geofm.checkpoints.io.load_checkpoint_file`.
        path: the file it came from; only used to find an export's JSON sidecar next to it.

    Raises:
        CheckpointFormatError: if the keys match no known layout.
    """
    return locate_backbone(raw, path=path).layout


def locate_backbone(raw: Mapping[str, Any], *, path: str | Path | None = None, teacher: bool = False) -> BackboneSource:
    """Find the backbone weights inside a loaded checkpoint and name the layout.

    Args:
        raw: the mapping returned by :func:`~geofm.checkpoints.io.load_checkpoint_file`.
        path: the file it came from (finds an export's sidecar, names the file in errors).
        teacher: the backbone wanted is a GFM teacher: a GFM file's ``teacher.*`` rather than its
            student; files of the other layouts hold one backbone, which is returned either way.

    Raises:
        CheckpointFormatError: if the keys match no registered layout, or a GFM file's ``teacher.*`` is
            not a backbone.
    """
    module = raw.get("module")
    if _is_weights(module):
        family = _family(module, "encoder.")
        if family is not None:
            return _source("geofm_train", module, "encoder.", family)

    weights, container = weights_mapping(raw)
    if weights is not None:
        encoder = _family(weights, "encoder.") if _has_prefix(weights, "encoder.") else None
        if encoder is not None:
            if _has_prefix(weights, "teacher."):
                return _source("gfm", weights, "encoder.", encoder) if not teacher else _gfm_teacher(weights, path)
            if _has_prefix(weights, "decoder."):
                return _source("simmim", weights, "encoder.", encoder)
        family = _family(weights, "")
        if family is not None:
            source = _source("timm", weights, "", family)
            trained = container == "model" and any(k in raw for k in _TRAINING_STATE)
            if source.microsoft_names:
                layout = "simmim" if trained else "microsoft_swin"
            elif (family == "beit" or source.beit_names) and trained:
                layout = "simmim"
            else:
                layout = "geofm_export" if container is None and _is_export(path) else "timm"
            return replace(source, layout=layout)

    for name in CHECKPOINT_LAYOUTS:
        found = CHECKPOINT_LAYOUTS.get(name).detect(raw, path=path, teacher=teacher)
        if found is not None:
            return found
    raise CheckpointFormatError(
        f"{path or 'checkpoint'}: unknown checkpoint layout (top-level keys: {_preview(raw)}). Known layouts:\n"
        + "\n".join(f"  {name}: {CHECKPOINT_LAYOUTS.summary(name)}" for name in CHECKPOINT_LAYOUTS)
    )


def _source(layout: str, weights: Mapping[str, Any], prefix: str, family: str) -> BackboneSource:
    microsoft = family in SWIN_FAMILIES and prefix + _MICROSOFT_SWIN in weights
    beit_names = family not in SWIN_FAMILIES and any(
        isinstance(k, str) and k.startswith(prefix + "blocks.") and k.endswith(_BEIT_NAMES) for k in weights
    )
    return BackboneSource(layout, weights, prefix, family, microsoft, beit_names)


def _gfm_teacher(weights: Mapping[str, Any], path: str | Path | None) -> BackboneSource:
    """The teacher backbone of a GFM file (``teacher.*``)."""
    family = _family(weights, "teacher.")
    if family is None:
        raise CheckpointFormatError(
            f"{path or 'checkpoint'}: a GFM checkpoint whose teacher.* keys hold no Swin or ViT backbone "
            f"(no teacher.{_PATCH_EMBED} with teacher.layers.* or teacher.blocks.*)"
        )
    return _source("gfm", weights, "teacher.", family)


def weights_mapping(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, str | None]:
    """The mapping of names to tensors: under ``model`` or ``state_dict``, or ``raw`` itself."""
    for container in ("model", "state_dict"):
        inner = raw.get(container)
        if _is_weights(inner):
            return inner, container
    return (raw, None) if _is_weights(raw) else (None, None)


def _is_weights(obj: Any) -> bool:
    return isinstance(obj, Mapping) and any(isinstance(k, str) and k.endswith(".weight") for k in obj)


def _has_prefix(weights: Mapping[str, Any], prefix: str) -> bool:
    return any(isinstance(k, str) and k.startswith(prefix) for k in weights)


def _family(weights: Mapping[str, Any], prefix: str) -> str | None:
    """``"swin"``, ``"swinv2"``, ``"vit"`` or ``"beit"`` when ``weights`` holds a 2-D patch embedding and Swin
    stages or ViT blocks (a 3-D patch embedding over time, as Prithvi's, is a layout of its own)."""
    kernel = weights.get(prefix + _PATCH_EMBED)
    if kernel is None or getattr(kernel, "ndim", 4) != 4:
        return None
    stages = prefix + "layers."
    if _has_prefix(weights, stages):
        v2 = any(isinstance(k, str) and k.startswith(stages) and k.endswith(_SWIN_V2) for k in weights)
        return "swinv2" if v2 else "swin"
    if _has_prefix(weights, prefix + "blocks."):
        return "beit" if relative_position_bias(weights, prefix) else "vit"
    return None


def relative_position_bias(weights: Mapping[str, Any], prefix: str = "") -> str | None:
    """How a ViT's weights hold relative position bias: ``"shared"`` (one table), ``"per block"``, or None."""
    if prefix + _SHARED_REL_POS in weights:
        return "shared"
    blocks = prefix + "blocks."
    if any(isinstance(k, str) and k.startswith(blocks) and k.endswith(_BLOCK_REL_POS) for k in weights):
        return "per block"
    return None


def _is_export(path: str | Path | None) -> bool:
    if path is None:
        return False
    try:
        read_export_sidecar(path)
    except (CheckpointNotFoundError, CheckpointFormatError):
        return False
    return True


def _preview(raw: Mapping[str, Any], limit: int = 8) -> str:
    keys = [str(k) for k in list(raw)[:limit]]
    more = len(raw) - len(keys)
    return ", ".join(keys) + (f" and {more} more" if more > 0 else "") if keys else "none"
