"""Reading a checkpoint and what lies beside it: export sidecar, training run config, pickled config, bands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from torch import Tensor

from geofm.checkpoints.io import load_checkpoint_file, resolve_checkpoint_path
from geofm.checkpoints.layouts import CHECKPOINT_LAYOUTS, BackboneSource, locate_backbone, read_export_sidecar
from geofm.data.bands import BAND_ID_TABLES, UnknownBandError, canonical_bands
from geofm.errors import ConfigError
from geofm.objective_settings import objective_settings_into_options

RGB_BANDS = ["red", "green", "blue"]
# Sentinel-2's 13 bands in band order: the input of torchgeo's SSL4EO-S12 and other Sentinel-2 L1C weights.
SENTINEL2_BANDS = list(BAND_ID_TABLES["sentinel2"].values())
RUN_CONFIG = "config.yaml"


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


def read_checkpoint(path: str | Path, *, teacher: bool = False, bands: Sequence[str] | None = None) -> CheckpointFacts:
    """Load a checkpoint (file or folder) and gather its sidecar, run config or pickled config.

    Args:
        path: a weights file or a folder (export, run directory, DeepSpeed checkpoint).
        teacher: the backbone wanted is a GFM file's teacher (``teacher.*``) rather than its student.
        bands: the input bands of the model the weights are for: a wavelength-conditioned layout
            (DOFA) makes its patch kernel for them (see :meth:`~geofm.checkpoints.layouts.CheckpointLayout.for_bands`).

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        CheckpointFormatError: unreadable, unsafe or of an unknown layout.
    """
    resolved = resolve_checkpoint_path(path)
    raw = load_checkpoint_file(resolved)
    source = locate_backbone(raw, path=resolved, teacher=teacher)
    source = CHECKPOINT_LAYOUTS.get(source.layout).for_bands(raw, source, bands, path=resolved)
    weights = {k[len(source.prefix) :]: v for k, v in source.weights.items() if k.startswith(source.prefix)}
    facts = CheckpointFacts(resolved, raw, source, weights)
    if source.layout == "geofm_export":
        facts.sidecar = read_export_sidecar(resolved)
    if source.layout == "geofm_train":
        facts.run_dir = find_run_dir(resolved)
        if facts.run_dir is not None:
            facts.run_config = _read_run_config(facts.run_dir / RUN_CONFIG)
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


def _read_run_config(path: Path) -> dict[str, Any] | None:
    """A run's saved config, its objective's settings where they are today (None: unreadable).

    Raises:
        ConfigError: naming ``path``, where they cannot be moved.
    """
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(tree, dict):
        return None
    try:
        return objective_settings_into_options(tree)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def source_bands(
    facts: CheckpointFacts, in_chans: int, given: Sequence[str] | None = None
) -> tuple[list[str] | None, str | None]:
    """The checkpoint's band names in order, and a note when they are assumed.

    Args:
        facts: the checkpoint.
        in_chans: its patch embedding's band count.
        given: the names a user gives for a file that does not say them (torchgeo's Landsat or
            Sentinel-1 ViT weights...), in the file's band order.

    Raises:
        ConfigError: ``given`` names unknown bands or another count than ``in_chans``.
    """
    if given is not None:
        try:
            names = canonical_bands(given, where="checkpoint bands")
        except UnknownBandError as err:
            raise ConfigError(f"{facts.path}: {err}") from err
        if len(names) != in_chans:
            raise ConfigError(
                f"{facts.path}: checkpoint bands name {len(names)} bands, its patch embedding takes {in_chans}"
            )
        return names, None
    if facts.source.bands:
        return list(facts.source.bands), None
    if facts.sidecar is not None and facts.sidecar.get("bands"):
        return list(facts.sidecar["bands"]), None
    if facts.run_config is not None:
        bands = (facts.run_config.get("data") or {}).get("bands")
        if bands:
            return list(bands), None
    if in_chans == 3:
        return list(RGB_BANDS), "a 3-band checkpoint without band names: taken as red, green, blue"
    if in_chans == len(SENTINEL2_BANDS):
        return list(SENTINEL2_BANDS), (
            "a 13-band checkpoint without band names: taken as Sentinel-2's bands in band order, B01-B08, B8A, "
            "B09-B12 (torchgeo's SSL4EO-S12 weights)"
        )
    return None, None
