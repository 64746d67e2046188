"""Example-level differential privacy of a client's one-shot upload: DP-SGD, a private statistic, the composed budget.

FedDiff's clients each release a model trained on their images once (and, for Fourier magnitude
filtering, the mean magnitude of their images). Under ``diffusion.privacy`` the model is trained
with DP-SGD (Abadi et al., CCS 2016) by Opacus: each batch Poisson-sampled at rate
``q = batch_size / n`` (Opacus's ``DPDataLoader``), each example's gradient clipped to ``clip``,
Gaussian noise of std ``z clip`` added to their sum; ``z`` is the smallest noise multiplier whose RDP
guarantee after ``epochs / q`` steps is within ``epsilon`` for ``delta`` (Opacus's
``make_private_with_epsilon``). The Fourier mean is a second Gaussian mechanism (sample rate 1, one
release) whose noise multiplier spends ``fmf_epsilon`` alone. The reported ``epsilon`` composes both
in one RDP accountant (Opacus's ``RDPAccountant``, as :mod:`geofm.fl.privacy.client_level` uses; Mironov,
CSF 2017), which is tighter than adding the two epsilons.

Refused: a model with layers Opacus computes no per-sample gradients for, or that mix examples in a
batch (batch norm; ``opacus.validators.ModuleValidator``); a ``delta`` of at least ``1 / n``, which
admits a mechanism that publishes an example. Not covered: the per-class counts the server samples
by and the training loss, which travel in the clear.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from geofm.config.feddiff import DiffusionPrivacyConfig
from geofm.errors import ConfigError


def check_private_model(model: torch.nn.Module) -> None:
    """Refuse a model DP-SGD cannot train with per-example clipping.

    Raises:
        ConfigError: listing what Opacus's ``ModuleValidator`` finds.
    """
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ConfigError(
            "diffusion.privacy: DP-SGD needs per-example gradients, which these layers do not give: "
            + "; ".join(str(e) for e in errors)
        )


def check_delta(privacy: DiffusionPrivacyConfig, examples: int) -> None:
    """Refuse a ``delta`` of at least ``1 / examples``.

    Raises:
        ConfigError: naming the client's count and the largest sound delta.
    """
    if privacy.delta >= 1 / examples:
        raise ConfigError(
            f"diffusion.privacy.delta {privacy.delta:g} is not below 1 / n for a client of {examples} images: "
            f"such a guarantee allows publishing an image outright; choose delta well below {1 / examples:g}"
        )


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    privacy: DiffusionPrivacyConfig,
    epochs: int,
    generator: torch.Generator,
) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    """DP-SGD for ``epochs`` passes of ``loader``: Opacus's privacy engine (RDP accountant) and the model,
    optimiser and Poisson-sampling loader it wraps; the noise is drawn from ``generator`` (on the model's
    device), the batches from torch's global generator."""
    from opacus import PrivacyEngine

    check_private_model(model)
    check_delta(privacy, len(loader.dataset))
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=privacy.epsilon,
        target_delta=privacy.delta,
        epochs=epochs,
        max_grad_norm=privacy.clip,
        poisson_sampling=True,
        noise_generator=generator,
    )
    return engine, model, optimizer, loader


def fmf_noise_multiplier(privacy: DiffusionPrivacyConfig) -> float:
    """The noise multiplier of the one release of the Fourier mean that spends ``fmf_epsilon`` for ``delta``."""
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(
        target_epsilon=privacy.fmf_epsilon, target_delta=privacy.delta, sample_rate=1.0, steps=1, accountant="rdp"
    )


def composed_epsilons(engine: Any, privacy: DiffusionPrivacyConfig, fmf_noise: float | None) -> dict[str, float]:
    """The client's guarantee for ``delta``: ``epsilon_model`` (DP-SGD, the engine's accountant's own figure),
    ``epsilon_fmf`` (the Fourier mean alone, when one was released) and ``epsilon`` (both composed in RDP)."""
    from opacus.accountants import RDPAccountant

    report = {"epsilon_model": float(engine.accountant.get_epsilon(privacy.delta)), "delta": privacy.delta}
    if fmf_noise is None:
        return {**report, "epsilon": report["epsilon_model"]}
    fmf, total = RDPAccountant(), RDPAccountant()
    fmf.step(noise_multiplier=fmf_noise, sample_rate=1.0)
    total.history = [*engine.accountant.history, *fmf.history]
    return {
        **report,
        "epsilon_fmf": float(fmf.get_epsilon(privacy.delta)),
        "epsilon": float(total.get_epsilon(privacy.delta)),
    }


__all__ = ["check_delta", "check_private_model", "composed_epsilons", "fmf_noise_multiplier", "make_private"]
