"""Masked image modelling as a pretraining task: GFM, or SimMIM without a teacher (``task: mim``, the default).

The student reconstructs masked patches and, with a frozen teacher, matches the teacher's features
(:func:`geofm.tasks.mim.loss.gfm_loss`); the settings are its ``task_options`` (:class:`MimOptions`:
``masking`` and ``teacher``). A federated run draws the reconstruction figure of the server's public
chips at the end (a client's images never leave it).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from geofm.config import MaskingConfig, Section, TeacherConfig
from geofm.config.federated import FederatedConfig
from geofm.config.pretrain import PretrainingConfig
from geofm.config.sections import check_masked_pretraining
from geofm.models.backbones import create_backbone, patch_size_of, prefer_fused_attention
from geofm.runlog import LOSS_KEYS
from geofm.tasks import StepOutput
from geofm.tasks.pretraining import PretrainingObjective, export_pretrained, share_pile, student_kwargs

if TYPE_CHECKING:  # a config names its task while it is validated: torch is imported by the functions
    import torch

    from geofm.data.pile import PretrainPile
    from geofm.tasks.mim.masking import MaskGenerator
    from geofm.tasks.mim.model import MaskedImageModel
    from geofm.tasks.mim.teacher import FrozenTeacher
    from geofm.training.loop import Forward
    from geofm.training.rundir import InputPath

log = logging.getLogger("geofm.pretrain")


class MimOptions(Section):
    """Masked image modelling's settings (``task_options``): SimMIM's masking and GFM's frozen teacher."""

    masking: MaskingConfig = Field(
        default=MaskingConfig(), description="SimMIM's random masking: mask_patch_size (pixels), mask_ratio"
    )
    teacher: TeacherConfig | None = Field(
        default=None, description="the frozen teacher whose features the student matches (GFM); null: plain SimMIM"
    )


def mim_options(cfg: PretrainingConfig) -> MimOptions:
    """The masking and teacher of a masked-image-modelling config (its validated ``task_options``)."""
    return MimOptions.model_validate(cfg.task_options)


def with_teacher_checkpoint(cfg: PretrainingConfig, checkpoint: str | Path) -> PretrainingConfig:
    """``cfg`` with its frozen teacher's weights read from ``checkpoint`` (this machine's copy)."""
    options = cfg.task_options
    teacher = {**options["teacher"], "checkpoint": str(checkpoint)}
    return cfg.model_copy(update={"task_options": {**options, "teacher": teacher}})


def build_student(cfg: PretrainingConfig) -> MaskedImageModel:
    """Student backbone with mask token, decoder and, with a teacher, the projector onto the teacher's
    feature width: random, or from ``model.init_checkpoint`` (all of these the file holds: a GFM,
    SimMIM or geofm pretraining checkpoint continues where it stopped)."""
    from geofm.checkpoints import load_pretraining_model
    from geofm.tasks.mim.model import MaskedImageModel, Tap, default_vit_tap
    from geofm.tasks.mim.teacher import teacher_channels

    teacher = mim_options(cfg).teacher
    encoder = create_backbone(cfg.model.arch, student_kwargs(cfg), drop_path_rate=cfg.model.drop_path_rate)
    if teacher is None:
        model = MaskedImageModel(encoder, len(cfg.data.bands))
    else:
        if cfg.model.family == "swin":
            tap = Tap(teacher.stage, teacher.include_merging)
        else:
            tap = Tap(cfg.model.distill_block) if cfg.model.distill_block else default_vit_tap(encoder)
        model = MaskedImageModel(
            encoder, len(cfg.data.bands), tap, teacher_channels(teacher), teacher.alpha, teacher.distill_loss
        )
    if cfg.model.init_checkpoint is not None:
        report = load_pretraining_model(model, cfg.model.init_checkpoint, cfg.data.bands)
        log.info("student initialised from %s: %s", cfg.model.init_checkpoint, report)
    return model


def prepare_models(
    model: MaskedImageModel, teacher: FrozenTeacher | None, cfg: PretrainingConfig, dev: torch.device
) -> None:
    """The device's choices for the step: the attention kernel, and the teacher's device and precision."""
    from geofm.tasks.mim.teacher import teacher_dtype

    prefer_fused_attention(model, dev)
    if teacher is not None:
        prefer_fused_attention(teacher, dev)
        teacher.to(dev, teacher_dtype(mim_options(cfg).teacher.precision, dev))


def mim_forward(engine, teacher: FrozenTeacher | None, dev: torch.device, dtype: torch.dtype) -> Forward:
    """The masked-image-modelling forward of a micro-batch through ``engine``; with a teacher, its
    features of the same images are the distillation targets. Every pretraining mode trains with it."""

    def forward(batch: dict) -> StepOutput:
        images = batch["image"].to(dev, dtype, non_blocking=True)
        targets = teacher(images) if teacher is not None else None
        mask, valid = batch["mask"].to(dev, non_blocking=True), batch["valid"].to(dev, non_blocking=True)
        return StepOutput(engine(images, mask, valid, targets))

    return forward


