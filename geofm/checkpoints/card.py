"""The model card (Markdown) written next to every export, from the export's sidecar."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from geofm.objective_settings import objective_settings_into_options

MODEL_CARD = "MODEL_CARD.md"
METHODS = {
    "gfm": "GFM continual pretraining: masked image modelling (SimMIM) of a randomly initialised student "
    "plus distillation of a frozen teacher's intermediate features (an ImageNet-22k Swin in GFM)",
    "simmim": "SimMIM masked image modelling",
    "simmim+finetune": "SimMIM pretraining, then supervised finetuning",
    "supervised": "supervised image classification",
}


def model_card(sidecar: Mapping[str, Any], weights_file: str = "backbone.safetensors") -> str:
    """Markdown describing an export: architecture, bands, GSD, normalisation, data, method, settings,
    metrics, and how to load it with timm, geofm and torchgeo.

    Args:
        sidecar: the export's ``backbone.json`` content.
        weights_file: the weights file's name inside the export folder.
    """
    arch, kwargs = sidecar["arch"], sidecar["timm_kwargs"]
    method = sidecar.get("method")
    lines = [f"# {arch} backbone" + (f" ({method})" if method else ""), ""]
    lines += [
        f"Headless timm backbone in `{weights_file}` (timm key layout, float32) with its sidecar "
        f"`backbone.json` (`{sidecar.get('format')}`).",
        "",
        "## Architecture",
        "",
        "| | |",
        "| --- | --- |",
        f"| timm architecture | `{arch}` |",
        f"| timm kwargs | `{json.dumps(kwargs)}` |",
    ]
    if sidecar.get("num_params") is not None:
        lines.append(f"| parameters | {sidecar['num_params'] / 1e6:.2f} M ({sidecar['num_params']:,}) |")
    lines.append(f"| image size | {sidecar.get('img_size', kwargs.get('img_size'))} |")
    if kwargs.get("window_size") is not None:
        lines.append(f"| window size | {kwargs['window_size']} |")
    lines += ["", "## Input", ""]
    bands = sidecar.get("bands")
    lines.append(
        f"Bands, in order: {', '.join(f'`{b}`' for b in bands)}."
        if bands
        else f"Bands: {kwargs.get('in_chans')} (not named)."
    )
    gsd = sidecar.get("gsd")
    lines.append("")
    lines.append(f"Ground sample distance: {_gsd(gsd)}." if gsd else "Ground sample distance: not recorded.")
    lines += ["", *_normalisation(sidecar.get("normalisation"), bands)]
    lines += ["", "## Training", ""]
    lines.append(f"Method: {METHODS.get(method, method) if method else 'not recorded'}.")
    lines += ["", *_data(sidecar.get("data"))]
    teacher = sidecar.get("teacher")
    if teacher:
        lines += ["", f"Teacher: {_value(teacher)}."]
    settings = _settings(sidecar)
    if settings:
        lines += ["", "| setting | value |", "| --- | --- |"] + [f"| {k} | {_value(v)} |" for k, v in settings.items()]
    origin = sidecar.get("converted_from")
    if origin:
        lines += [
            "",
            f"Converted from `{origin.get('path')}` ({origin.get('layout')} layout, sha256 "
            f"`{origin.get('sha256')}`; architecture from {origin.get('architecture_from')}).",
        ]
        for note in [*origin.get("adapted", []), *origin.get("notes", [])]:
            lines.append(f"- {note}")
    federation = sidecar.get("federation")
    if federation:
        lines += [
            "",
            "## Federation",
            "",
            "Pretrained across institutions that kept their imagery; only model updates travelled.",
            "",
            "| federation | value |",
            "| --- | --- |",
        ]
        lines += [f"| {k} | {_value(v)} |" for k, v in federation.items()]
    lines += ["", "## Licence", "", *_licence(sidecar)]
    lines += ["", "## Metrics", ""]
    metrics = sidecar.get("metrics")
    if metrics:
        lines += ["| metric | value |", "| --- | --- |"] + [f"| {k} | {_value(v)} |" for k, v in metrics.items()]
    else:
        lines.append("No metrics recorded.")
    lines += ["", "## Loading", "", *_loading(weights_file, sidecar)]
    return "\n".join(lines) + "\n"


def _licence(sidecar: Mapping[str, Any]) -> list[str]:
    """The licence of the weights: the one given at conversion, else the released model's; a pretraining
    run's released student initialisation and teacher (``releases``, by role) with theirs."""
    release = sidecar.get("release") or {}
    licence = sidecar.get("licence") or release.get("licence")
    lines = [f"Licence: {licence}." if licence else "Licence: not recorded."]
    if release:
        lines.append(f"Converted from the released model {_release(release)}.")
    for role, used in (sidecar.get("releases") or {}).items():
        lines.append(f"- `{role}`: the released model {_release(used)}, licence {used.get('licence')}")
    return lines


def _release(release: Mapping[str, Any]) -> str:
    source = ", ".join(str(release[k]) for k in ("publication", "repo") if release.get(k))
    return f"{release.get('name')}" + (f" ({source})" if source else "")


def _gsd(gsd: Any) -> str:
    if isinstance(gsd, (list, tuple)) and len(gsd) == 2:
        low, high = gsd
        return f"{low:g} m/px" if low == high else f"{low:g} to {high:g} m/px"
    return f"{gsd} m/px"


