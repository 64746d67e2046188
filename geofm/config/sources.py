"""The ``data`` section of pretraining: imagery sources with their bands, quality masks and normalisation,
and the section read alone from a config file (``geofm data stats`` and ``geofm data prepare``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from geofm.config.base import ProgramConfig, Section, read_config_tree, refuse_moved_keys
from geofm.data.bands import UnknownBandError, canonical_bands, rgb_indices, teacher_band_indices
from geofm.data.layouts import LAYOUT_KEYS_MOVED, PRODUCT_LAYOUTS
from geofm.data.quality import CONFIDENCE_LEVELS, GENERATIONS, QUALITY_CLASSES, RECORDED_CLASSES
from geofm.errors import ConfigError


def canonical_band_lists(section: dict, keys: tuple[str, ...], custom: list[str], where: str, label: str = "") -> dict:
    """A copy of a raw config section with its band-name lists under ``keys`` resolved through the
    band vocabulary (aliases to canonical names) and ``custom``, for a ``mode="before"`` validator.

    Raises:
        ValueError: an unknown or duplicated band, naming ``where.key`` (and ``label``).
    """
    section = dict(section)
    for key in keys:
        if isinstance(section.get(key), list):
            try:
                section[key] = canonical_bands(section[key], custom, f"{where}.{key}{label}")
            except UnknownBandError as err:
                raise ValueError(str(err)) from None
    return section


class QualityConfig(Section):
    """Which pixels a product's quality band makes invalid, and when a chip has too many of them."""

    band: str | None = Field(
        default=None,
        description="the quality band, as its layout names bands: a band id (BQA, QA_PIXEL, SCL) or a STAC asset "
        "key (qa_pixel, SCL); layouts whose product metadata names it take none",
    )
    generation: Literal[GENERATIONS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="the quality band's bit layout; required where the product does not state it (single band "
        "files, STAC items without it), read from the metadata of layouts whose products give it",
    )
    invalid: list[Literal[QUALITY_CLASSES]] | None = Field(  # type: ignore[valid-type]
        default=None,
        min_length=1,
        description="classes whose pixels are invalid (left out of the loss); default every class the generation records",
    )
    confidence: Literal[tuple(CONFIDENCE_LEVELS)] = Field(  # type: ignore[valid-type]
        default="medium", description="the lowest confidence at which a cloud, shadow, cirrus or snow flag counts"
    )
    max_invalid_fraction: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="a sample (chip) with a larger fraction of invalid pixels is passed over and counted; 1 keeps all",
    )

    @model_validator(mode="after")
    def _check_classes(self) -> QualityConfig:
        if self.generation is not None and self.invalid is not None:
            unrecorded = [c for c in self.invalid if c not in RECORDED_CLASSES[self.generation]]
            if unrecorded:
                raise ValueError(
                    f"quality.invalid: {self.generation} quality bands do not record {', '.join(unrecorded)} "
                    f"(they record {', '.join(RECORDED_CLASSES[self.generation])})"
                )
        return self


