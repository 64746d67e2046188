"""The config of central pretraining (``geofm pretrain``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.base import ProgramConfig, checks_architecture
from geofm.config.sections import MaskingConfig, RunConfig, StudentConfig, TeacherConfig, TrainConfig
from geofm.config.sources import DataConfig
from geofm.tasks import TASKS


def check_pretraining_task(cfg: Any, info: ValidationInfo) -> None:
    """The pretraining objective's own rules on ``cfg`` (its ``task_options``, the sections it reads);
    the checks that build the architecture with the second pass.

    Raises:
        ValueError: a finetuning task, or naming the field the objective refuses.
    """
    task = TASKS.get(cfg.task)
    if getattr(task, "kind", None) != "pretraining":
        raise ValueError(f"task {cfg.task!r} is not a pretraining objective; geofm finetune runs finetuning tasks")
    task.check_config(cfg, architecture=checks_architecture(info))


class PretrainingConfig(ProgramConfig):
    """The sections every pretraining program reads, central or federated: the run, the student, the
    data, and the objective (``task``, its ``task_options``; ``masking`` and ``teacher`` are masked
    image modelling's), checked by the objective itself."""

    run: RunConfig
    model: StudentConfig
    masking: MaskingConfig = MaskingConfig()
    teacher: TeacherConfig | None = None
    data: DataConfig
    task: str = Field(default="mim", description="the registered pretraining objective (geofm list tasks)")
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="the objective's own settings, checked by its Options model"
    )

    @field_validator("task")
    @classmethod
    def _registered_task(cls, name: str) -> str:
        return TASKS.check(name)

    @model_validator(mode="after")
    def _check_task(self, info: ValidationInfo) -> PretrainingConfig:
        check_pretraining_task(self, info)
        return self


class PretrainConfig(PretrainingConfig):
    """Continual pretraining with a registered objective: masked image modelling (SimMIM, plus GFM
    distillation when a teacher is set) by default, or self-distillation (``task: dino``)."""

    train: TrainConfig
