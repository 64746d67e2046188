"""DINO self-distillation as a pretraining task (``task: dino``), central and federated.

The student (backbone + :class:`~geofm.tasks.dino.model.ProjectionHead`) sees every multi-crop view of
an image (:class:`~geofm.tasks.dino.views.MultiCrop`); the EMA teacher sees the global views; the loss
is the cross-entropy of the teacher's centred, sharpened outputs and the student's
(:func:`~geofm.tasks.dino.loss.dino_loss`). After each optimizer step the teacher moves towards the
student and the centre towards the teacher's mean output. The settings are ``task_options``
(:class:`DinoOptions`); no label, mask or frozen teacher is read.

Central runs keep the teacher and the centre in their checkpoints and export the teacher's backbone
(DINO evaluates the teacher; ``export: student`` exports the student's). In a federated run only the
student travels, as with every objective, so that every algorithm and codec sees the same model: each
client's round starts its teacher from the global student it received and its centre at zero, and the
server exports the global student's backbone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from geofm.config.base import Section
from geofm.config.federated import FederatedConfig
from geofm.config.pretrain import PretrainingConfig
from geofm.models.backbones import arch_info, create_backbone, prefer_fused_attention
from geofm.tasks import StepOutput
from geofm.tasks.pretraining import PretrainingObjective, export_pretrained, share_pile, student_kwargs

if TYPE_CHECKING:  # a config names its task while it is validated: torch is imported by the methods
    import torch

    from geofm.data.pile import PretrainPile
    from geofm.tasks.dino.model import DinoStudent, EmaTeacher

log = logging.getLogger("geofm.pretrain")

SWIN_STRIDE = 32
"""A Swin's total stride: local crops default to a multiple of it."""


class DinoOptions(Section):
    """DINO's settings (Caron et al. 2021; defaults are the paper's code's, ``main_dino.py``)."""

    out_dim: int = Field(default=65536, gt=1, description="prototypes K of the head's last layer")
    hidden_dim: int = Field(default=2048, gt=0, description="width of the head's MLP")
    bottleneck_dim: int = Field(default=256, gt=0, description="width before the L2-normalised last layer")
    head_layers: int = Field(default=3, ge=1, description="linear layers of the MLP")
    norm_last_layer: bool = Field(default=True, description="unit-norm rows of the last layer (weight norm, gain 1)")
    global_views: int = Field(default=2, ge=1, description="large crops, seen by the teacher and the student")
    local_views: int = Field(default=8, ge=0, description="small crops, seen by the student only")
    local_size: int | None = Field(
        default=None,
        gt=0,
        description="side of a local crop; null: 3/7 of model.img_size (96 of 224), a multiple of 32",
    )
    global_scale: tuple[float, float] = Field(default=(0.4, 1.0), description="area range of a global crop")
    local_scale: tuple[float, float] = Field(default=(0.05, 0.4), description="area range of a local crop")
    student_temp: float = Field(default=0.1, gt=0.0)
    teacher_temp: float = Field(default=0.04, gt=0.0, description="after the warm-up")
    warmup_teacher_temp: float = Field(default=0.04, gt=0.0, description="at the start of training")
    teacher_temp_warmup: float = Field(
        default=0.0, ge=0.0, le=1.0, description="fraction of training over which the temperature warms up"
    )
    teacher_momentum: float = Field(default=0.996, ge=0.0, le=1.0, description="EMA momentum at the start (to 1)")
    centre_momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    export: Literal["teacher", "student"] = Field(
        default="teacher", description="central runs: whose backbone is exported (federated: the global student)"
    )

    @model_validator(mode="after")
    def _check(self) -> DinoOptions:
        if self.global_views + self.local_views < 2:
            raise ValueError("the loss compares pairs of views: global_views + local_views must be at least 2")
        for name, (low, high) in (("global_scale", self.global_scale), ("local_scale", self.local_scale)):
            if not 0.0 < low <= high <= 1.0:
                raise ValueError(f"{name} {[low, high]} must be 0 < low <= high <= 1 (fractions of the image's area)")
        return self


def local_crop_size(cfg: PretrainingConfig, options: DinoOptions) -> int:
    """``local_size``, or 3/7 of the model's input (DINO's 96 of 224) rounded to a multiple of 32, at least 32."""
    if options.local_size is not None:
        return options.local_size
    return max(SWIN_STRIDE, round(cfg.model.img_size * 3 / 7 / SWIN_STRIDE) * SWIN_STRIDE)


