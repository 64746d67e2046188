"""FedDiff's two halves in plain PyTorch: a client's diffusion model and statistics, the server's synthetic set.

Mendieta, Sun and Chen, "Navigating Heterogeneity and Privacy in One-Shot Federated Learning with
Diffusion Models", WACV 2025. A client trains a class-conditional DDPM (:mod:`geofm.models.diffusion`)
on its labelled images, optionally with DP-SGD (:mod:`geofm.fl.privacy.dpsgd`), and returns its weights,
its per-class counts and, for Fourier magnitude filtering, its mean Fourier magnitude
(:mod:`geofm.fl.oneshot.fmf`). The server samples each client's model per class, writes the samples
as GeoTIFFs of the dataset's bands in raw units into a classification folder (one sub-folder per
class name), resumably (:mod:`geofm.fl.oneshot.synthetic`), then keeps per client all but its ``fmf_gamma`` percent farthest from its mean.
The program around both is :mod:`federation.programs.feddiff`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from geofm.config.feddiff import FedDiffConfig
from geofm.fl.oneshot import fmf
from geofm.fl.oneshot.synthetic import SampleJob, sample_jobs, seeded_generator, write_samples
from geofm.fl.privacy import dpsgd
from geofm.fl.privacy.client_level import noise_generator
from geofm.models.diffusion import build_scheduler, build_unet, diffusion_loss, load_arrays, model_arrays, sample

WEIGHTS = "unet."  # upload keys: the U-Net's state dict under this prefix
COUNTS = "class_counts"  # upload: int64 (num_classes,) images per class
FMF_MEAN = "fmf_mean"  # upload: float32 (bands, size, size) mean Fourier magnitude
FMF_FILE = "fmf.json"


class LabelledImages(Dataset):
    """``(image, label)`` pairs of a finetuning dataset's samples at ``indices`` (Opacus's loader wants tuples)."""

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        self.dataset, self.indices = dataset, [int(i) for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.dataset[self.indices[index]]
        return item["image"], torch.as_tensor(item["label"])


def train_client(
    cfg: FedDiffConfig, images: LabelledImages, name: str, device: torch.device | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    """Train client ``name``'s diffusion model on ``images`` (every dataset band) on ``device`` (default the
    CPU) and compute its upload.

    Returns:
        The upload (:data:`WEIGHTS` keys, :data:`COUNTS`, :data:`FMF_MEAN` when ``fmf_gamma`` > 0) and
        the metrics: ``num_examples``, ``steps``, ``loss`` (the last epoch's mean) and, under privacy,
        the epsilons of :func:`~geofm.fl.privacy.dpsgd.composed_epsilons`.
    """
    d, privacy = cfg.diffusion, cfg.diffusion.privacy
    image, _ = images[0]
    torch.manual_seed(noise_generator(cfg.run.seed, name, "init").initial_seed())
    device = device or torch.device("cpu")
    model = build_unet(d, image.shape[0], cfg.data.num_classes, image.shape[-1]).to(device)
    scheduler = build_scheduler(d)
    optimizer = torch.optim.AdamW(model.parameters(), lr=d.lr)
    order = seeded_generator("cpu", cfg.run.seed, name, "order")
    generator = seeded_generator(device, cfg.run.seed, name, "train")
    loader = DataLoader(images, batch_size=min(d.batch_size, len(images)), shuffle=True, generator=order)
    engine = None
    if privacy is not None:
        # Opacus draws the Poisson batches from torch's global generator and the noise from ours, on the device:
        # both from OS entropy unless privacy.seed is set (a run seed known to others would expose the batches)
        torch.manual_seed(noise_generator(privacy.seed, "batches", name).initial_seed())
        noise = seeded_generator(device, privacy.seed, "dpsgd", name)
        engine, model, optimizer, loader = dpsgd.make_private(model, optimizer, loader, privacy, d.epochs, noise)
    model.train()
    steps, losses = 0, []
    for _ in range(d.epochs):
        losses = []
        for batch, labels in loader:
            optimizer.zero_grad()
            loss = diffusion_loss(model, scheduler, batch.to(device), labels.to(device), generator)
            loss.backward()
            optimizer.step()
            steps, losses = steps + 1, [*losses, loss.item()]
    upload = {WEIGHTS + k: v for k, v in model_arrays(getattr(model, "_module", model)).items()}
    upload[COUNTS], mean, fmf_noise = client_statistics(cfg, images, name)
    if mean is not None:
        upload[FMF_MEAN] = mean
    metrics = {"num_examples": len(images), "steps": steps, "loss": float(np.mean(losses)) if losses else float("nan")}
    if engine is not None:
        metrics.update(dpsgd.composed_epsilons(engine, privacy, fmf_noise))
    return upload, metrics


def client_statistics(
    cfg: FedDiffConfig, images: LabelledImages, name: str
) -> tuple[np.ndarray, np.ndarray | None, float | None]:
    """In one pass over the client's images: its per-class counts (int64), and with ``fmf_gamma`` above 0 its
    mean Fourier magnitude (a bounded private mean under ``diffusion.privacy``, with the noise multiplier
    spent on it; None without privacy)."""
    privacy, classes = cfg.diffusion.privacy, cfg.data.num_classes
    shape = tuple(images[0][0].shape)
    bound = None if privacy is None else fmf.magnitude_bound(privacy.fmf_bound, shape)
    counts, total = np.zeros(classes, dtype=np.int64), torch.zeros(shape)
    for batch, labels in DataLoader(images, batch_size=cfg.diffusion.batch_size):
        counts += np.bincount(labels.numpy(), minlength=classes)
        if cfg.diffusion.fmf_gamma > 0:
            total += fmf.magnitude_sum(batch, bound)
    if not cfg.diffusion.fmf_gamma:
        return counts, None, None
    if privacy is None:
        return counts, (total / len(images)).numpy(), None
    z = dpsgd.fmf_noise_multiplier(privacy)
    mean = fmf.private_mean(total, len(images), bound, z, noise_generator(privacy.seed, "fmf", name))
    return counts, mean.numpy().astype(np.float32), z


@dataclass(frozen=True)
class Upload:
    """What the server keeps of one client's reply."""

    name: str
    arrays: dict[str, np.ndarray]

    def counts(self) -> np.ndarray:
        return np.asarray(self.arrays[COUNTS])

    def weights(self) -> dict[str, np.ndarray]:
        return {k.removeprefix(WEIGHTS): v for k, v in self.arrays.items() if k.startswith(WEIGHTS)}


def generate(cfg: FedDiffConfig, uploads: list[Upload], folder: Path, device: torch.device) -> list[dict]:
    """Draw every client's samples into ``folder`` (:func:`~geofm.fl.oneshot.synthetic.write_samples`), each
    batch from a generator seeded by (``run.seed``, client, class, first index) and scored by FMF against
    the client's mean (null without one); returns one record per batch."""
    d, data = cfg.diffusion, cfg.data
    by_name = {upload.name: upload for upload in uploads}
    scheduler, loaded = build_scheduler(d), {}

    def draw(job: SampleJob) -> tuple[torch.Tensor, list[float] | None]:
        upload = by_name[job.client]
        if job.client not in loaded:  # one client's model at a time: the jobs come client by client
            unet = build_unet(d, len(data.dataset_bands), data.num_classes, cfg.model.img_size)
            loaded.clear()
            loaded[job.client] = load_arrays(unet, upload.weights()).to(device).eval()
        generator = seeded_generator(device, cfg.run.seed, job.client, job.label, job.start)
        labels = torch.full((job.count,), job.label, dtype=torch.long)
        images = sample(loaded[job.client], scheduler, labels, d.sampling_steps, generator).cpu()
        if FMF_MEAN not in upload.arrays:
            return images, None
        return images, fmf.fmf_scores(images, torch.from_numpy(np.asarray(upload.arrays[FMF_MEAN]))).tolist()

    return write_samples(cfg, sample_jobs(cfg, {u.name: u.counts() for u in uploads}), draw, folder)


def filter_samples(cfg: FedDiffConfig, records: list[dict], samples: Path, synthetic: Path) -> dict:
    """Link the samples FMF keeps into ``synthetic`` (a classification split folder, rebuilt) and write
    ``fmf.json`` beside it: per client its samples, the dropped ones and the highest kept score."""
    if synthetic.exists():
        shutil.rmtree(synthetic)
    summary = {}
    for client in sorted({r["client"] for r in records}):
        mine = [r for r in records if r["client"] == client]
        files = [f for r in mine for f in r["files"]]
        scored = all(r["scores"] is not None for r in mine)
        scores = np.array([s for r in mine for s in r["scores"]]) if scored else np.zeros(len(files))
        keep = fmf.kept(scores, cfg.diffusion.fmf_gamma if scored else 0.0)
        for file in np.array(files)[keep]:
            (synthetic / file).parent.mkdir(parents=True, exist_ok=True)
            os.link(samples / file, synthetic / file)
        summary[client] = {
            "samples": len(files),
            "dropped": [f for f, k in zip(files, keep, strict=True) if not k],
            "threshold": float(scores[keep].max()) if scored and keep.any() else None,
        }
    (synthetic.parent / FMF_FILE).write_text(
        json.dumps({"gamma": cfg.diffusion.fmf_gamma, "clients": summary}, indent=1)
    )
    return summary


__all__ = [
    "COUNTS",
    "FMF_MEAN",
    "WEIGHTS",
    "LabelledImages",
    "Upload",
    "client_statistics",
    "filter_samples",
    "generate",
    "train_client",
]
