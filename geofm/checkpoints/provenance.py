"""Provenance of a checkpoint: who made its weights, on what data and how, for model cards and ``inspect``."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor

from geofm.checkpoints.facts import RGB_BANDS, CheckpointFacts, read_checkpoint
from geofm.checkpoints.layouts import BackboneSource
from geofm.objective_settings import MIM_TASK
from geofm.runlog import METRICS_LOG, final_metrics

# Normalisation of RGB images in [0, 1] used by Microsoft's Swin, SimMIM and GFM (ImageNet statistics).
IMAGENET_NORMALISATION = {
    "imagenet": {
        "bands": list(RGB_BANDS),
        "scale": 1 / 255,
        "mean": list(IMAGENET_DEFAULT_MEAN),
        "std": list(IMAGENET_DEFAULT_STD),
    }
}
# Sidecar entries that tell where an export comes from.
_SIDECAR_PROVENANCE = (
    "method",
    "data",
    "steps",
    "epoch",
    "teacher",
    "gsd",
    "normalisation",
    "metrics",
    "federation",
    "converted_from",
    "release",
    "releases",
    "licence",
    "config",
)


# Config entries of GFM/SimMIM checkpoints worth showing (besides the model's own section).
_CONFIG_SUMMARY = (
    "MODEL.TYPE",
    "MODEL.NAME",
    "DATA.DATASET",
    "DATA.DATA_PATH",
    "DATA.IMG_SIZE",
    "DATA.MASK_PATCH_SIZE",
    "DATA.MASK_RATIO",
    "TRAIN.EPOCHS",
    "TRAIN.WARMUP_EPOCHS",
    "TRAIN.BASE_LR",
    "TRAIN.WEIGHT_DECAY",
    "TRAIN.LAYER_DECAY",
    "TAG",
)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"A": {"B": 1}}`` -> ``{"A.B": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def source_config_summary(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The entries of a GFM/SimMIM config that say what was trained, on what, and how."""
    flat = flatten(config)
    section = "MODEL.SWIN." if family == "swin" else "MODEL.VIT."
    keep = {k: v for k, v in flat.items() if k in _CONFIG_SUMMARY or k.startswith(section)}
    keep.update({k: v for k, v in flat.items() if "TEACHER" in k or "ALPHA" in k})
    return {k: _plain(v) for k, v in keep.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def last_metrics(run_dir: Path, step: int | None = None) -> dict[str, Any] | None:
    """The losses of a run's last epoch up to ``step``, averaged from its ``metrics.jsonl``."""
    path = run_dir / METRICS_LOG
    if not path.is_file():
        return None
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record and (step is None or record["step"] <= step):
            records.append(record)
    return final_metrics(records)


def gsd_range(gsds: Iterable[float | None]) -> list[float] | None:
    """``[min, max]`` of the sources' ground sample distances (m/px) that are known; None if none is."""
    values = [float(g) for g in gsds if g is not None]
    return [min(values), max(values)] if values else None


def provenance(facts: CheckpointFacts) -> dict[str, Any]:
    """Who made these weights, on what data, how: the facts a model card and ``inspect`` show.

    Keys (each present only when known): ``method``, ``data``, ``steps``, ``epoch``, ``teacher``,
    ``gsd``, ``normalisation``, ``metrics``, ``config`` (a run's config or a GFM/SimMIM summary).
    """
    raw, layout = facts.raw, facts.layout
    info: dict[str, Any] = {}
    if facts.sidecar is not None:
        return {k: facts.sidecar[k] for k in _SIDECAR_PROVENANCE if facts.sidecar.get(k) is not None}
    if facts.source.release:
        info["release"] = dict(facts.source.release)
    if layout == "geofm_train":
        step = raw.get("step", raw.get("global_steps"))
        if isinstance(step, int):
            info["steps"] = step
        if facts.run_config is not None:
            tree = facts.run_config
            teacher = (tree.get("task_options") or {}).get("teacher")
            task = tree.get("task", MIM_TASK)
            info["method"] = ("gfm" if teacher else "simmim") if task == MIM_TASK else task
            sources = (tree.get("data") or {}).get("sources") or []
            info["data"] = [
                {"name": s.get("name"), "root": s.get("root"), "weight": s.get("weight", 1.0), "gsd": s.get("gsd")}
                for s in sources
            ]
            info["gsd"] = gsd_range(s.get("gsd") for s in sources)
            info["normalisation"] = {
                s.get("name"): {k: s.get(k, 1.0 if k == "scale" else None) for k in ("bands", "scale", "mean", "std")}
                for s in sources
            }
            if teacher:
                info["teacher"] = {"arch": teacher.get("arch"), "checkpoint": teacher.get("checkpoint")}
            metrics = last_metrics(facts.run_dir, info.get("steps"))
            if metrics is not None:
                info["metrics"] = metrics
            info["config"] = tree
        return info
    if layout in ("gfm", "simmim"):
        finetuned = layout == "simmim" and not facts.source.prefix
        info["method"] = {"gfm": "gfm", "simmim": "simmim+finetune" if finetuned else "simmim"}[layout]
    elif layout == "microsoft_swin":
        info["method"] = "supervised"
    if layout in ("gfm", "simmim", "microsoft_swin") and facts.weights["patch_embed.proj.weight"].shape[1] == 3:
        info["normalisation"] = copy.deepcopy(IMAGENET_NORMALISATION)
    classes = _classifier_size(facts.source)
    if layout == "microsoft_swin" and classes in (1000, 21841):
        info["data"] = "ImageNet-22k" if classes == 21841 else "ImageNet-1k"
    if isinstance(raw.get("epoch"), int):
        info["epoch"] = raw["epoch"]
    if isinstance(raw.get("max_accuracy"), (int, float)):
        info["metrics"] = {"max_accuracy": raw["max_accuracy"]}
    if facts.source_config is not None:
        summary = source_config_summary(facts.source_config, facts.family)
        info["config"] = summary
        data = {k: summary[k] for k in ("DATA.DATASET", "DATA.DATA_PATH") if summary.get(k)}
        if data:
            info["data"] = data
    return info


def releases_of(paths: Mapping[str, Path | None]) -> dict[str, dict[str, Any]]:
    """The released models (with their licences) among checkpoint files, by role (``model.init_checkpoint``...).

    Files of a released model's layout, and exports converted from one, are named; others are left out.
    """
    found = {}
    for role, path in paths.items():
        release = provenance(read_checkpoint(path)).get("release") if path is not None else None
        if release:
            found[role] = release
    return found


def _classifier_size(source: BackboneSource) -> int | None:
    for name in ("head.weight", "head.fc.weight"):
        head = source.weights.get(source.prefix + name)
        if isinstance(head, Tensor) and head.ndim == 2:
            return int(head.shape[0])
    return None