class SelfDistillation(PretrainingObjective):
    """DINO: a student matches an EMA teacher's sharpened, centred outputs across multi-crop views."""

    Options = DinoOptions
    log_keys = ("loss", "teacher_entropy")

    def __init__(self, cfg: PretrainingConfig) -> None:
        super().__init__(cfg)
        self.options: DinoOptions = self.options_of(cfg)
        self.teacher: EmaTeacher | None = None
        self.centre: torch.Tensor | None = None
        self.progress = 0.0
        self._teacher_means: list[torch.Tensor] = []

    @classmethod
    def check_config(cls, cfg: PretrainingConfig, architecture: bool = True) -> None:
        options = cls.options_of(cfg, architecture)
        if cfg.model.distill_block is not None:
            raise ValueError("model.distill_block taps a ViT for GFM's distillation; DINO reads no tap")
        if not architecture:
            return
        patch = arch_info(cfg.model.arch, cfg.model.timm_kwargs).patch_size
        local = local_crop_size(cfg, options)
        if local % patch or cfg.model.img_size % patch:
            raise ValueError(
                f"task_options.local_size {local} and model.img_size {cfg.model.img_size} must be multiples of the "
                f"backbone's patch size {patch}"
            )

    # ---- the model ----------------------------------------------------------------------------
    def build_model(self, initial_weights: bool = True) -> DinoStudent:
        """The student: a backbone taking any input size (``dynamic_img_size``) and the projection head;
        with ``initial_weights`` and ``model.init_checkpoint``, the backbone starts from that file."""
        from geofm.checkpoints.build import load_backbone_for_bands
        from geofm.tasks.dino.model import DinoStudent, ProjectionHead

        cfg, options = self.cfg, self.options
        encoder = create_backbone(
            cfg.model.arch, {**student_kwargs(cfg), "dynamic_img_size": True}, drop_path_rate=cfg.model.drop_path_rate
        )
        head = ProjectionHead(
            encoder.num_features,
            options.out_dim,
            options.hidden_dim,
            options.bottleneck_dim,
            options.head_layers,
            options.norm_last_layer,
        )
        model = DinoStudent(encoder, head)
        if initial_weights and cfg.model.init_checkpoint is not None:
            report = load_backbone_for_bands(model.encoder, cfg.model.init_checkpoint, cfg.data.bands)
            log.info("student backbone initialised from %s: %s", cfg.model.init_checkpoint, report)
        return model

    def prepare(self, model: DinoStudent) -> None:
        """The teacher starts as a copy of ``model`` (a client: of the global student it received), on
        this machine's device; the centre, as the teacher's mean output on the first batch."""
        from geofm.tasks.dino.model import EmaTeacher

        prefer_fused_attention(model, self.device)
        self.teacher = EmaTeacher(model).to(self.device)
        prefer_fused_attention(self.teacher, self.device)
        self.centre = None
        self._teacher_means = []

    def pile(self, shares: list[list[Path]] | None = None) -> PretrainPile:
        """Samples with their ``global`` and ``local`` views."""
        from geofm.tasks.dino.views import MultiCrop

        cfg, options = self.cfg, self.options
        views = MultiCrop(
            cfg.model.img_size,
            local_crop_size(cfg, options),
            options.global_views,
            options.local_views,
            options.global_scale,
            options.local_scale,
            hflip=cfg.data.hflip,
            vflip=cfg.data.vflip,
        )
        return share_pile(cfg, shares, views=views)

    def local_batches(self, shares: list[list[Path]], steps: int, rnd: int, seed: int) -> Iterator[list[dict]]:
        """A client's round, the schedules starting at the fraction of training its round begins at."""
        self.progress = (rnd - 1) / self.cfg.federation.rounds
        yield from super().local_batches(shares, steps, rnd, seed)

    # ---- a step -------------------------------------------------------------------------------
    def forward(self, model, batch: dict) -> StepOutput:
        """The DINO loss of one micro-batch, with the teacher's entropy (a collapse shows as 0 or log K)."""
        from geofm.tasks.dino.loss import dino_loss, entropy, teacher_temperature
        from geofm.training.engine import mean_across_ranks

        options = self.options
        global_views = batch["global"].to(self.device, self.dtype, non_blocking=True).unbind(1)
        views = list(global_views)
        if "local" in batch:
            views += batch["local"].to(self.device, self.dtype, non_blocking=True).unbind(1)
        teacher_logits = self.teacher(global_views)
        self._teacher_means.append(teacher_logits.mean(dim=0))
        if self.centre is None:  # a run's (or a federated round's) first batch: centred from its first step
            self.centre = mean_across_ranks(self._teacher_means[0])
        temperature = teacher_temperature(
            self.progress, options.warmup_teacher_temp, options.teacher_temp, options.teacher_temp_warmup
        )
        loss, probabilities = dino_loss(
            model(views), teacher_logits, self.centre, options.student_temp, temperature, options.global_views
        )
        return StepOutput({"loss": loss, "teacher_entropy": entropy(probabilities).detach()})

    def after_step(self, model: DinoStudent, progress: float) -> None:
        """The teacher's EMA step towards the student, the centre's towards this step's teacher outputs
        (their mean over micro-batches and processes)."""
        import torch

        from geofm.tasks.dino.loss import teacher_momentum, updated_centre
        from geofm.training.engine import mean_across_ranks

        self.teacher.update(model, teacher_momentum(progress, self.options.teacher_momentum))
        if self._teacher_means:
            mean = mean_across_ranks(torch.stack(self._teacher_means).mean(dim=0))
            self.centre = updated_centre(self.centre, mean, self.options.centre_momentum)
        self._teacher_means = []
        self.progress = progress

    def state_dict(self) -> dict:
        """The teacher, the centre and the progress of the schedules reached."""
        return {"teacher": self.teacher.state_dict(), "centre": self.centre.cpu(), "progress": self.progress}

    def load_state_dict(self, state: dict) -> None:
        self.teacher.load_state_dict(state["teacher"])
        self.centre = state["centre"].to(self.device)
        self.progress = float(state["progress"])

    # ---- the end ------------------------------------------------------------------------------
    def export(self, model: DinoStudent, run_dir: Path, step: int, final: dict | None, extra: dict) -> Path:
        """The teacher's backbone (``export: teacher``, central runs), else the student's."""
        central = not isinstance(self.cfg, FederatedConfig)
        network = self.teacher.network if central and self.options.export == "teacher" else model
        return export_pretrained(self.cfg, network.encoder, run_dir, step, final, method="dino", extra=extra)


__all__ = ["DinoOptions", "SelfDistillation", "local_crop_size"]
