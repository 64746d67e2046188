"""The config of central pretraining (``geofm pretrain``)."""

from __future__ import annotations

from pydantic import ValidationInfo, model_validator

from geofm.config.base import ProgramConfig, checks_architecture
from geofm.config.sections import (
    MaskingConfig,
    RunConfig,
    StudentConfig,
    TeacherConfig,
    TrainConfig,
    check_masked_pretraining,
)
from geofm.config.sources import DataConfig


class PretrainConfig(ProgramConfig):
    """Continual pretraining: SimMIM, plus GFM distillation when a teacher is set."""

    run: RunConfig
    model: StudentConfig
    masking: MaskingConfig = MaskingConfig()
    teacher: TeacherConfig | None = None
    data: DataConfig
    train: TrainConfig

    @model_validator(mode="after")
    def _check_combination(self, info: ValidationInfo) -> PretrainConfig:
        check_masked_pretraining(
            self.model, self.masking, self.teacher, self.data, architecture=checks_architecture(info)
        )
        return self
