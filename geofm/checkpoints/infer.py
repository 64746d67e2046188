"""The timm architecture a checkpoint's backbone was built with, without being told.

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

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import timm
import torch

from geofm.checkpoints.convert import model_family
from geofm.checkpoints.facts import CheckpointFacts
from geofm.checkpoints.layouts import SWIN_FAMILIES
from geofm.checkpoints.structure import apply_source_config, structure_from_weights
from geofm.errors import CheckpointFormatError, ConfigError
from geofm.models.backbones import backbone_kwargs

# Registered names tried, in order, when naming an architecture found in a checkpoint.
CANDIDATES = {
    "swin": [f"swin_{size}_patch4_window7_224" for size in ("tiny", "small", "base", "large")],
    "swinv2": [f"swinv2_{size}_window8_256" for size in ("tiny", "small", "base")] + ["swinv2_large_window12_192"],
    "vit": [f"vit_{size}_patch16_224" for size in ("tiny", "small", "base", "large")] + ["vit_huge_patch14_224"],
    "beit": ["beit_base_patch16_224", "beit_large_patch16_224"],
}
# Structure kwargs compared with a name's defaults; the input kwargs (in_chans, img_size,
# window_size) are always written out.
STRUCTURE_KEYS = {
    "swin": ("patch_size", "embed_dim", "depths", "num_heads", "mlp_ratio", "qkv_bias"),
    "swinv2": ("patch_size", "embed_dim", "depths", "num_heads", "mlp_ratio", "qkv_bias"),
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
        "final_norm",
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


@dataclass
class ArchSpec:
    """A timm architecture: registered name plus ``timm.create_model`` kwargs.

    Attributes:
        family: ``"swin"``, ``"swinv2"``, ``"vit"`` or ``"beit"``.
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


def infer_architecture(
    facts: CheckpointFacts, *, arch: str | None = None, timm_kwargs: Mapping[str, Any] | None = None
) -> ArchSpec:
    """Name the timm architecture a checkpoint's backbone was built with.

    Args:
        facts: from :func:`~geofm.checkpoints.facts.read_checkpoint`.
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
        if facts.source.structure:
            structure.update(facts.source.structure)
            sources.append(f"{facts.layout} layout")
        config = facts.source_config
        if config is not None and apply_source_config(facts.family, config, structure, notes):
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
        window_size=structure.get("window_size") if family in SWIN_FAMILIES else None,
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
    if family in SWIN_FAMILIES:  # a Swin-v2 holds no table that tells its window
        structure["window_size"] = max(max(stage.blocks[0].window_size) for stage in model.layers)
    else:
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
