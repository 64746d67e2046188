"""The config of central pretraining (``geofm pretrain``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.config.base import ProgramConfig, checks_architecture
from geofm.config.sections import RunConfig, StudentConfig, TrainConfig
from geofm.config.sources import DataConfig
from geofm.registry import entry_options
from geofm.tasks import TASKS


def objective_options(task: str, given: dict[str, Any], context: dict | None = None) -> dict[str, Any]:
    """``given``, the ``task_options`` of pretraining objective ``task``, validated by its ``Options``
    model (``context``: pydantic's) and written with every default, as a run keeps each section;
    unchanged for a task that is no pretraining objective (its config is refused for that).

    Raises:
        ValueError: naming ``task_options`` and the bad field, or options for an objective that takes none.
    """
    objective = TASKS.get(task)
    if getattr(objective, "kind", None) != "pretraining":
        return given
    options = entry_options(task, getattr(objective, "Options", None), given, "task_options", context)
    return {} if options is None else options.model_dump(mode="json")


def check_pretraining_task(cfg: Any, info: ValidationInfo) -> None:
    """The pretraining objective's own rules on ``cfg`` (the sections it reads with its ``task_options``);
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
    data, and the objective (``task``) with its own settings (``task_options``: masked image
    modelling's masking and teacher, DINO's head and views), checked by the objective itself."""

    run: RunConfig
    model: StudentConfig
    data: DataConfig
    task: str = Field(default="mim", description="the registered pretraining objective (geofm list tasks)")
    task_options: dict[str, Any] = Field(
        default_factory=dict,
        description="the objective's own settings, checked by its Options model (geofm list tasks) and kept with "
        "every default",
    )

    @field_validator("task")
    @classmethod
    def _registered_task(cls, name: str) -> str:
        return TASKS.check(name)

    @field_validator("task_options")
    @classmethod
    def _objective_options(cls, given: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        task = info.data.get("task")  # absent when the task itself was refused
        return given if task is None else objective_options(task, given, info.context)

    @model_validator(mode="after")
    def _check_task(self, info: ValidationInfo) -> PretrainingConfig:
        check_pretraining_task(self, info)
        return self


class PretrainConfig(PretrainingConfig):
    """Continual pretraining with a registered objective: masked image modelling (SimMIM, plus GFM
    distillation when ``task_options.teacher`` is set) by default, or self-distillation (``task: dino``)."""

    train: TrainConfig
