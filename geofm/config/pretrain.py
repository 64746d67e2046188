"""The config of central pretraining (``geofm pretrain``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.base import ProgramConfig, checks_architecture
from geofm.config.sections import DataConfig, MaskingConfig, RunConfig, StudentConfig, TeacherConfig, TrainConfig
from geofm.tasks import TASKS

TASK_FIELD = Field(default="mim", description="the registered pretraining objective (geofm list tasks): mim, dino...")
TASK_OPTIONS_FIELD = Field(
    default_factory=dict, description="the objective's own settings, checked by its Options model"
)


def registered_task(name: str) -> str:
    """``name`` if :data:`~geofm.tasks.TASKS` has it, else ValueError with the nearest names."""
    return TASKS.check(name)


def check_pretraining_task(cfg: Any, info: ValidationInfo) -> None:
    """The pretraining objective's own rules on ``cfg`` (its ``task_options``, the sections it reads),
    with the architecture's checks: the task's module imports torch.

    Raises:
        ValueError: a finetuning task, or naming the field the objective refuses.
    """
    if not checks_architecture(info):
        return
    task = TASKS.get(cfg.task)
    if getattr(task, "kind", None) != "pretraining":
        raise ValueError(f"task {cfg.task!r} is not a pretraining objective; geofm finetune runs finetuning tasks")
    task.check_config(cfg)


class PretrainConfig(ProgramConfig):
    """Continual pretraining with a registered objective: masked image modelling (SimMIM, plus GFM
    distillation when a teacher is set) by default, or self-distillation (``task: dino``)."""

    run: RunConfig
    model: StudentConfig
    masking: MaskingConfig = MaskingConfig()
    teacher: TeacherConfig | None = None
    data: DataConfig
    train: TrainConfig
    task: str = TASK_FIELD
    task_options: dict[str, Any] = TASK_OPTIONS_FIELD

    @field_validator("task")
    @classmethod
    def _registered_task(cls, name: str) -> str:
        return registered_task(name)

    @model_validator(mode="after")
    def _check_combination(self, info: ValidationInfo) -> PretrainConfig:
        check_pretraining_task(self, info)
        return self
