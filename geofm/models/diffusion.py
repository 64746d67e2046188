"""Class-conditional DDPM on multi-band images: diffusers' U-Net and scheduler, the training loss, the sampler.

The model is ``diffusers.UNet2DModel`` with a class embedding added to its timestep embedding
(``num_class_embeds``), residual down and up blocks (``DownBlock2D``/``UpBlock2D``; with
``unet.attention`` the lowest level's blocks attend), GroupNorm throughout: the "basic U-Net with
residual blocks and class conditioning" of FedDiff, on as many bands as the data has. The noise
schedule is DDPM's (Ho, Jain and Abbeel, NeurIPS 2020: linear betas from 1e-4 to 0.02 over
``timesteps``), the loss the mean squared error of the predicted noise, and sampling DDPM's ancestral
sampler over ``steps`` evenly spaced timesteps (all ``timesteps`` of them in the paper). Images are
the normalised bands the finetuning datasets deliver (about zero mean, unit variance), so samples are
not clipped to [-1, 1].

OSCAR's server model is the same U-Net conditioned on an encoder's embedding instead of a class
(:class:`EmbeddingUNet`), trained with condition dropout and sampled with classifier-free guidance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.models.unets.unet_2d import UNet2DOutput
from torch import Tensor, nn

if TYPE_CHECKING:  # the config schema stays out of the model code's imports, as for the teacher
    from geofm.config.oneshot import DDPMConfig


def _unet(cfg: DDPMConfig, bands: int, size: int, **conditioning: object) -> UNet2DModel:
    """The U-Net of ``cfg.unet`` for ``bands``-band images of ``size`` pixels, with diffusers' ``conditioning`` kwargs."""
    unet = cfg.unet
    levels = len(unet.channels)
    down = ["DownBlock2D"] * levels
    up = ["UpBlock2D"] * levels
    if unet.attention:
        down[-1], up[0] = "AttnDownBlock2D", "AttnUpBlock2D"
    return UNet2DModel(
        sample_size=size,
        in_channels=bands,
        out_channels=bands,
        layers_per_block=unet.layers_per_block,
        block_out_channels=tuple(unet.channels),
        down_block_types=tuple(down),
        up_block_types=tuple(up),
        norm_num_groups=unet.norm_groups,
        add_attention=unet.attention,
        **conditioning,
    )


def build_unet(cfg: DDPMConfig, bands: int, classes: int, size: int) -> UNet2DModel:
    """The class-conditional U-Net of ``cfg.unet`` for ``bands``-band images of ``size`` pixels and ``classes`` classes."""
    return _unet(cfg, bands, size, num_class_embeds=classes)


class EmbeddingUNet(nn.Module):
    """A U-Net conditioned on a continuous embedding (B, ``condition_dim``): a linear projection to the
    timestep embedding's size, added to it (diffusers' ``class_embed_type="identity"``). The null
    condition of classifier-free guidance is the zero vector."""

    def __init__(self, unet: UNet2DModel, condition_dim: int) -> None:
        super().__init__()
        self.unet = unet
        self.project = nn.Linear(condition_dim, unet.time_embedding.linear_2.out_features)

    @property
    def config(self) -> Any:
        """The U-Net's diffusers config (``sample_size``, ``in_channels``)."""
        return self.unet.config

    @property
    def condition_dim(self) -> int:
        return self.project.in_features

    def forward(self, sample: Tensor, timestep: Tensor | int, class_labels: Tensor) -> UNet2DOutput:
        return self.unet(sample, timestep, class_labels=self.project(class_labels))


def build_embedding_unet(cfg: DDPMConfig, bands: int, condition_dim: int, size: int) -> EmbeddingUNet:
    """The U-Net of ``cfg.unet`` conditioned on ``condition_dim``-dimensional embeddings (:class:`EmbeddingUNet`)."""
    return EmbeddingUNet(_unet(cfg, bands, size, class_embed_type="identity"), condition_dim)


