"""The configs of one-shot federated classification: each client uploads once, the server builds the classifier.

:class:`OneShotConfig` is what every one-shot program shares: a classification finetuning config
(:class:`~geofm.config.finetune.FinetuneConfig`: ``task``, ``checkpoint``, ``model``, ``head``,
``data``, ``finetune``, ``train``) with a ``federation`` section (a sample partitioner dealing the
train split to ``federation.clients`` clients, exactly one round, every client in it). FedDiff
(:mod:`geofm.config.feddiff`) and the ensemble distillation baseline (:class:`EnsembleConfig`, its
``ensemble`` section :class:`DistillationConfig`) add their own section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from geofm.config.base import Section
from geofm.config.fedfinetune import FinetuneFederationConfig
from geofm.config.finetune import FinetuneConfig


class OneShotConfig(FinetuneConfig):
    """A classification finetuning config whose clients each upload once (see the module docstring)."""

    federation: FinetuneFederationConfig

    @model_validator(mode="after")
    def _check_one_shot(self) -> OneShotConfig:
        fed, program = self.federation, self.program_name
        if self.task != "classification":
            raise ValueError(f"task: {program} is one-shot federated classification, got {self.task!r}")
        if self.data.class_names is None:
            raise ValueError(
                "data.class_names: the split folders a one-shot program writes (a client's share, FedDiff's synthetic "
                "images) have one folder per class name, and may lack classes"
            )
        if fed.rounds != 1:
            raise ValueError(f"federation.rounds: {program} is one-shot (each client uploads once), got {fed.rounds}")
        if fed.clients is None:
            raise ValueError(f"federation.partition {fed.partition} needs federation.clients")
        if fed.fraction != 1.0:
            raise ValueError("federation.fraction: every client uploads its model in the one round (expected 1)")
        if (fed.partition == "by_field" or fed.where) and fed.metadata is None:
            raise ValueError("federation.partition by_field and federation.where need federation.metadata (a CSV file)")
        if fed.public_sources:
            raise ValueError(f"federation.public_sources: {program} has no public pretraining source")
        if fed.min_clients > fed.clients:
            raise ValueError(f"federation.min_clients {fed.min_clients} exceeds federation.clients {fed.clients}")
        return self

    @property
    def program_name(self) -> str:
        """The program's name in error messages."""
        return "a one-shot program"

    @property
    def client_names(self) -> list[str]:
        """``client00``, ``client01``, ... (``federation.clients`` of them)."""
        from geofm.federated.scenarios import client_names

        return client_names(self.federation.clients)

    def for_node(self, institution: str, data_root: str | None, teacher: str | None) -> OneShotConfig:
        """The config as one institution's machine sees it: ``data_root`` replaces ``data.root`` (the node
        trains on all of its own train split; ``teacher`` does not apply)."""
        if not data_root:
            return self
        return self.model_copy(update={"data": self.data.model_copy(update={"root": Path(data_root)})})

    def central(self, train: Path | None, output_dir: Path, validate: bool = True) -> FinetuneConfig:
        """The central finetuning config of this config's backbone and head trained on the ``train`` split
        folder (None: the configured train split), writing to ``output_dir``; without ``validate``, no
        validation split (the final weights are kept)."""
        splits = self.data.splits if train is None else {**self.data.splits, "train": str(train.resolve())}
        data = self.data.model_copy(update={"splits": splits})
        run = self.run.model_copy(update={"output_dir": output_dir})
        fields = {name: getattr(self, name) for name in FinetuneConfig.model_fields}
        if not validate:
            fields["finetune"] = self.finetune.model_copy(update={"val_split": None})
        return FinetuneConfig.model_validate({**fields, "data": data, "run": run})


class DistillationConfig(Section):
    """The server's ensemble distillation: the clients' averaged soft labels on public images, learnt by the student."""

    public: Path = Field(
        description="a folder of unlabelled GeoTIFFs of the dataset's bands (searched recursively), which no "
        "client holds; each is cut into model.img_size tiles spread evenly over it"
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

    ensemble: DistillationConfig

    @property
    def program_name(self) -> str:
        return "ensemble distillation"


__all__ = ["DistillationConfig", "EnsembleConfig", "OneShotConfig"]
