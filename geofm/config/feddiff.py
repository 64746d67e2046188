"""The config of FedDiff: one-shot federated classification through class-conditional diffusion models.

A FedDiff config is a classification finetuning config (:class:`~geofm.config.finetune.FinetuneConfig`:
``task``, ``checkpoint``, ``model``, ``head``, ``data``, ``finetune``, ``train``: the global
classifier the server trains on the synthetic set) with two more sections: ``federation`` (the
clients: a sample partitioner dealing the train split, as in federated finetuning; one round) and
``diffusion`` (:class:`DiffusionConfig`: each client's U-Net and its training, the server's sampling,
Fourier magnitude filtering and differential privacy). What it shares with OSCAR and ensemble
distillation is :mod:`geofm.config.oneshot`. See :mod:`federation.programs.feddiff`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from geofm.config.algorithm import NOISE_SEED
from geofm.config.base import Section
from geofm.config.oneshot import DDPMConfig, DiffusionOneShotConfig, UNetConfig


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


class DiffusionConfig(DDPMConfig):
    """The clients' diffusion models, their training, and the server's sampling and filtering."""

    epochs: int = Field(default=50, gt=0, description="passes over a client's samples")
    batch_size: int = Field(default=32, gt=0, description="a client's batch (under privacy: the expected batch)")
    lr: float = Field(default=2e-4, gt=0.0, description="AdamW learning rate of the clients")
    fmf_gamma: float = Field(
        default=5.0,
        ge=0.0,
        lt=100.0,
        description="Fourier magnitude filtering: per client, the percent of its "
        "samples farthest from its mean magnitude that are dropped (0: none)",
    )
    privacy: DiffusionPrivacyConfig | None = Field(default=None, description="null: no differential privacy")


class FedDiffConfig(DiffusionOneShotConfig):
    """FedDiff (see the module docstring and :class:`~geofm.config.oneshot.OneShotConfig`)."""

    method: ClassVar[str] = "FedDiff"

    diffusion: DiffusionConfig = DiffusionConfig()


__all__ = ["DiffusionConfig", "DiffusionPrivacyConfig", "FedDiffConfig", "UNetConfig"]
