"""A timm backbone from any checkpoint file, without saying its format; conversion to an export; inspection.

::

    model, report, info = build_backbone("gfm.pth", window_size=6, img_size=192, bands=["red", "green", "blue", "nir"])
    convert_checkpoint("gfm.pth", "exports/gfm_swin_base", bands=["red", "green", "blue", "nir"])
    print(format_inspection(inspect_checkpoint("runs/my_run")))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from geofm.checkpoints.card import progress_name
from geofm.checkpoints.convert import apply_state_dict, backbone_state_dict
from geofm.checkpoints.export import export_backbone
from geofm.checkpoints.facts import CheckpointFacts, read_checkpoint, source_bands
from geofm.checkpoints.infer import ArchSpec, infer_architecture
from geofm.checkpoints.layouts import CHECKPOINT_LAYOUTS, SWIN_FAMILIES
from geofm.checkpoints.pretraining import PretrainingReport, pretraining_state
from geofm.checkpoints.provenance import flatten, provenance
from geofm.checkpoints.report import LoadReport
from geofm.errors import ConfigError, GeoFMError


def build_backbone(
    path: str | Path,
    *,
    arch: str | None = None,
    img_size: int | None = None,
    window_size: int | None = None,
    bands: Sequence[str] | None = None,
    rgb_positions: Sequence[int] | None = None,
    timm_kwargs: dict[str, Any] | None = None,
    strict: bool = True,
    checkpoint_bands: Sequence[str] | None = None,
) -> tuple[nn.Module, LoadReport, dict[str, Any]]:
    """Build the timm backbone a checkpoint holds and load its weights, in any known layout.

    The architecture is inferred (see :mod:`geofm.checkpoints.infer`); the arguments override it.
    A new ``window_size`` or ``img_size`` resizes relative-position tables and position embeddings
    (timm's ``checkpoint_filter_fn``); new ``bands`` rebuild the patch embedding band by band: bands
    the checkpoint has (by name) keep their kernels, the others a fresh initialisation.

    Args:
        path: a weights file or a folder (export, run directory, DeepSpeed checkpoint).
        arch: registered timm name to build instead of the inferred one.
        img_size: input size of the model.
        window_size: Swin window size of the model.
        bands: the model's input bands, in order (their count is the model's ``in_chans``).
        rgb_positions: model band indices receiving the red, green and blue kernels of a 3-band
            checkpoint, when ``bands`` do not name red, green and blue.
        timm_kwargs: further ``timm.create_model`` kwargs (``num_heads`` of a ViT without config...).
        strict: fail when the model has tensors the checkpoint lacks, or the reverse.
        checkpoint_bands: the checkpoint's bands in its order, for a file that does not name them.

    Returns:
        The model (eval mode), the load report, and what was inferred: ``arch``, ``timm_kwargs``,
        ``family``, ``layout``, ``inferred_from``, ``bands``, ``source_bands``, ``notes``,
        ``provenance``...

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CheckpointFormatError: unknown layout, unsafe file, unreadable architecture, or weights that do
            not fit.
        ConfigError: arguments that cannot apply (window size of a ViT, bands that cannot be mapped...).
    """
    facts = read_checkpoint(path, bands=bands)
    spec = infer_architecture(facts, arch=arch, timm_kwargs=timm_kwargs)
    kwargs = dict(spec.kwargs)
    if img_size is not None:
        kwargs["img_size"] = int(img_size)
    if window_size is not None:
        if spec.family not in SWIN_FAMILIES:
            raise ConfigError(f"window_size applies to Swin backbones only; the checkpoint holds a {spec.family}")
        kwargs["window_size"] = int(window_size)

    have = int(facts.weights["patch_embed.proj.weight"].shape[1])
    named, note = source_bands(facts, have, checkpoint_bands)
    notes = list(spec.notes) + ([note] if note else [])
    target = list(bands) if bands is not None else named
    if bands is not None:
        kwargs["in_chans"] = len(bands)
        if named is None and rgb_positions is None and len(bands) == have:
            notes.append(f"the checkpoint's {have} bands have no names: taken in order as {list(bands)}")
    elif rgb_positions is not None:
        raise ConfigError("rgb_positions need bands: the model's band list says how many bands it takes")
    band_sources = _band_sources(named, target, have, rgb_positions)

    model = create_model(spec.arch, kwargs)
    state, report = backbone_state_dict(
        facts.raw,
        model,
        rgb_positions=list(rgb_positions) if rgb_positions is not None else None,
        band_sources=band_sources,
        path=facts.path,
        source=facts.source,
    )
    apply_state_dict(model, state, report, strict=strict)
    report.fresh_bands = _fresh_bands(target, band_sources)
    info = {
        "path": str(facts.path),
        "layout": facts.layout,
        "family": spec.family,
        "arch": spec.arch,
        "timm_kwargs": kwargs,
        "inferred_from": spec.inferred_from,
        "bands": target,
        "source_bands": named,
        "in_chans": kwargs["in_chans"],
        "img_size": kwargs["img_size"],
        "window_size": kwargs.get("window_size"),
        "notes": notes,
        "provenance": provenance(facts),
    }
    return model.eval(), report, info


def load_backbone_for_bands(
    model: nn.Module, path: str | Path, bands: Sequence[str], *, strict: bool = True, teacher: bool = False
) -> LoadReport:
    """Load a checkpoint of any known layout into an existing backbone whose input bands are ``bands``.

    Patch-embedding kernels follow band names (those of an export or training run; an unnamed
    3-band checkpoint is red, green, blue); the model's other bands keep their fresh initialisation.
    Used to start finetuning from released or earlier weights, and to load a GFM teacher.

    Args:
        model: a timm Swin/ViT/BEiT backbone.
        path: a weights file or a folder (export, run directory, DeepSpeed checkpoint).
        bands: the model's input bands, in order.
        strict: fail when the model has tensors the checkpoint lacks, or the reverse.
        teacher: load a GFM file's teacher (``teacher.*``) rather than its student.
    """
    facts = read_checkpoint(path, teacher=teacher, bands=bands)
    band_sources = _named_band_sources(facts, bands)
    state, report = backbone_state_dict(
        facts.raw, model, band_sources=band_sources, path=facts.path, teacher=teacher, source=facts.source
    )
    apply_state_dict(model, state, report, strict=strict)
    report.fresh_bands = _fresh_bands(list(bands), band_sources)
    return report


def load_pretraining_model(model: nn.Module, path: str | Path, bands: Sequence[str]) -> PretrainingReport:
    """Start a pretraining module from a checkpoint: its ``encoder`` and whatever else the file holds of it.

    The module is geofm's masked image model (:class:`~geofm.tasks.mim.model.MaskedImageModel`): a timm
    backbone ``encoder``, ``mask_token``, ``decoder`` and, with a teacher, ``projector``. The encoder
    is loaded as :func:`load_backbone_for_bands` does; the mask token, decoder and projector of a
    GFM, SimMIM or geofm training checkpoint are restored (see :mod:`geofm.checkpoints.pretraining`),
    and the report says what was restored and what starts fresh.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, ConfigError: as :func:`load_backbone_for_bands`.
    """
    facts = read_checkpoint(path, bands=bands)
    band_sources = _named_band_sources(facts, bands)
    encoder_state, backbone = backbone_state_dict(
        facts.raw, model.encoder, band_sources=band_sources, path=facts.path, source=facts.source
    )
    state, used, report = pretraining_state(facts.source, model.state_dict(), list(bands), band_sources)
    apply_state_dict(model.encoder, encoder_state, backbone)
    model.load_state_dict(state, strict=False)
    backbone.fresh_bands = _fresh_bands(list(bands), band_sources)
    backbone.dropped = [key for key in backbone.dropped if key not in used]
    report.backbone = backbone
    return report


def _named_band_sources(facts: CheckpointFacts, bands: Sequence[str]) -> list[int | None] | None:
    """For each of ``bands``, the checkpoint band of the same name (None: fresh); None for the same bands in order."""
    have = int(facts.weights["patch_embed.proj.weight"].shape[1])
    named, _ = source_bands(facts, have)
    return _band_sources(named, list(bands), have, None)


def create_model(arch: str, kwargs: dict[str, Any]) -> nn.Module:
    """``timm.create_model(arch, **kwargs)`` without weights; impossible kwargs become a ConfigError."""
    try:
        return timm.create_model(arch, pretrained=False, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as err:
        raise ConfigError(f"timm cannot build {arch} with {json.dumps(kwargs)}: {err}") from err


def _band_sources(
    named: list[str] | None, target: list[str] | None, have: int, rgb_positions: Sequence[int] | None
) -> list[int | None] | None:
    """For each model band, the checkpoint band whose kernel it gets (None: fresh); None to let RGB placement decide."""
    if rgb_positions is not None or target is None:
        return None
    if named is None:
        if len(target) == have:
            return None  # unnamed bands, same count: taken in order
        raise ConfigError(
            f"the checkpoint's {have} bands have no names, so its kernels cannot be placed into bands {target}: "
            "give rgb_positions for an RGB checkpoint"
        )
    sources = [named.index(b) if b in named else None for b in target]
    if all(s is None for s in sources):
        raise ConfigError(
            f"none of the bands {target} is among the checkpoint's bands {named}: use those names, or give "
            "rgb_positions to place an RGB checkpoint's kernels"
        )
    return sources


def _fresh_bands(target: list[str] | None, band_sources: list[int | None] | None) -> list[str]:
    """The model bands that no checkpoint band feeds (band mapping by name)."""
    if target is None or band_sources is None:
        return []
    return [band for band, source in zip(target, band_sources, strict=True) if source is None]


def export_metadata(info: dict[str, Any], report: LoadReport) -> dict[str, Any]:
    """The sidecar metadata of a converted checkpoint: bands, GSD, normalisation, method, data, origin."""
    origin = info["provenance"]
    path = Path(info["path"])
    metadata: dict[str, Any] = {
        "bands": info["bands"],
        "gsd": origin.get("gsd"),
        "normalisation": origin.get("normalisation"),
        "img_size": info["img_size"],
        "method": origin.get("method"),
        "data": origin.get("data"),
    }
    for key in ("teacher", "steps", "epoch", "metrics", "release", "releases", "licence", "config"):
        if origin.get(key) is not None:
            metadata[key] = origin[key]
    metadata["converted_from"] = {
        "path": str(path),
        "sha256": _sha256(path),
        "layout": info["layout"],
        "architecture_from": info["inferred_from"],
        "source_bands": info["source_bands"],
        "adapted": report.adapted,
        "notes": info["notes"],
    }
    return metadata


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    metadata: dict[str, Any] | None = None,
    **build_options: Any,
) -> tuple[Path, LoadReport, dict[str, Any]]:
    """Turn a checkpoint in any known layout into an export: ``dst/backbone.safetensors``,
    ``dst/backbone.json`` and ``dst/MODEL_CARD.md``.

    Args:
        src: the checkpoint (see :func:`build_backbone`).
        dst: the export folder.
        metadata: sidecar entries added to (or replacing) what is derived from the checkpoint.
        build_options: ``arch``, ``img_size``, ``window_size``, ``bands``, ``rgb_positions``,
            ``timm_kwargs``, ``strict``, ``checkpoint_bands``: see :func:`build_backbone`.

    Returns:
        The safetensors path, the load report and the inferred facts.
    """
    model, report, info = build_backbone(src, **build_options)
    meta = {**export_metadata(info, report), **(metadata or {})}
    weights = export_backbone(model, dst, arch=info["arch"], create_kwargs=info["timm_kwargs"], metadata=meta)
    return weights, report, info


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """What a checkpoint is: layout, architecture, parameter count, bands, sizes, provenance.

    Nothing is built on real memory: the architecture is checked against the weights on the meta
    device. An architecture that cannot be inferred is reported (``arch_error``), not raised.
    """
    facts = read_checkpoint(path)
    have = int(facts.weights["patch_embed.proj.weight"].shape[1])
    named, note = source_bands(facts, have)
    result: dict[str, Any] = {
        "path": str(facts.path),
        "file_format": "safetensors" if facts.path.suffix == ".safetensors" else "torch",
        "layout": facts.layout,
        "layout_description": CHECKPOINT_LAYOUTS.summary(facts.layout),
        "family": facts.family,
        "backbone_prefix": facts.source.prefix,
        "microsoft_names": facts.source.microsoft_names,
        "arch": None,
        "timm_kwargs": None,
        "inferred_from": None,
        "parameters": None,
        "bands": named,
        "in_chans": have,
        "img_size": None,
        "window_size": None,
        "tensors": None,
        "notes": list(facts.source.notes) + ([note] if note else []),
        "provenance": provenance(facts),
    }
    try:
        spec = infer_architecture(facts)
        result.update(_check_on_meta(facts, spec), notes=spec.notes + result["notes"])
    except GeoFMError as err:
        result["arch_error"] = str(err)
        result["parameters_in_file"] = sum(
            int(v.numel()) for k, v in facts.weights.items() if isinstance(v, torch.Tensor) and not k.startswith("head")
        )
    return result


def _check_on_meta(facts: CheckpointFacts, spec: ArchSpec) -> dict[str, Any]:
    with torch.device("meta"):
        model = create_model(spec.arch, spec.kwargs)
    _, report = backbone_state_dict(facts.raw, model, path=facts.path, source=facts.source)
    return {
        "arch": spec.arch,
        "timm_kwargs": spec.kwargs,
        "inferred_from": spec.inferred_from,
        "parameters": sum(p.numel() for p in model.parameters()),
        "img_size": spec.kwargs.get("img_size"),
        "window_size": spec.kwargs.get("window_size"),
        "tensors": {
            "used": len(report.used),
            "dropped": len(report.dropped),
            "missing": len(report.missing),
            "unexpected": len(report.unexpected),
        },
    }


def format_inspection(result: dict[str, Any]) -> str:
    """A two-column table of :func:`inspect_checkpoint`'s result."""
    rows: list[tuple[str, str]] = [
        ("path", result["path"]),
        ("format", f"{result['file_format']}, layout {result['layout']} ({result['layout_description']})"),
        ("family", result["family"] + (" (Microsoft names)" if result["microsoft_names"] else "")),
    ]
    if result.get("arch"):
        rows += [
            ("architecture", f"{result['arch']} (from {result['inferred_from']})"),
            ("timm kwargs", json.dumps(result["timm_kwargs"])),
            ("parameters", f"{result['parameters'] / 1e6:.2f} M ({result['parameters']:,})"),
        ]
        tensors = result["tensors"]
        rows.append(("tensors", ", ".join(f"{k} {v}" for k, v in tensors.items())))
    else:
        rows += [
            ("architecture", f"unknown: {result.get('arch_error')}"),
            ("parameters", f"{result['parameters_in_file']:,} in the file's backbone tensors"),
        ]
    rows += [
        ("bands", ", ".join(result["bands"]) if result["bands"] else f"{result['in_chans']} unnamed"),
        ("image size", _text(result["img_size"], none="unknown")),
    ]
    if result["family"] in SWIN_FAMILIES:
        rows.append(("window size", _text(result["window_size"], none="unknown")))
    origin = result["provenance"]
    for key, value in sorted(origin.items(), key=lambda item: item[0] == "config"):
        name = progress_name(origin) if key == "steps" else key.replace("_", " ")
        if isinstance(value, dict) and value:
            rows += [(f"{name} {sub}", _text(v)) for sub, v in flatten(value).items()]
        else:
            rows.append((name, _text(value)))
    rows += [("note", note) for note in result["notes"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _text(value: Any, none: str = "none") -> str:
    """A table cell: ``none`` for a missing value (a recorded null, or ``unknown`` where nothing says)."""
    if value is None:
        return none
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = [
    "build_backbone",
    "convert_checkpoint",
    "create_model",
    "export_metadata",
    "format_inspection",
    "inspect_checkpoint",
    "load_backbone_for_bands",
    "load_pretraining_model",
]
