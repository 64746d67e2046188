"""The config of ensemble distillation: one-shot federated classification through the clients' finetuned models.

An ensemble config is a one-shot config (:class:`~geofm.config.oneshot.OneShotConfig`: a
classification finetuning config, ``train`` being each client's finetuning of its share, with
``federation``: the clients, one round) with one more section, ``ensemble``
(:class:`DistillationConfig`: the public images, the temperature, the teachers' weighting and the
student's training). See :mod:`federation.programs.ensemble`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from geofm.config.base import Section
from geofm.config.oneshot import OneShotConfig, check_public_images

PUBLIC = "(the public unlabelled images the student learns the clients' soft labels on)"
"""What ``ensemble.public`` names, in the message of a missing folder."""


class DistillationConfig(Section):
    """The server's ensemble distillation: the clients' averaged soft labels on public images, learnt by the student."""

    public: Path = Field(
        description="a folder of unlabelled images of the dataset's bands (files ending in data.suffixes, searched "
        "recursively), which no client holds; each is cut into model.img_size tiles spread evenly over it"
    )
    temperature: float = Field(default=3.0, gt=0.0, description="T of the softened teacher and student softmax")
    weighting: Literal["examples", "uniform"] = Field(
        default="examples", description="the teachers' probabilities averaged by their example counts, or plainly"
    )
    student_init: Literal["average", "checkpoint"] = Field(
        default="average",
        description="the student starts as the clients' weights averaged by their example counts, or from checkpoint",
    )
    epochs: int = Field(default=20, gt=0, description="passes over the public images")
    batch_size: int = Field(default=32, gt=0, description="public images per step")
    lr: float = Field(default=5.0e-4, gt=0.0, description="AdamW learning rate of the student (no decay, constant)")


class EnsembleConfig(OneShotConfig):
    """Ensemble distillation (FedDF-style, no generator): ``train`` is each client's finetuning on its share."""

    method: ClassVar[str] = "ensemble distillation"

    ensemble: DistillationConfig

    def check_server_inputs(self) -> None:
        """The public images the server distils on, before the clients train.

        Raises:
            ConfigError: naming ``ensemble.public`` and the folder that is missing or holds no image.
        """
        check_public_images(self.ensemble.public, self.data.suffixes, "ensemble.public", PUBLIC)


__all__ = ["DistillationConfig", "EnsembleConfig"]
