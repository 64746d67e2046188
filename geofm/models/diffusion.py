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
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import DDPMScheduler, UNet2DModel
from torch import Tensor

from geofm.config.feddiff import DiffusionConfig


def build_unet(cfg: DiffusionConfig, bands: int, classes: int, size: int) -> UNet2DModel:
    """The class-conditional U-Net of ``cfg.unet`` for ``bands``-band images of ``size`` pixels and ``classes`` classes."""
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
        num_class_embeds=classes,
        add_attention=unet.attention,
    )


def build_scheduler(cfg: DiffusionConfig) -> DDPMScheduler:
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
    model: UNet2DModel, scheduler: DDPMScheduler, labels: Tensor, steps: int, generator: torch.Generator
) -> Tensor:
    """Images of the given class ``labels`` (N,) drawn by DDPM's ancestral sampler over ``steps`` timesteps,
    all noise from ``generator`` (on the model's device)."""
    device = next(model.parameters()).device
    scheduler.set_timesteps(steps, device=device)
    size = model.config.sample_size
    x = torch.randn((len(labels), model.config.in_channels, size, size), generator=generator, device=device)
    labels = labels.to(device)
    for t in scheduler.timesteps:
        eps = model(x, t, class_labels=labels).sample
        x = scheduler.step(eps, t, x, generator=generator).prev_sample
    return x


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's weights as float32 numpy arrays by state-dict key (what a client uploads)."""
    return {key: value.detach().cpu().float().numpy() for key, value in model.state_dict().items()}


def load_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    """Load uploaded weights (:func:`model_arrays`) into a model of the same architecture, every key required."""
    model.load_state_dict({key: torch.from_numpy(np.asarray(value)) for key, value in arrays.items()})
    return model


__all__ = ["build_scheduler", "build_unet", "diffusion_loss", "load_arrays", "model_arrays", "sample"]
