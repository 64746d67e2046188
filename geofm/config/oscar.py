"""The config of OSCAR-style one-shot federated classification: a server diffusion model guided by client embeddings.

After OSCAR (Zaland et al., "One-Shot Federated Learning with Classifier-Free Diffusion Models",
2025). An OSCAR config is a one-shot config (:class:`~geofm.config.oneshot.DiffusionOneShotConfig`:
the global classifier, ``federation``, ``diffusion``: the server's U-Net, its training on the public
imagery and the sampling) with an ``oscar`` section (:class:`OscarSection`: the shared encoder, the
server's public imagery, condition dropout, the guidance scale, a server model trained earlier).
See :mod:`federation.programs.oscar`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from geofm.checkpoints.layouts import export_architecture
from geofm.config.base import Section
from geofm.config.oneshot import DiffusionOneShotConfig, check_public_images
from geofm.config.sections import BackboneConfig
from geofm.errors import ConfigError
from geofm.models.backbones import arch_info


class EncoderConfig(Section):
    """The encoder every client and the server embed images with: a geofm backbone's pooled global features."""

    checkpoint: Path | None = Field(
        default=None, description="backbone weights in any layout geofm.checkpoints reads; null: random init"
    )
    model: BackboneConfig

    @model_validator(mode="after")
    def _check_width(self) -> EncoderConfig:
        """An export's recorded architecture must give the stated model's widths (read from its JSON sidecar)."""
        recorded = None if self.checkpoint is None else export_architecture(self.checkpoint)
        if recorded is None:
            return self
        sidecar, fields = recorded
        mine = arch_info(self.model.arch, self.model.timm_kwargs).embed_dims
        theirs = arch_info(fields["arch"], fields.get("timm_kwargs")).embed_dims
        if mine != theirs:
            raise ValueError(
                f"oscar.encoder.checkpoint {self.checkpoint}: its backbone ({sidecar}) has embed dims {list(theirs)}, "
                f"oscar.encoder.model {self.model.arch} with timm_kwargs {self.model.timm_kwargs} has {list(mine)}"
            )
        return self


class OscarSection(Section):
    """The server's generative model and how the clients' embeddings guide it."""

    public: Path = Field(
        description="the server's public imagery: a folder of GeoTIFFs in the dataset's bands, searched recursively "
        "(a classification split folder's class names are ignored); random crops of model.img_size train the server's U-Net"
    )
    encoder: EncoderConfig | None = Field(
        default=None,
        description="null: the config's own model and checkpoint (the classifier's backbone before finetuning)",
    )
    p_uncond: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description="condition dropout: the chance a training image gets the null (zero) condition",
    )
    guidance_scale: float = Field(
        default=2.0,
        ge=0.0,
        description="w of classifier-free guidance, eps = (1 + w) eps(x, c) - w eps(x, null) (0: conditional alone)",
    )
    diffusion_checkpoint: Path | None = Field(
        default=None,
        description="a server model an OSCAR run wrote (server_model.safetensors), used instead of training one",
    )


class OscarConfig(DiffusionOneShotConfig):
    """OSCAR (see the module docstring)."""

    method: ClassVar[str] = "OSCAR"

    oscar: OscarSection

    @property
    def encoder(self) -> EncoderConfig:
        """``oscar.encoder``, or the config's own model and checkpoint."""
        return self.oscar.encoder or EncoderConfig(checkpoint=self.checkpoint, model=self.model)

    def check_server_inputs(self) -> None:
        """The files only the server reads: the public imagery (unless a trained server model is named) and
        that model.

        Raises:
            ConfigError: naming the field and the absolute path that is missing or holds no image.
        """
        o = self.oscar
        if o.diffusion_checkpoint is not None:
            if not o.diffusion_checkpoint.is_file():
                raise ConfigError(f"oscar.diffusion_checkpoint: no file {o.diffusion_checkpoint.resolve()}")
            return
        check_public_images(
            o.public,
            self.data.suffixes,
            "oscar.public",
            "(the server's public imagery, which trains its diffusion model); name a folder of GeoTIFFs, or a "
            "trained model in oscar.diffusion_checkpoint",
        )


__all__ = ["EncoderConfig", "OscarConfig", "OscarSection"]
