"""Typed configuration: one schema, validated when a YAML file is loaded.

A config is a YAML file plus optional ``key.path=value`` overrides. Unknown keys, wrong types and
impossible combinations raise a single :class:`~geofm.errors.ConfigError` that names the file and
every offending field, before any work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from geofm.errors import ConfigError
from geofm.models.backbones import backbone_family, patch_size_of, stage_count_of

RGB = ("red", "green", "blue")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; values are type-checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BackboneConfig(Section):
    """A timm backbone: registered architecture name, input size and architecture overrides."""

    arch: str = Field(description="timm model name, e.g. swin_base_patch4_window7_224 or vit_base_patch16_224")
    img_size: int = Field(gt=0)
    window_size: int | None = Field(default=None, gt=0, description="Swin only")
    timm_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra create_model kwargs (embed_dim, depths...)")

    @model_validator(mode="after")
    def _check_arch(self) -> BackboneConfig:
        family = backbone_family(self.arch)
        if self.window_size is not None and family != "swin":
            raise ValueError(f"window_size applies to Swin backbones only, not {self.arch}")
        grid = self.img_size / patch_size_of(self.arch, self.timm_kwargs)
        if grid != int(grid):
            raise ValueError(f"img_size {self.img_size} is not a multiple of the patch size of {self.arch}")
        if family == "swin":
            merges = 2 ** (stage_count_of(self.arch, self.timm_kwargs) - 1)
            if int(grid) % merges:
                raise ValueError(
                    f"img_size {self.img_size}: the {int(grid)}x{int(grid)} patch grid must be divisible by {merges} "
                    f"for the patch merging of {self.arch}"
                )
        return self

    @property
    def family(self) -> str:
        return backbone_family(self.arch)


class StudentConfig(BackboneConfig):
    """The backbone being pretrained."""

    drop_path_rate: float = Field(default=0.0, ge=0.0, lt=1.0)
    init_checkpoint: Path | None = Field(default=None, description="start from these weights instead of random")
    distill_block: int | None = Field(
        default=None, ge=1, description="ViT only: block whose output is distilled (default: 3/4 of the depth)"
    )


class MaskingConfig(Section):
    """SimMIM random masking."""

    mask_patch_size: int = Field(default=32, gt=0)
    mask_ratio: float = Field(default=0.6, gt=0.0, lt=1.0)


class TeacherConfig(BackboneConfig):
    """Frozen ImageNet teacher, truncated where its features are distilled."""

    checkpoint: Path = Field(description="local weights file (timm or Microsoft Swin layout, or a geofm export)")
    stage: int = Field(default=3, ge=1, description="Swin: distil after this stage (1-based)")
    include_merging: bool = Field(default=True, description="Swin: include the patch merging that ends the stage")
    block: int | None = Field(default=None, ge=1, description="ViT teacher: distil after this block (default 3/4 depth)")
    alpha: float = Field(default=1.0, ge=0.0, description="weight of the distillation loss")

    @model_validator(mode="after")
    def _check_tap(self) -> TeacherConfig:
        if self.family == "swin":
            stages = stage_count_of(self.arch, self.timm_kwargs)
            if self.stage > stages or (self.stage == stages and self.include_merging):
                raise ValueError(
                    f"stage {self.stage} with include_merging={self.include_merging} does not exist in {self.arch} "
                    f"({stages} stages; the last has no patch merging after it)"
                )
        return self


class SourceConfig(Section):
    """One imagery source of the pretraining pile."""

    name: str
    root: Path
    pattern: str = Field(default="**/*.tif", description="glob below root")
    bands: list[str] = Field(
        min_length=1, description="band names in the file's band order; bands the model does not use are dropped"
    )
    scale: float = Field(default=1.0, gt=0.0, description="multiplies raw values (e.g. 1/255, 1/10000)")
    nodata: float | None = Field(default=None, description="overrides the file's own nodata value")
    mean: list[float]
    std: list[float]
    weight: float = Field(default=1.0, gt=0.0, description="relative sampling weight in the pile")
    gsd: float | None = Field(default=None, gt=0.0, description="ground sample distance in metres per pixel")

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


class DataConfig(Section):
    """The multi-source pile and its augmentation."""

    bands: list[str] = Field(min_length=1, description="the model's input bands, in order")
    sources: list[SourceConfig] = Field(min_length=1)
    crop_scale: tuple[float, float] = (0.67, 1.0)
    hflip: bool = True
    vflip: bool = True
    samples_per_epoch: int | None = Field(default=None, gt=0, description="default: all images of all sources")
    on_bad_file: Literal["error", "skip"] = "error"
    num_workers: int = Field(default=2, ge=0)

    @model_validator(mode="after")
    def _check_bands(self) -> DataConfig:
        if len(set(self.bands)) != len(self.bands):
            raise ValueError(f"duplicate band names in data.bands {self.bands}")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        for s in self.sources:
            if not set(s.bands) & set(self.bands):
                raise ValueError(f"source {s.name!r} has none of the bands in data.bands {self.bands}: {s.bands}")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}")
        return self

    @property
    def rgb_indices(self) -> list[int] | None:
        """Positions of red, green, blue in :attr:`bands`, or None if any is missing."""
        if all(b in self.bands for b in RGB):
            return [self.bands.index(b) for b in RGB]
        return None


class TrainConfig(Section):
    """Optimisation on the DeepSpeed engine."""

    epochs: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0, description="images per device per forward pass")
    grad_accum_steps: int = Field(default=1, gt=0)
    base_lr: float = Field(default=2e-4, gt=0.0, description="learning rate per lr_reference_batch images")
    lr_reference_batch: int = Field(default=512, gt=0)
    warmup_epochs: float = Field(default=10, ge=0.0)
    warmup_start_ratio: float = Field(default=0.005, ge=0.0, le=1.0)
    min_lr_ratio: float = Field(default=0.05, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.05, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0.0)
    grad_clip: float = Field(default=5.0, gt=0.0)
    zero_stage: Literal[0, 1, 2] = 0
    precision: Literal["auto", "bf16", "fp32"] = Field(default="auto", description="auto: bf16 on GPU, fp32 on CPU")

    @model_validator(mode="after")
    def _check_warmup(self) -> TrainConfig:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be shorter than epochs ({self.epochs})")
        return self


class RunConfig(Section):
    """Where a run writes and how often."""

    output_dir: Path
    seed: int = 0
    log_every: int = Field(default=10, gt=0, description="steps between metrics.jsonl lines")
    checkpoint_every: int = Field(default=500, gt=0, description="steps between checkpoints")
    keep_checkpoints: int = Field(default=2, gt=0, description="periodic checkpoints kept on disk")
    stop_after_steps: int | None = Field(
        default=None, gt=0, description="end this invocation after that many steps; a rerun resumes (time-limited jobs)"
    )
    progress: bool = True


class PretrainConfig(Section):
    """Continual pretraining: SimMIM, plus GFM distillation when a teacher is set."""

    run: RunConfig
    model: StudentConfig
    masking: MaskingConfig = MaskingConfig()
    teacher: TeacherConfig | None = None
    data: DataConfig
    train: TrainConfig

    @model_validator(mode="after")
    def _check_combination(self) -> PretrainConfig:
        mp, img = self.masking.mask_patch_size, self.model.img_size
        if img % mp:
            raise ValueError(f"model.img_size {img} is not divisible by masking.mask_patch_size {mp}")
        patch = patch_size_of(self.model.arch, self.model.timm_kwargs)
        if mp % patch:
            raise ValueError(f"masking.mask_patch_size {mp} is not divisible by the backbone's patch size {patch}")
        if self.model.family == "swin" and self.model.distill_block is not None:
            raise ValueError("model.distill_block applies to ViT students; a Swin student is tapped at teacher.stage")
        if self.teacher is not None and len(self.data.bands) != 3 and self.data.rgb_indices is None:
            raise ValueError(
                f"a teacher sees RGB: data.bands {self.data.bands} must name red, green and blue (or hold exactly 3 bands)"
            )
        return self

    @property
    def teacher_band_indices(self) -> list[int]:
        """Input bands the teacher sees: red, green, blue (or the three bands of a 3-band model)."""
        return self.data.rgb_indices or [0, 1, 2]


def _set_dotted(tree: dict, dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: override {dotted!r}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Turn ``["train.epochs=3", "teacher=null"]`` into (key, YAML-parsed value) pairs."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        pairs.append((key.strip(), yaml.safe_load(raw)))
    return pairs


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif not isinstance(e.get("input"), dict):
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PretrainConfig:
    """Read a YAML config, apply overrides and validate it.

    Relative paths inside the file are kept relative to the working directory, the way the
    shipped configs are written (they are run from the repository root).

    Raises:
        ConfigError: naming the file and every invalid field.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value, str(path))
    return validate_config(tree, str(path))


def validate_config(tree: dict, source: str = "<config>") -> PretrainConfig:
    """Validate an already-parsed config tree."""
    try:
        return PretrainConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid configuration\n{_format_validation_error(exc)}") from None


def config_to_dict(cfg: PretrainConfig) -> dict:
    """JSON-ready dict of a config (paths as strings), for run directories and sidecars."""
    return cfg.model_dump(mode="json")