def export_student(
    cfg: PretrainingConfig,
    model: MaskedImageModel,
    run_dir: Path,
    step: int,
    final: dict | None,
    extra: dict | None = None,
) -> Path:
    """Export the masked image model's student backbone (method ``gfm`` with a teacher, else ``simmim``)."""
    teacher = mim_options(cfg).teacher
    method = "gfm" if teacher is not None else "simmim"
    return export_pretrained(cfg, model.encoder, run_dir, step, final, method=method, teacher=teacher, extra=extra)


@functools.cache
def _teacher(teacher_json: str, bands_json: str) -> FrozenTeacher:
    """The frozen teacher, built once per process (clients sharing a simulation worker share it)."""
    from geofm.tasks.mim.teacher_from_checkpoint import build_teacher

    return build_teacher(TeacherConfig.model_validate(json.loads(teacher_json)), json.loads(bands_json))


def frozen_teacher(cfg: PretrainingConfig) -> FrozenTeacher | None:
    """The run's frozen teacher (None for plain SimMIM), loaded from this machine's weights file."""
    teacher = cfg.task_options.get("teacher")  # as validated: every field, paths as strings
    if teacher is None:
        return None
    return _teacher(json.dumps(teacher, sort_keys=True), json.dumps(cfg.data.teacher_band_indices))


class MaskedImageModelling(PretrainingObjective):
    """SimMIM, and GFM with a teacher: the student reconstructs masked patches and, with a frozen teacher,
    matches the teacher's features.

    The loss is :func:`geofm.tasks.mim.loss.gfm_loss`."""

    Options = MimOptions
    log_keys = LOSS_KEYS

    def __init__(self, cfg: PretrainingConfig) -> None:
        super().__init__(cfg)
        self.options: MimOptions = self.options_of(cfg)
        self.teacher: FrozenTeacher | None = None
        self._shown: tuple[PretrainPile, dict] | None = None  # the figure's pile and its chips, read once

    @classmethod
    def check_config(cls, cfg: PretrainingConfig, architecture: bool = True) -> None:
        options = cls.options_of(cfg, architecture)
        check_masked_pretraining(cfg.model, options.masking, options.teacher, cfg.data, architecture=architecture)

    def inputs(self) -> list[InputPath]:
        """The teacher's weights."""
        from geofm.training.rundir import InputPath

        teacher = self.options.teacher
        return [InputPath("task_options.teacher.checkpoint", teacher.checkpoint)] if teacher else []

    def build_model(self, initial_weights: bool = True) -> MaskedImageModel:
        """A fresh student; without ``initial_weights`` it skips ``model.init_checkpoint`` (a client overwrites it)."""
        cfg = self.cfg
        if not initial_weights:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_checkpoint": None})})
        return build_student(cfg)

    def prepare(self, model: MaskedImageModel) -> None:
        """Load the frozen teacher and move both models to this machine's device for training."""
        self.teacher = frozen_teacher(self.cfg)
        prepare_models(model, self.teacher, self.cfg, self.device)

    def pile(self, shares: list[list[Path]] | None = None) -> PretrainPile:
        """Crops with their SimMIM masks at the student's token grid."""
        return share_pile(self.cfg, shares, self._masks())

    def forward(self, model, batch: dict) -> StepOutput:
        """The GFM losses of one micro-batch (``model`` is the training engine or the student itself)."""
        return mim_forward(model, self.teacher, self.device, self.dtype)(batch)

    def figures(self, model: MaskedImageModel, pile: PretrainPile, run_dir: Path) -> None:
        """The reconstruction figure of a few fixed chips of ``pile``, read from disk once per pile
        (a central run redraws it at every checkpoint)."""
        from geofm.tasks.mim.figures import shown_chips, write_reconstruction_figure

        if self._shown is None or self._shown[0] is not pile:
            self._shown = (pile, shown_chips(pile, self.cfg.run.seed))
        write_reconstruction_figure(model, pile, self._shown[1], self.cfg.data.bands, run_dir)

    def export(self, model: MaskedImageModel, run_dir: Path, step: int, final: dict | None, extra: dict) -> Path:
        """Write the student's backbone like a central run's, with ``extra`` in its sidecar; a federated
        run also draws the reconstruction figure of the server's public chips (none without a public
        source: a client's images never leave it)."""
        cfg = self.cfg
        if isinstance(cfg, FederatedConfig):
            if cfg.federation.public_sources:
                self.figures(model, share_pile(cfg, self._public_shares(), self._masks()), run_dir)
            else:
                log.info("no reconstruction figure: the server holds no public source (federation.public_sources)")
        return export_student(cfg, model, run_dir, step, final, extra)

    def _masks(self) -> MaskGenerator:
        """The run's SimMIM masks at the student's token grid."""
        from geofm.tasks.mim.masking import MaskGenerator

        model, masking = self.cfg.model, self.options.masking
        patch = patch_size_of(model.arch, model.timm_kwargs)
        return MaskGenerator(model.img_size, masking.mask_patch_size, patch, masking.mask_ratio)


__all__ = [
    "MaskedImageModelling",
    "MimOptions",
    "build_student",
    "export_student",
    "frozen_teacher",
    "mim_forward",
    "mim_options",
    "prepare_models",
    "with_teacher_checkpoint",
]
