"""The config sections shared by every program: a section means the same in each schema.

``model`` (the student backbone), ``train`` (optimisation on the DeepSpeed engine) and ``run``
(outputs); ``data`` (sources, bands, normalisation) is :mod:`geofm.config.sources`. ``masking`` and
``teacher`` are masked image modelling's own settings (its ``task_options``), the teacher's also read
where a frozen teacher is built from its checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.base import Section, checks_architecture
from geofm.config.sources import DataConfig
from geofm.loggers import logger_names
from geofm.models.backbones import backbone_family, patch_size_of, stage_count_of


class BackboneConfig(Section):
    """A timm backbone: registered architecture name, input size and architecture overrides."""

    arch: str = Field(description="timm model name, e.g. swin_base_patch4_window7_224 or vit_base_patch16_224")
    img_size: int = Field(gt=0)
    window_size: int | None = Field(default=None, gt=0, description="Swin only")
    timm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra create_model kwargs (embed_dim, depths...)"
    )

    @model_validator(mode="after")
    def _check_arch(self, info: ValidationInfo) -> BackboneConfig:
        if not checks_architecture(info):
            return self
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
    init_checkpoint: Path | None = Field(
        default=None,
        description="start from these weights instead of random; a GFM, SimMIM or geofm pretraining checkpoint "
        "also gives the mask token, decoder and projector it holds",
    )
    distill_block: int | None = Field(
        default=None, ge=1, description="ViT only: block whose output is distilled (default: 3/4 of the depth)"
    )


class MaskingConfig(Section):
    """SimMIM random masking."""

    mask_patch_size: int = Field(default=32, gt=0)
    mask_ratio: float = Field(default=0.6, gt=0.0, lt=1.0)


class TeacherConfig(BackboneConfig):
    """Frozen ImageNet teacher, truncated where its features are distilled."""

    checkpoint: Path = Field(
        description="local weights file in any layout geofm checkpoint reads (timm, Microsoft Swin, geofm export...); "
        "of a GFM checkpoint, its teacher (teacher.*)"
    )
    stage: int = Field(default=3, ge=1, description="Swin: distil after this stage (1-based)")
    include_merging: bool = Field(default=True, description="Swin: include the patch merging that ends the stage")
    block: int | None = Field(
        default=None, ge=1, description="ViT teacher: distil after this block (default 3/4 depth)"
    )
    alpha: float = Field(default=1.0, ge=0.0, description="weight of the distillation loss")
    resize_mode: Literal["bilinear", "bicubic"] = Field(
        default="bilinear", description="how the input is resized to img_size (GFM: bilinear with align_corners)"
    )
    align_corners: bool = Field(default=True, description="align_corners of the resize (GFM: true)")
    distill_loss: Literal["pooled_cosine", "token_cosine"] = Field(
        default="pooled_cosine",
        description="pooled_cosine: one negative cosine per image between average-pooled features (GFM); "
        "token_cosine: the mean negative cosine over token positions",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="the frozen teacher's compute precision: bf16 (weights and matrix products in bfloat16, "
        "normalisations in float32; about 3x faster on CPUs with AVX-512 BF16 or AMX, features within about 1% "
        "of float32), fp32, or auto: bf16 where the device computes bfloat16 natively, else fp32",
    )

    @model_validator(mode="after")
    def _check_tap(self, info: ValidationInfo) -> TeacherConfig:
        if not checks_architecture(info):
            return self
        depth = stage_count_of(self.arch, self.timm_kwargs)
        if self.family == "swin":
            if self.stage > depth or (self.stage == depth and self.include_merging):
                raise ValueError(
                    f"stage {self.stage} with include_merging={self.include_merging} does not exist in {self.arch} "
                    f"({depth} stages; the last has no patch merging after it)"
                )
        elif self.block is not None and self.block > depth:
            raise ValueError(f"block {self.block} does not exist in {self.arch} ({depth} blocks)")
        return self


class OptimizerConfig(Section):
    """AdamW on the DeepSpeed engine: batch, learning rate, regularisation, clipping, precision."""

    micro_batch_size: int = Field(gt=0, description="images per device per forward pass")
    grad_accum_steps: int = Field(default=1, gt=0)
    base_lr: float = Field(default=2e-4, gt=0.0, description="learning rate per lr_reference_batch images")
    lr_reference_batch: int = Field(default=512, gt=0)
    min_lr_ratio: float = Field(default=0.05, ge=0.0, le=1.0, description="the cosine decays to base lr x this")
    weight_decay: float = Field(default=0.05, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0.0)
    grad_clip: float = Field(default=5.0, gt=0.0)
    zero_stage: Literal[0, 1, 2] = 0
    precision: Literal["auto", "bf16", "fp32"] = Field(default="auto", description="auto: bf16 on GPU, fp32 on CPU")
    compile: bool = Field(
        default=False,
        description="torch.compile the model: a one-off compilation (minutes for Swin-B) for faster steps, for long "
        "GPU runs; on a 2-core CPU Swin-B trained at most 8% faster after 80-135 s of compilation",
    )


class TrainConfig(OptimizerConfig):
    """Optimisation over epochs: linear warm-up, then cosine decay."""

    epochs: int = Field(gt=0)
    warmup_epochs: float = Field(default=10, ge=0.0)
    warmup_start_ratio: float = Field(default=0.005, ge=0.0, le=1.0)

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
    loggers: list[str] = Field(
        default=["jsonl"],
        description="where log records go: jsonl (always written), tensorboard, mlflow (docs/loggers.md)",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI; null: a local store in the run folder (sqlite:///RUN/mlflow.db)"
    )
    mlflow_experiment: str = Field(default="geofm", min_length=1, description="the MLflow experiment of the run")

    @field_validator("loggers", mode="before")
    @classmethod
    def _one_logger(cls, names: Any) -> Any:
        """A single name (``run.loggers=tensorboard``) as a list of it."""
        return [names] if isinstance(names, str) else names

    @field_validator("loggers")
    @classmethod
    def _check_loggers(cls, names: list[str]) -> list[str]:
        return logger_names(names)

    def stop_step(self, step: int, total_steps: int) -> int:
        """The step an invocation starting at ``step`` ends at: the schedule's end, or ``stop_after_steps`` on."""
        return total_steps if self.stop_after_steps is None else min(total_steps, step + self.stop_after_steps)