def _normalisation(normalisation: Any, bands: list[str] | None) -> list[str]:
    if not normalisation:
        return ["Normalisation: not recorded."]
    if not isinstance(normalisation, Mapping) or not all(isinstance(v, Mapping) for v in normalisation.values()):
        return [f"Normalisation: `{json.dumps(normalisation)}`."]
    lines = [
        "Normalisation per source: `(raw * scale - mean) / std`, per band.",
        "",
        "| source | band | scale | mean | std |",
        "| --- | --- | --- | --- | --- |",
    ]
    covered: set[str] = set()
    for name, stats in normalisation.items():
        for i, band in enumerate(stats.get("bands") or []):
            covered.add(band)
            mean, std = (_item(stats.get(key), i) for key in ("mean", "std"))
            lines.append(f"| {name} | {band} | {stats.get('scale', 1.0):g} | {mean} | {std} |")
    uncovered = [b for b in bands or [] if b not in covered]
    if uncovered:
        lines += ["", f"No statistics for {', '.join(uncovered)} (bands added after training, freshly initialised)."]
    return lines


def _item(values: Any, index: int) -> Any:
    return values[index] if isinstance(values, list) and index < len(values) else "-"


def _data(data: Any) -> list[str]:
    if not data:
        return ["Data: not recorded."]
    if isinstance(data, list) and all(isinstance(d, Mapping) for d in data):
        lines = ["| source | root | weight | GSD (m/px) |", "| --- | --- | --- | --- |"]
        for d in data:
            lines.append(f"| {d.get('name')} | `{d.get('root')}` | {d.get('weight', 1.0)} | {_value(d.get('gsd'))} |")
        return ["Data:", "", *lines]
    return [f"Data: {_value(data)}."]


def progress_name(origin: Mapping[str, Any]) -> str:
    """What the ``steps`` entry of a sidecar or provenance counts: ``rounds`` for a federated run, else ``steps``."""
    return "rounds" if origin.get("federation") else "steps"


def _settings(sidecar: Mapping[str, Any]) -> dict[str, Any]:
    """Training settings worth a line: from a geofm run's config, or a GFM/SimMIM config summary."""
    settings: dict[str, Any] = {}
    if sidecar.get("steps") is not None:
        settings[progress_name(sidecar)] = sidecar["steps"]
    if sidecar.get("epoch") is not None:
        settings["epoch"] = sidecar["epoch"]
    config = sidecar.get("config")
    if not isinstance(config, Mapping):
        return settings
    if "train" in config:  # a geofm run config
        config = objective_settings_into_options(dict(config))
        options = config.get("task_options") or {}
        train, masking, teacher = config.get("train") or {}, options.get("masking") or {}, options.get("teacher") or {}
        for key in (
            "epochs",
            "local_steps",
            "local_epochs",
            "micro_batch_size",
            "grad_accum_steps",
            "base_lr",
            "lr_reference_batch",
            "warmup_epochs",
            "weight_decay",
            "grad_clip",
            "zero_stage",
            "precision",
        ):
            if train.get(key) is not None:
                settings[key] = train[key]
        for key in ("mask_patch_size", "mask_ratio"):
            if key in masking:
                settings[key] = masking[key]
        if teacher:
            settings.update({"teacher stage": teacher.get("stage"), "alpha": teacher.get("alpha")})
        model = config.get("model") or {}
        if model.get("drop_path_rate") is not None:
            settings["drop_path_rate"] = model["drop_path_rate"]
        return settings
    settings.update(config)  # GFM/SimMIM config summary, already flat
    return settings


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`"
    return str(value)


def _loading(weights_file: str, sidecar: Mapping[str, Any]) -> list[str]:
    in_chans = sidecar["timm_kwargs"].get("in_chans")
    return [
        "With plain timm:",
        "",
        "```python",
        "import json, timm",
        'meta = json.load(open("backbone.json"))',
        "model = timm.create_model(",
        '    meta["arch"], pretrained=True,',
        f'    pretrained_cfg_overlay=dict(file="{weights_file}", **meta["timm_pretrained_cfg_overlay"]),',
        '    **meta["timm_kwargs"],',
        ")",
        "```",
        "",
        "With geofm (any image size, window size or band list; kernels follow the bands by name):",
        "",
        "```python",
        "from geofm.checkpoints import build_backbone",
        'model, report, info = build_backbone("path/to/this/folder")',
        "```",
        "",
        "With torchgeo (a `WeightsEnum` member with normalising transforms and torchgeo's meta):",
        "",
        "```python",
        "import timm",
        "from geofm.checkpoints import torchgeo_weights",
        'weights = torchgeo_weights("path/to/this/folder")',
        'model = timm.create_model(weights.meta["model"], **weights.meta["timm_kwargs"])',
        "model.load_state_dict(weights.get_state_dict(progress=False))",
        "```",
        "",
        f"torchgeo's trainers build `timm.create_model(name, num_classes=..., in_chans={in_chans})` with the "
        "architecture's default sizes, so they take these weights only where the timm kwargs above are those "
        "defaults; timm Swin models do not load there in torchgeo 0.8 to 0.10 (its weight loader reads "
        "`out_features` of the classifier, which timm's Swin `ClassifierHead` lacks).",
    ]