def drop_conditions(conditions: Tensor, p_uncond: float, generator: torch.Generator) -> Tensor:
    """Classifier-free guidance's condition dropout: each row replaced by the null (zero) condition with
    probability ``p_uncond``, drawn from ``generator``."""
    keep = torch.rand(len(conditions), generator=generator, device=conditions.device) >= p_uncond
    return conditions * keep.to(conditions.dtype).view(-1, *[1] * (conditions.dim() - 1))


def guided_noise(conditional: Tensor, unconditional: Tensor, guidance_scale: float) -> Tensor:
    """Classifier-free guidance (Ho and Salimans, 2022): ``(1 + w) eps(x, c) - w eps(x, null)``; ``w = 0``
    is the conditional model alone."""
    return (1 + guidance_scale) * conditional - guidance_scale * unconditional


def build_scheduler(cfg: DDPMConfig) -> DDPMScheduler:
    """DDPM's linear noise schedule over ``cfg.timesteps`` steps, without clipping samples."""
    return DDPMScheduler(num_train_timesteps=cfg.timesteps, beta_schedule="linear", clip_sample=False)


def diffusion_loss(
    model: torch.nn.Module, scheduler: DDPMScheduler, images: Tensor, labels: Tensor, generator: torch.Generator
) -> Tensor:
    """DDPM's simple loss of a batch: ``|| eps - eps_theta(sqrt(abar_t) x + sqrt(1 - abar_t) eps, t, y) ||^2``,
    with ``t`` uniform over the timesteps and ``eps`` standard normal, both drawn from ``generator``."""
    noise = torch.randn(images.shape, generator=generator, device=images.device, dtype=images.dtype)
    t = torch.randint(
        0, scheduler.config.num_train_timesteps, (len(images),), generator=generator, device=images.device
    )
    noisy = scheduler.add_noise(images, noise, t)
    return torch.nn.functional.mse_loss(model(noisy, t, class_labels=labels).sample, noise)


@torch.no_grad()
def sample(
    model: nn.Module,
    scheduler: DDPMScheduler,
    labels: Tensor,
    steps: int,
    generator: torch.Generator,
    guidance_scale: float | None = None,
) -> Tensor:
    """Images conditioned on ``labels`` (class ids (N,), or embeddings (N, D) of an :class:`EmbeddingUNet`)
    drawn by DDPM's ancestral sampler over ``steps`` timesteps, all noise from ``generator`` (on the
    model's device). With ``guidance_scale`` each step's noise is :func:`guided_noise` against the zero
    condition, both predictions in one forward pass."""
    device = next(model.parameters()).device
    scheduler.set_timesteps(steps, device=device)
    size = model.config.sample_size
    x = torch.randn((len(labels), model.config.in_channels, size, size), generator=generator, device=device)
    labels = labels.to(device)
    if guidance_scale is not None:
        labels = torch.cat([labels, torch.zeros_like(labels)])
    for t in scheduler.timesteps:
        if guidance_scale is None:
            eps = model(x, t, class_labels=labels).sample
        else:
            eps = guided_noise(*model(torch.cat([x, x]), t, class_labels=labels).sample.chunk(2), guidance_scale)
        x = scheduler.step(eps, t, x, generator=generator).prev_sample
    return x


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's weights as float32 numpy arrays by state-dict key (what a client uploads)."""
    return {key: value.detach().cpu().float().numpy() for key, value in model.state_dict().items()}


def load_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    """Load uploaded weights (:func:`model_arrays`) into a model of the same architecture, every key required."""
    model.load_state_dict({key: torch.from_numpy(np.asarray(value)) for key, value in arrays.items()})
    return model


__all__ = [
    "EmbeddingUNet",
    "build_embedding_unet",
    "build_scheduler",
    "build_unet",
    "diffusion_loss",
    "drop_conditions",
    "guided_noise",
    "load_arrays",
    "model_arrays",
    "sample",
]