class SourceConfig(Section):
    """One imagery source of the pretraining pile: a folder of multi-band files or of per-band products."""

    name: str
    root: Path
    layout: str = Field(
        default="file",
        description="how the samples lie on disk, a registered product layout (geofm list product-layouts); default "
        "file: one multi-band file per sample",
    )
    pattern: str = Field(
        default=None,
        validate_default=False,
        description="glob below root: the files or the products' metadata files (default: the layout's own)",
    )
    bands: list[str] = Field(
        min_length=1,
        description="band names in the file's band order (file layout) or the bands read from each product; "
        "bands the model does not use are dropped",
    )
    scale: float = Field(default=1.0, gt=0.0, description="multiplies raw values (e.g. 1/255, 1/10000)")
    offset: float = Field(default=0.0, description="added to raw values after scale (physical = raw * scale + offset)")
    nodata: float | None = Field(default=None, description="overrides the file's own nodata value")
    mean: list[float]
    std: list[float]
    weight: float = Field(default=1.0, gt=0.0, description="relative sampling weight in the pile")
    gsd: float | None = Field(
        default=None,
        gt=0.0,
        description="ground sample distance in metres per pixel; products are read onto a grid of this GSD "
        "(default: their finest band read)",
    )
    chip_size: int | None = Field(
        default=None,
        gt=0,
        description="files larger than this (pixels per side) are cut into a grid of chip_size windows, each a sample "
        "read on its own (large scenes are never read whole); every file's header is read when the source is indexed",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the layout's own settings, checked by the layout (geofm list product-layouts)",
    )
    quality: QualityConfig | None = Field(
        default=None, description="per-band products: the quality band whose flagged pixels are invalid"
    )

    @model_validator(mode="before")
    @classmethod
    def _layout_defaults(cls, data: Any) -> Any:
        """The layout's own values (its pattern...) of the fields left unset."""
        if not isinstance(data, dict):
            return data
        layout = data.get("layout", "file")
        defaults = PRODUCT_LAYOUTS.get(layout if layout in PRODUCT_LAYOUTS else "file").defaults()
        return {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}

    @field_validator("layout")
    @classmethod
    def _registered_layout(cls, layout: str) -> str:
        return PRODUCT_LAYOUTS.check(layout)

    @model_validator(mode="before")
    @classmethod
    def _moved_to_options(cls, data: Any) -> Any:
        moved = {key: key for key in LAYOUT_KEYS_MOVED}
        return refuse_moved_keys(data, moved, "a product layout's own settings go in the source's options")

    @model_validator(mode="after")
    def _check_stats(self) -> SourceConfig:
        n = len(self.bands)
        if len(set(self.bands)) != n:
            raise ValueError(f"source {self.name!r}: duplicate band names in {self.bands}")
        if len(self.mean) != n or len(self.std) != n:
            raise ValueError(
                f"source {self.name!r}: mean and std need one value per band ({n}), got {len(self.mean)} and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"source {self.name!r}: std values must be positive, got {self.std}")
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> SourceConfig:
        PRODUCT_LAYOUTS.get(self.layout).check(self)
        return self

    @property
    def layout_options(self) -> Any:
        """The layout's own settings: ``options`` validated by its ``Options`` model (None: it takes none)."""
        return PRODUCT_LAYOUTS.get(self.layout).options_of(self)


class DataConfig(Section):
    """The multi-source pile and its augmentation.

    Band names (``bands`` and each source's) come from the band vocabulary of
    :mod:`geofm.data.bands` (aliases such as ``b08`` become ``nir``) or ``custom_bands``.
    """

    bands: list[str] = Field(min_length=1, description="the model's input bands, in order")
    custom_bands: list[str] = Field(
        default_factory=list, description="band names outside the vocabulary, e.g. [ndvi, dem]"
    )
    sources: list[SourceConfig] = Field(min_length=1)
    crop_scale: tuple[float, float] = (0.67, 1.0)
    hflip: bool = True
    vflip: bool = True
    samples_per_epoch: int | None = Field(default=None, gt=0, description="default: all images of all sources")
    on_bad_file: Literal["error", "skip"] = "error"
    num_workers: int = Field(default=2, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _canonical_band_names(cls, data: Any) -> Any:
        """Resolve aliases and refuse unknown band names before the fields are checked."""
        if not isinstance(data, dict):
            return data
        custom = data.get("custom_bands") or []
        data = canonical_band_lists(data, ("bands",), custom, "data")
        if isinstance(data.get("sources"), list):
            data["sources"] = [
                canonical_band_lists(s, ("bands",), custom, f"data.sources.{i}", f" ({s.get('name')})")
                if isinstance(s, dict)
                else s
                for i, s in enumerate(data["sources"])
            ]
        return data

    @model_validator(mode="after")
    def _check_bands(self) -> DataConfig:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        for s in self.sources:
            if not set(s.bands) & set(self.bands):
                raise ValueError(f"source {s.name!r} has none of the bands in data.bands {self.bands}: {s.bands}")
        provided = {b for s in self.sources for b in s.bands}
        unprovided = [b for b in self.bands if b not in provided]
        if unprovided:
            raise ValueError(
                f"data.bands {unprovided} are provided by no source (sources have {sorted(provided)}): "
                "the model would see an always-empty channel"
            )
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}")
        return self

    def at_node(self, data_root: Path, source: str | None) -> DataConfig:
        """The pile as one institution's machine holds it: ``data_root`` is the root of its own ``source`` (a
        federation of one client per source), or, with ``source`` None, the folder relative source roots are
        resolved against."""

        def root(s: SourceConfig) -> Path:
            if source is not None:
                return data_root if s.name == source else s.root
            return s.root if s.root.is_absolute() else data_root / s.root

        return self.model_copy(update={"sources": [s.model_copy(update={"root": root(s)}) for s in self.sources]})

    @property
    def teacher_band_indices(self) -> list[int]:
        """Input bands a teacher sees: red, green, blue (or the three bands of a 3-band model)."""
        return teacher_band_indices(self.bands)

    @property
    def rgb_indices(self) -> list[int] | None:
        """Positions of red, green, blue in :attr:`bands`, or None if any is missing."""
        return rgb_indices(self.bands)


class _DataSection(ProgramConfig):
    """A config's ``data`` section alone, validated as every program validates it."""

    data: DataConfig


def configured_data(config: str | Path, overrides: Sequence[str] = ()) -> DataConfig:
    """The ``data`` section of a config file (after its ``base`` and the ``key.path=value`` overrides),
    validated with its band names resolved; its sources' ``mean`` and ``std`` may be left out, being what
    the statistics are for.

    Raises:
        ConfigError: if the file, an override or its data section is invalid.
    """
    tree = read_config_tree(config, overrides)
    data = tree.get("data")
    sources = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(sources, list):
        raise ConfigError(f"{config}: no data.sources list")
    filled = []
    for source in sources:
        if isinstance(source, dict) and isinstance(source.get("bands"), list):
            n = len(source["bands"])
            source = {"mean": [0.0] * n, "std": [1.0] * n, **source}
        filled.append(source)
    return _DataSection.from_tree({"data": {**data, "sources": filled}}, str(config), overrides).data


def source_named(data: DataConfig, name: str, config: str | Path) -> SourceConfig:
    """Source ``name`` of ``data``, the data section of file ``config``.

    Raises:
        ConfigError: it has no source ``name``.
    """
    names = [s.name for s in data.sources]
    if name not in names:
        raise ConfigError(f"{config}: data.sources has no source named {name!r}; its sources are {names}")
    return data.sources[names.index(name)]


def configured_source(config: str | Path, name: str) -> SourceConfig:
    """Source ``name`` of a config file's ``data.sources`` (see :func:`configured_data`).

    Raises:
        ConfigError: if the file or its data section is invalid, or it has no source ``name``.
    """
    return source_named(configured_data(config), name, config)