def check_masked_pretraining(
    model: StudentConfig,
    masking: MaskingConfig,
    teacher: TeacherConfig | None,
    data: DataConfig,
    *,
    architecture: bool = True,
) -> None:
    """Check that the sections of a masked-image pretraining config fit together (``masking`` and
    ``teacher``: its ``task_options``).

    Args:
        architecture: also the checks that build the backbone (its patch size and depth, which
            import timm); without it only those the values alone decide.

    Raises:
        ValueError: naming the fields that do not fit.
    """
    mp, img = masking.mask_patch_size, model.img_size
    if img % mp:
        raise ValueError(f"model.img_size {img} is not divisible by task_options.masking.mask_patch_size {mp}")
    if teacher is not None and len(data.bands) != 3 and data.rgb_indices is None:
        raise ValueError(
            f"a teacher sees RGB (task_options.teacher): data.bands {data.bands} must name red, green and blue (or "
            "hold exactly 3 bands)"
        )
    if not architecture:
        return
    patch = patch_size_of(model.arch, model.timm_kwargs)
    if mp % patch:
        raise ValueError(
            f"task_options.masking.mask_patch_size {mp} is not divisible by the backbone's patch size {patch}"
        )
    if model.family == "swin" and model.distill_block is not None:
        raise ValueError(
            "model.distill_block applies to ViT students; a Swin student is tapped at task_options.teacher.stage"
        )
    depth = stage_count_of(model.arch, model.timm_kwargs)
    if model.distill_block is not None and model.distill_block > depth:
        raise ValueError(f"model.distill_block {model.distill_block} does not exist in {model.arch} ({depth} blocks)")
