"""What the one-shot federated classification programs share: the clients, the classifier, the DDPM settings.

A one-shot config (:class:`OneShotConfig`) is a classification finetuning config
(:class:`~geofm.config.finetune.FinetuneConfig`: ``task``, ``checkpoint``, ``model``, ``head``,
``data``, ``finetune``, ``train``: the global classifier the server builds) with a ``federation``
section (the clients: a sample partitioner dealing the train split, as in federated finetuning; one
round, every client in it). Ensemble distillation (:mod:`geofm.config.ensemble`) adds its own section;
the programs that train the classifier on a synthetic set of diffusion samples
(:class:`DiffusionOneShotConfig`), FedDiff (:mod:`geofm.config.feddiff`) and OSCAR
(:mod:`geofm.config.oscar`), add ``diffusion`` (:class:`DDPMConfig`, extended by each).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from geofm.config.base import Section
from geofm.config.federated import FederatedProgramConfig
from geofm.config.fedfinetune import FinetuneFederationConfig, client_names
from geofm.config.finetune import FinetuneConfig
from geofm.errors import ConfigError

CLASSIFIER = "classifier"
"""The global classifier's run folder in the run directory."""


class UNetConfig(Section):
    """A diffusion model's U-Net (``diffusers.UNet2DModel``): residual blocks, no attention by default."""

    channels: list[int] = Field(default=[32, 64, 64], min_length=1, description="channels of each resolution level")
    layers_per_block: int = Field(default=1, gt=0, description="residual blocks per level")
    norm_groups: int = Field(
        default=8, gt=0, description="groups of the GroupNorm layers (divides every channel count)"
    )
    attention: bool = Field(
        default=False, description="self-attention at the lowest resolution (diffusers' AttnDownBlock2D/AttnUpBlock2D)"
    )

    @model_validator(mode="after")
    def _check(self) -> UNetConfig:
        if any(c % self.norm_groups for c in self.channels):
            raise ValueError(
                f"diffusion.unet.norm_groups {self.norm_groups} must divide every channel count {self.channels}"
            )
        return self


class DDPMConfig(Section):
    """A DDPM's U-Net, its training and the server's sampling."""

    unet: UNetConfig = UNetConfig()
    timesteps: int = Field(default=1000, gt=1, description="T of the DDPM forward process (linear betas)")
    epochs: int = Field(default=50, gt=0, description="passes over the training images")
    batch_size: int = Field(default=32, gt=0, description="the training batch")
    lr: float = Field(default=2e-4, gt=0.0, description="AdamW learning rate")
    sampling_steps: int = Field(default=1000, gt=0, description="DDPM steps per sample (the papers: 1000)")
    sample_batch: int = Field(default=64, gt=0, description="samples the server generates per forward pass")
    samples: Literal["as_data"] | int = Field(
        default="as_data",
        description="per client and class: as many as the client holds (the paper), or this many of each class it holds",
    )

    @model_validator(mode="after")
    def _check_sampling(self) -> DDPMConfig:
        if self.sampling_steps > self.timesteps:
            raise ValueError(
                f"diffusion.sampling_steps {self.sampling_steps} exceeds diffusion.timesteps {self.timesteps}"
            )
        if isinstance(self.samples, int) and self.samples < 1:
            raise ValueError(f"diffusion.samples must be 'as_data' or a positive count, got {self.samples}")
        return self


class OneShotConfig(FederatedProgramConfig, FinetuneConfig):
    """A classification finetuning config whose clients each upload once (see the module docstring)."""

    method: ClassVar[str] = "a one-shot program"
    """The program's name in error messages."""

    federation: FinetuneFederationConfig

    @model_validator(mode="after")
    def _check_one_shot(self) -> OneShotConfig:
        fed, method = self.federation, self.method
        if self.task != "classification":
            raise ValueError(f"task: {method} is one-shot federated classification, got {self.task!r}")
        if self.data.class_names is None:
            raise ValueError(
                "data.class_names: the split folders a one-shot program writes (a client's share, the synthetic "
                "images) have one folder per class name, and may lack classes"
            )
        if fed.rounds != 1:
            raise ValueError(f"federation.rounds: {method} is one-shot (each client uploads once), got {fed.rounds}")
        if fed.clients is None:
            raise ValueError(f"federation.partition {fed.partition} needs federation.clients")
        if fed.fraction != 1.0:
            raise ValueError("federation.fraction: every client uploads in the one round (expected 1)")
        if (fed.partition == "by_field" or fed.where) and fed.metadata is None:
            raise ValueError("federation.partition by_field and federation.where need federation.metadata (a CSV file)")
        if fed.public_sources:
            raise ValueError(f"federation.public_sources: {method} has no public pretraining source")
        if fed.min_clients > fed.clients:
            raise ValueError(f"federation.min_clients {fed.min_clients} exceeds federation.clients {fed.clients}")
        return self

    @property
    def client_names(self) -> list[str]:
        """``client00``, ``client01``, ... (``federation.clients`` of them)."""
        return client_names(self.federation.clients)

    def check_server_inputs(self) -> None:
        """Check the files only the server reads before the round (none here; see the programs' configs)."""

    def all_bands(self) -> OneShotConfig:
        """The config whose samples hold every dataset band: what the diffusion models learn and generate,
        so that a synthetic image is a file of the dataset's own bands."""
        return self.model_copy(update={"data": self.data.model_copy(update={"bands": list(self.data.dataset_bands)})})

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

    def classifier(self, train: Path | None = None) -> FinetuneConfig:
        """The config of the global classifier the server builds: trained on the ``train`` split folder (the
        synthetic set; None: the configured train split), validated and tested on the real splits, writing
        to ``run.output_dir/classifier``."""
        return self.central(train, self.run.output_dir / CLASSIFIER)


class DiffusionOneShotConfig(OneShotConfig):
    """A one-shot config whose server trains the classifier on diffusion samples: ``diffusion`` added."""

    diffusion: DDPMConfig = DDPMConfig()


def public_images(folder: Path, suffixes: list[str]) -> list[Path]:
    """A one-shot server's public images: every file under ``folder`` (recursively, class folders ignored) whose
    name ends in one of ``suffixes`` (``data.suffixes``), sorted; none for a missing folder."""
    endings = tuple(s.lower() for s in suffixes)
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(endings))


def check_public_images(folder: Path, suffixes: list[str], field: str, missing: str) -> None:
    """Refuse a public image folder that is missing (``missing``: what to name instead) or holds no image.

    Raises:
        ConfigError: naming ``field`` and the folder's absolute path.
    """
    if not folder.is_dir():
        raise ConfigError(f"{field}: no folder {folder.resolve()} {missing}")
    if not public_images(folder, suffixes):
        raise ConfigError(f"{field}: {folder.resolve()} holds no image with a suffix of data.suffixes {suffixes}")


__all__ = [
    "CLASSIFIER",
    "DDPMConfig",
    "DiffusionOneShotConfig",
    "OneShotConfig",
    "UNetConfig",
    "check_public_images",
    "public_images",
]
