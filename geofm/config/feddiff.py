"""The config of FedDiff: one-shot federated classification through class-conditional diffusion models.

A FedDiff config is a one-shot config (:class:`~geofm.config.oneshot.OneShotConfig`: a classification
finetuning config, ``train`` being the global classifier the server trains on the synthetic set, with
``federation``: the clients, one round) with one more section, ``diffusion`` (:class:`DiffusionConfig`: each client's U-Net and its training, the server's sampling,
Fourier magnitude filtering and differential privacy). See :mod:`federation.feddiff`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from geofm.config.base import Section
from geofm.config.federated import NOISE_SEED
from geofm.config.finetune import FinetuneConfig
from geofm.config.oneshot import OneShotConfig


class UNetConfig(Section):
    """The clients' class-conditional U-Net (``diffusers.UNet2DModel``): residual blocks, no attention by default."""

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


class DiffusionPrivacyConfig(Section):
    """Differential privacy of a client's upload: DP-SGD for its diffusion model, a bounded mean for its FMF statistic.

    The model: DP-SGD (per-sample clipping to ``clip``, Gaussian noise, Poisson sampling of each batch
    at rate ``batch_size / n``) with the noise multiplier that spends ``epsilon`` over the training's
    steps under Opacus's RDP accountant. The Fourier mean: each image's magnitude clipped to L2 norm
    ``fmf_bound * sqrt(bands * height * width)``, summed, Gaussian noise calibrated to ``fmf_epsilon``,
    divided by the client's count. The reported total composes both in the same accountant.
    """

    epsilon: float = Field(gt=0.0, description="the DP-SGD budget of the diffusion model (the paper: 50, 25, 10)")
    delta: float = Field(default=1e-5, gt=0.0, lt=1.0, description="the delta of every epsilon")
    clip: float = Field(default=1.0, gt=0.0, description="DP-SGD's per-sample gradient norm bound")
    fmf_epsilon: float = Field(default=1.0, gt=0.0, description="the budget of the Fourier magnitude mean")
    fmf_bound: float = Field(
        default=2.0,
        gt=0.0,
        description="a normalised image's Fourier magnitude is clipped to this RMS per pixel and band (L2 norm "
        "fmf_bound * sqrt(bands * height * width))",
    )
    seed: int | None = NOISE_SEED


class DiffusionConfig(Section):
    """The clients' diffusion models, their training, and the server's sampling and filtering."""

    unet: UNetConfig = UNetConfig()
    timesteps: int = Field(default=1000, gt=1, description="T of the DDPM forward process (linear betas)")
    epochs: int = Field(default=50, gt=0, description="passes over a client's samples")
    batch_size: int = Field(default=32, gt=0, description="a client's batch (under privacy: the expected batch)")
    lr: float = Field(default=2e-4, gt=0.0, description="AdamW learning rate of the clients")
    sampling_steps: int = Field(default=1000, gt=0, description="DDPM steps per sample (the paper: 1000)")
    sample_batch: int = Field(default=64, gt=0, description="samples the server generates per forward pass")
    samples: Literal["as_data"] | int = Field(
        default="as_data",
        description="per client and class: as many as the client holds (the paper), or this many of each class it holds",
    )
    fmf_gamma: float = Field(
        default=5.0,
        ge=0.0,
        lt=100.0,
        description="Fourier magnitude filtering: per client, the percent of its "
        "samples farthest from its mean magnitude that are dropped (0: none)",
    )
    privacy: DiffusionPrivacyConfig | None = Field(default=None, description="null: no differential privacy")

    @model_validator(mode="after")
    def _check(self) -> DiffusionConfig:
        if self.sampling_steps > self.timesteps:
            raise ValueError(
                f"diffusion.sampling_steps {self.sampling_steps} exceeds diffusion.timesteps {self.timesteps}"
            )
        if isinstance(self.samples, int) and self.samples < 1:
            raise ValueError(f"diffusion.samples must be 'as_data' or a positive count, got {self.samples}")
        return self


class FedDiffConfig(OneShotConfig):
    """FedDiff (see the module docstring)."""

    diffusion: DiffusionConfig = DiffusionConfig()

    @property
    def program_name(self) -> str:
        return "FedDiff"

    def all_bands(self) -> FedDiffConfig:
        """The config whose samples hold every dataset band: what the diffusion models learn and generate,
        so that a synthetic image is a file of the dataset's own bands."""
        return self.model_copy(update={"data": self.data.model_copy(update={"bands": list(self.data.dataset_bands)})})

    def classifier(self, synthetic: Path) -> FinetuneConfig:
        """The finetuning config of the global classifier: trained on the ``synthetic`` split folder,
        validated and tested on the real splits, writing to ``run.output_dir/classifier``."""
        return self.central(synthetic, self.run.output_dir / "classifier")


__all__ = ["DiffusionConfig", "DiffusionPrivacyConfig", "FedDiffConfig", "UNetConfig"]
