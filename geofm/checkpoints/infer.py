"""What a checkpoint holds, without being told: its timm architecture, bands and provenance.

The architecture comes, in this order, from

1. an export's sidecar (``backbone.json``: exact ``arch`` and ``timm_kwargs``);
2. a training run's ``config.yaml``, found in the checkpoint's folder or up to three folders above
   it (``run_dir/checkpoints/step_*/mp_rank_00_model_states.pt``);
3. the configuration pickled into GFM and SimMIM checkpoints (``MODEL.TYPE``, ``MODEL.SWIN.*`` or
   ``MODEL.VIT.*``, ``DATA.IMG_SIZE``), which fills in what the weights cannot tell;
4. the shapes of the weights. A Swin's width, depths and heads, its window size (from the
   relative-position tables, ``(2w-1)^2`` rows) and, through the windows clamped in its last stages
   or the stored attention masks, its image size; a ViT's width, depth and image size (position
   embedding), but not its number of attention heads: that needs a config or an explicit
   architecture. A BEiT-style ViT's heads are the columns of its relative-position tables.

The result is a registered timm name (``swin_base_patch4_window7_224``...) plus the
``timm.create_model`` kwargs that differ from that name's defaults.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
import yaml
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor

from geofm.checkpoints.convert import model_family
from geofm.checkpoints.io import load_checkpoint_file, resolve_checkpoint_path
from geofm.checkpoints.layouts import BackboneSource, locate_backbone, read_export_sidecar
from geofm.errors import CheckpointFormatError, ConfigError
from geofm.models.backbones import backbone_kwargs
from geofm.runlog import final_metrics

RGB_BANDS = ["red", "green", "blue"]
RUN_CONFIG = "config.yaml"
METRICS_LOG = "metrics.jsonl"
# Registered names tried, in order, when naming an architecture found in a checkpoint.
CANDIDATES = {
    "swin": [f"swin_{size}_patch4_window7_224" for size in ("tiny", "small", "base", "large")],
    "vit": [f"vit_{size}_patch16_224" for size in ("tiny", "small", "base", "large")] + ["vit_huge_patch14_224"],
    "beit": ["beit_base_patch16_224", "beit_large_patch16_224"],
}
# Structure kwargs compared with a name's defaults; the input kwargs (in_chans, img_size,
# window_size) are always written out.
STRUCTURE_KEYS = {
    "swin": ("patch_size", "embed_dim", "depths", "num_heads", "mlp_ratio", "qkv_bias"),
    "vit": (
        "patch_size",
        "embed_dim",
        "depth",
        "num_heads",
        "mlp_ratio",
        "qkv_bias",
        "class_token",
        "reg_tokens",
        "no_embed_class",
        "init_values",
        "pre_norm",
        "global_pool",
    ),
    "beit": (
        "patch_size",
        "embed_dim",
        "depth",
        "num_heads",
        "mlp_ratio",
        "qkv_bias",
        "init_values",
        "use_abs_pos_emb",
        "use_rel_pos_bias",
        "use_shared_rel_pos_bias",
        "global_pool",
    ),
}
_PRESENCE_ONLY = ("init_values",)  # only whether it is set shows in the weights; the value is loaded over
_SWIN_BLOCK = re.compile(r"^layers\.(\d+)\.blocks\.(\d+)\.")
_VIT_BLOCK = re.compile(r"^blocks\.(\d+)\.")
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


@dataclass
class CheckpointFacts:
    """A loaded checkpoint and what lies next to it.

    Attributes:
        path: the weights file.
        raw: what :func:`~geofm.checkpoints.io.load_checkpoint_file` returned.
        source: where the backbone sits and the layout.
        weights: the backbone's tensors, prefix stripped (Microsoft or timm names).
        sidecar: an export's ``backbone.json``.
        run_dir: the training run the checkpoint belongs to (holding ``config.yaml``).
        run_config: that run's config tree.
        source_config: the config pickled into a GFM/SimMIM checkpoint (a plain dict).
    """

    path: Path
    raw: dict[str, Any]
    source: BackboneSource
    weights: dict[str, Tensor]
    sidecar: dict[str, Any] | None = None
    run_dir: Path | None = None
    run_config: dict[str, Any] | None = None
    source_config: dict[str, Any] | None = None

    @property
    def layout(self) -> str:
        return self.source.layout

    @property
    def family(self) -> str:
        return self.source.family


@dataclass
class ArchSpec:
    """A timm architecture: registered name plus ``timm.create_model`` kwargs.

    Attributes:
        family: ``"swin"``, ``"vit"`` or ``"beit"``.
        arch: registered timm name.
        kwargs: ``timm.create_model`` kwargs of a headless backbone (``num_classes=0``, ``in_chans``,
            ``img_size``, Swin ``window_size``, and structure kwargs differing from ``arch``'s defaults).
        inferred_from: what told the architecture (``export sidecar``, ``run config``,
            ``checkpoint config``, ``weights``, ``arguments``), joined by ``+``.
        structure: everything known about the architecture (for display and re-naming).
        notes: assumptions made on the way.
    """

    family: str
    arch: str
    kwargs: dict[str, Any]
    inferred_from: str
    structure: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_checkpoint(path: str | Path, *, teacher: bool = False) -> CheckpointFacts:
    """Load a checkpoint (file or folder) and gather its sidecar, run config or pickled config.

    Args:
        path: a weights file or a folder (export, run directory, DeepSpeed checkpoint).
        teacher: the backbone wanted is a GFM file's teacher (``teacher.*``) rather than its student.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CheckpointFormatError: unreadable, unsafe or of an unknown layout.
    """
    resolved = resolve_checkpoint_path(path)
    raw = load_checkpoint_file(resolved)
    source = locate_backbone(raw, path=resolved, teacher=teacher)
    weights = {k[len(source.prefix) :]: v for k, v in source.weights.items() if k.startswith(source.prefix)}
    facts = CheckpointFacts(resolved, raw, source, weights)
    if source.layout == "geofm_export":
        facts.sidecar = read_export_sidecar(resolved)
    if source.layout == "geofm_train":
        facts.run_dir = find_run_dir(resolved)
        if facts.run_dir is not None:
            facts.run_config = _read_yaml(facts.run_dir / RUN_CONFIG)
    config = raw.get("config")
    if isinstance(config, Mapping) and isinstance(config.get("MODEL"), Mapping):
        facts.source_config = dict(config)
    return facts


def find_run_dir(path: Path, levels: int = 3) -> Path | None:
    """The nearest folder holding ``config.yaml``: the file's own folder or up to ``levels`` above it.

    The path is taken as given (``checkpoints/last/...`` leads to the run of that ``last`` link), then
    with links resolved.
    """
    for start in (path.absolute(), path.resolve()):
        folder = start.parent
        for _ in range(levels + 1):
            if (folder / RUN_CONFIG).is_file():
                return folder
            folder = folder.parent
    return None


def infer_architecture(
    facts: CheckpointFacts, *, arch: str | None = None, timm_kwargs: Mapping[str, Any] | None = None
) -> ArchSpec:
    """Name the timm architecture a checkpoint's backbone was built with.

    Args:
        facts: from :func:`read_checkpoint`.
        arch: a registered timm name to use instead of the inferred one; the structure read from the
            checkpoint (width, depths, heads...) is kept as kwargs where it differs from its defaults.
        timm_kwargs: ``timm.create_model`` kwargs that override what was inferred (e.g. a ViT's
            ``num_heads``, which its weights do not tell).

    Raises:
        CheckpointFormatError: if the weights do not tell enough (a ViT's heads without a config or
            ``arch``) or the recorded architecture does not fit the weights.
        ConfigError: if ``arch`` is not a timm Swin, ViT or BEiT name.
    """
    try:
        return _infer(facts, arch, dict(timm_kwargs or {}))
    except CheckpointFormatError as err:
        if str(facts.path) in str(err):
            raise
        raise CheckpointFormatError(f"{facts.path}: {err}") from err


def _infer(facts: CheckpointFacts, arch: str | None, hints: dict[str, Any]) -> ArchSpec:
    recorded = _recorded_architecture(facts)
    if recorded is not None and arch in (None, recorded.arch):
        recorded.kwargs.update(hints)
        recorded.structure.update(hints)
        if hints:
            recorded.inferred_from += "+arguments"
        return recorded

    if recorded is not None:
        structure, notes, sources = dict(recorded.structure), [], [recorded.inferred_from]
    else:
        structure, notes = structure_from_weights(facts.family, facts.weights)
        sources = ["weights"]
        config = facts.source_config
        if config is not None and _apply_source_config(facts.family, config, structure, notes):
            sources.append("checkpoint config")
    structure.update(hints)
    if arch is not None or hints:
        sources.append("arguments")
    spec = name_architecture(facts.family, structure, arch=arch, notes=notes, inferred_from="+".join(sources))
    spec.kwargs.update({k: v for k, v in hints.items() if k not in STRUCTURE_KEYS[spec.family]})
    return spec


def _recorded_architecture(facts: CheckpointFacts) -> ArchSpec | None:
    """The architecture an export's sidecar or a run's config writes down, if any."""
    if facts.sidecar is not None:
        return _recorded(facts, facts.sidecar["arch"], dict(facts.sidecar["timm_kwargs"]), "export sidecar")
    if facts.run_config is not None:
        model = facts.run_config.get("model") or {}
        bands = (facts.run_config.get("data") or {}).get("bands")
        if "arch" in model and "img_size" in model:
            in_chans = len(bands) if bands else int(facts.weights["patch_embed.proj.weight"].shape[1])
            kwargs = backbone_kwargs(
                in_chans=in_chans,
                img_size=model["img_size"],
                window_size=model.get("window_size"),
                timm_kwargs=model.get("timm_kwargs") or {},
            )
            return _recorded(facts, model["arch"], kwargs, "run config")
    return None


def name_architecture(
    family: str,
    structure: dict[str, Any],
    *,
    arch: str | None = None,
    notes: list[str] | None = None,
    inferred_from: str = "weights",
) -> ArchSpec:
    """Pick a registered timm name for ``structure`` (or use ``arch``) and the kwargs that rebuild it.

    Raises:
        CheckpointFormatError: if a ViT's number of heads is unknown and no ``arch`` is given.
    """
    notes = list(notes or [])
    if structure.get("num_heads") is None and arch is None:
        readable = ", ".join(f"{k} {structure[k]}" for k in ("embed_dim", "depth", "patch_size") if k in structure)
        raise CheckpointFormatError(
            f"the number of attention heads of a {family} cannot be read from its weights ({readable}) and no "
            "config says it: name the architecture (arch=..., --arch, e.g. vit_base_patch16_224 for width 768 and "
            "depth 12) or give timm_kwargs={'num_heads': N} (--timm-kwargs '{\"num_heads\": N}')"
        )
    candidates = [arch] if arch is not None else CANDIDATES[family]
    best: tuple[int, str, dict[str, Any]] | None = None
    for name in candidates:
        defaults = arch_defaults(name)
        if arch is not None and defaults["family"] != family:
            raise CheckpointFormatError(
                f"architecture {arch} is a {defaults['family']} and the checkpoint holds a {family} backbone"
            )
        differing = {
            k: structure[k]
            for k in STRUCTURE_KEYS[family]
            if structure.get(k) is not None and not _same(k, structure[k], defaults.get(k))
        }
        if best is None or len(differing) < best[0]:
            best = (len(differing), name, differing)
    _, name, differing = best
    if structure.get("num_heads") is None:
        structure = {**structure, "num_heads": arch_defaults(name).get("num_heads")}
        notes.append(f"num_heads {structure['num_heads']} from {name}'s defaults (not readable from ViT weights)")
    kwargs = backbone_kwargs(
        in_chans=int(structure["in_chans"]),
        img_size=int(structure["img_size"]),
        window_size=structure.get("window_size") if family == "swin" else None,
        timm_kwargs=differing,
    )
    return ArchSpec(family, name, kwargs, inferred_from, structure, notes)


@functools.cache
def _arch_defaults_json(arch: str) -> str:
    try:
        with torch.device("meta"):
            model = timm.create_model(arch, pretrained=False, num_classes=0)
    except RuntimeError as err:  # timm: unknown model
        raise ConfigError(f"unknown timm architecture {arch!r}: {err}") from err
    try:
        family = model_family(model)
    except TypeError as err:
        raise ConfigError(f"{arch} is not a timm Swin, ViT or BEiT architecture ({type(model).__name__})") from err
    structure, _ = structure_from_weights(family, model.state_dict())
    if family != "swin":
        structure["num_heads"] = int(model.blocks[0].attn.num_heads)
    return json.dumps({"family": family, **structure})


def arch_defaults(arch: str) -> dict[str, Any]:
    """The structure of a registered timm name at its defaults (built on the meta device, cached)."""
    return json.loads(_arch_defaults_json(arch))


def arch_family(arch: str) -> str:
    """``"swin"``, ``"vit"`` or ``"beit"`` for a registered timm name."""
    return arch_defaults(arch)["family"]


def _same(key: str, value: Any, default: Any) -> bool:
    if key in _PRESENCE_ONLY:
        return bool(value) == bool(default)
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    return value == default


def _recorded(facts: CheckpointFacts, arch: str, kwargs: dict[str, Any], inferred_from: str) -> ArchSpec:
    """An architecture written down next to the weights (export sidecar, run config)."""
    family = arch_family(arch)
    if family != facts.family:
        raise CheckpointFormatError(
            f"{facts.path}: the {inferred_from} names {arch} ({family}) but the weights hold a {facts.family}"
        )
    structure, _ = structure_from_weights(family, facts.weights)
    structure.update({k: v for k, v in kwargs.items() if k in (*STRUCTURE_KEYS[family], "img_size", "window_size")})
    if structure.get("num_heads") is None:
        structure["num_heads"] = arch_defaults(arch).get("num_heads")
    structure["in_chans"] = kwargs.get("in_chans", structure["in_chans"])
    return ArchSpec(family, arch, kwargs, inferred_from, structure, [])


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
        if family == "swin":
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
    tables = [weights[f"layers.{i}.blocks.0.attn.relative_position_bias_table"] for i in stages]
    windows = [(_table_side(t.shape[0]) + 1) // 2 for t in tables]
    window = max(windows)
    s.update(
        depths=[last_block[i] + 1 for i in stages],
        num_heads=[int(t.shape[1]) for t in tables],
        window_size=window,
        mlp_ratio=weights["layers.0.blocks.0.mlp.fc1.weight"].shape[0] / s["embed_dim"],
        qkv_bias="layers.0.blocks.0.attn.qkv.bias" in weights,
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


def _apply_source_config(family: str, config: Mapping[str, Any], s: dict[str, Any], notes: list[str]) -> bool:
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


def _read_yaml(path: Path) -> dict[str, Any] | None:
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return tree if isinstance(tree, dict) else None


def source_bands(facts: CheckpointFacts, in_chans: int) -> tuple[list[str] | None, str | None]:
    """The checkpoint's band names in order, and a note when they are assumed."""
    if facts.sidecar is not None and facts.sidecar.get("bands"):
        return list(facts.sidecar["bands"]), None
    if facts.run_config is not None:
        bands = (facts.run_config.get("data") or {}).get("bands")
        if bands:
            return list(bands), None
    if in_chans == 3:
        return list(RGB_BANDS), "a 3-band checkpoint without band names: taken as red, green, blue"
    return None, None


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
    if layout == "geofm_train":
        step = raw.get("step", raw.get("global_steps"))
        if isinstance(step, int):
            info["steps"] = step
        if facts.run_config is not None:
            tree = facts.run_config
            teacher = tree.get("teacher")
            info["method"] = "gfm" if teacher else "simmim"
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


def _classifier_size(source: BackboneSource) -> int | None:
    for name in ("head.weight", "head.fc.weight"):
        head = source.weights.get(source.prefix + name)
        if isinstance(head, Tensor) and head.ndim == 2:
            return int(head.shape[0])
    return None
