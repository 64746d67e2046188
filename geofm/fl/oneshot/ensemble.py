"""Ensemble distillation in plain PyTorch: the clients' models teach one student on public unlabelled images.

The one-shot baseline of FedDF (Lin et al., NeurIPS 2020) and of DENSE (Zhang et al., NeurIPS 2022)
without its generator: the server averages the clients' softened class probabilities on public
images (:func:`ensemble_probabilities`) and trains a student to match them with the KL divergence at
temperature ``T``, scaled by ``T**2`` so that its gradients keep their size as ``T`` changes (Hinton
et al. 2015; :func:`distillation_loss`). The program around it is :mod:`federation.programs.ensemble`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from geofm.config.ensemble import PUBLIC
from geofm.config.finetune_data import FinetuneDataConfig
from geofm.config.oneshot import check_public_images, public_images
from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.readers import read_raster
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import weighted_mean


def ensemble_probabilities(logits: Sequence[Tensor], weights: Sequence[float], temperature: float) -> Tensor:
    """``sum_k w_k softmax(z_k / T) / sum_k w_k``: the teachers' averaged softened probabilities, (N, classes)."""
    total = float(sum(weights))
    return sum(w / total * F.softmax(z.float() / temperature, dim=-1) for z, w in zip(logits, weights, strict=True))


def distillation_loss(student_logits: Tensor, teacher_probabilities: Tensor, temperature: float) -> Tensor:
    """``T**2 * KL(p_teacher || softmax(z_student / T))``, averaged over the batch."""
    log_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return F.kl_div(log_student, teacher_probabilities, reduction="batchmean") * temperature**2


def tile_starts(length: int, size: int) -> list[int]:
    """Where ``size`` tiles start along ``length`` pixels: as few as cover it, spread evenly from 0 to the end."""
    if length < size:
        return []
    count = -(-length // size)
    return sorted({round(i * (length - size) / max(count - 1, 1)) for i in range(count)})


def public_tiles(folder: Path, data: FinetuneDataConfig, size: int) -> Tensor:
    """The public images under ``folder`` (:func:`~geofm.config.oneshot.public_images`) in the model's bands,
    normalised as the dataset is and cut into ``size`` tiles (see :func:`tile_starts`): float32 (N, bands, size, size).

    Raises:
        ConfigError: the folder is missing or yields no tile.
    """
    check_public_images(folder, data.suffixes, "ensemble.public", PUBLIC)
    normaliser, tiles = BandNormaliser.from_config(data), []
    for path in public_images(folder, data.suffixes):
        raster = read_raster(path, len(data.dataset_bands), data.dataset_bands)
        pixels = normaliser(raster.data, raster.nodata, str(path))[0]
        height, width = pixels.shape[1:]
        tiles += [
            pixels[:, r : r + size, c : c + size] for r in tile_starts(height, size) for c in tile_starts(width, size)
        ]
    if not tiles:
        raise ConfigError(f"ensemble.public: no image under {folder.resolve()} is {size} px on each side or larger")
    return torch.stack(tiles)


@torch.no_grad()
def predict_logits(model: nn.Module, images: Tensor, batch_size: int, device: torch.device) -> Tensor:
    """``model``'s logits of ``images`` in eval mode, on the CPU."""
    model.eval().to(device)
    return torch.cat(
        [model(images[i : i + batch_size].to(device)).float().cpu() for i in range(0, len(images), batch_size)]
    )


def distill(
    student: nn.Module,
    images: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    epochs: int,
    batch_size: int,
    lr: float,
    device: torch.device,
    seed: int,
    after_epoch: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``student`` on ``images`` to match the ``targets`` probabilities (:func:`distillation_loss`) with AdamW
    at a constant ``lr``, in batches shuffled by ``seed``; ``after_epoch(epoch, mean loss)`` after each pass.

    Returns:
        The mean loss of each epoch.
    """
    student.to(device).train()
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    generator, losses = torch.Generator().manual_seed(seed), []
    for epoch in range(1, epochs + 1):
        order, total = torch.randperm(len(images), generator=generator), 0.0
        for start in range(0, len(images), batch_size):
            batch = order[start : start + batch_size]
            loss = distillation_loss(student(images[batch].to(device)), targets[batch].to(device), temperature)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses.append(total / len(images))
        if after_epoch is not None:
            after_epoch(epoch, losses[-1])
            student.train()
    return losses


def average_state(states: Sequence[dict[str, np.ndarray]], weights: Sequence[float]) -> dict[str, Tensor]:
    """The weighted average of models' state dicts (FedAvg); integer entries (indices, counters) are the first's."""
    return {
        key: weighted_mean((torch.from_numpy(np.asarray(s[key])) for s in states), weights).to(first.dtype)
        if first.dtype.is_floating_point
        else first
        for key, first in ((key, torch.from_numpy(np.asarray(states[0][key]))) for key in states[0])
    }


__all__ = [
    "average_state",
    "distill",
    "distillation_loss",
    "ensemble_probabilities",
    "predict_logits",
    "public_tiles",
    "tile_starts",
]
