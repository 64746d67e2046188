"""FedDiff's two halves in plain PyTorch: a client's diffusion model and statistics, the server's synthetic set.

Mendieta, Sun and Chen, "Navigating Heterogeneity and Privacy in One-Shot Federated Learning with
Diffusion Models", WACV 2025. A client trains a class-conditional DDPM (:mod:`geofm.models.diffusion`)
on its labelled images, optionally with DP-SGD (:mod:`geofm.federated.dpsgd`), and returns its weights,
its per-class counts and, for Fourier magnitude filtering, its mean Fourier magnitude
(:mod:`geofm.federated.fmf`). The server samples each client's model per class, writes the samples
as GeoTIFFs of the dataset's bands in raw units into a classification folder (one sub-folder per
class name), resumably, then keeps per client all but its ``fmf_gamma`` percent farthest from its mean.
The program around both is :mod:`federation.feddiff`.
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
from geofm.data.writers import write_geotiff
from geofm.federated import dpsgd, fmf
from geofm.federated.privacy import noise_generator
from geofm.models.diffusion import build_scheduler, build_unet, diffusion_loss, load_arrays, model_arrays, sample
from geofm.runlog import progress_bar

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


def _generator(device: torch.device | str, seed: int | None, *parts: object) -> torch.Generator:
    """A generator on ``device`` seeded from ``seed`` and ``parts`` as :func:`~geofm.federated.privacy.noise_generator`
    seeds one: the same in every process, from OS entropy when ``seed`` is None."""
    return torch.Generator(device).manual_seed(noise_generator(seed, *parts).initial_seed())


def train_client(
    cfg: FedDiffConfig, images: LabelledImages, name: str, device: torch.device | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    """Train client ``name``'s diffusion model on ``images`` (every dataset band) on ``device`` (default the
    CPU) and compute its upload.

    Returns:
        The upload (:data:`WEIGHTS` keys, :data:`COUNTS`, :data:`FMF_MEAN` when ``fmf_gamma`` > 0) and
        the metrics: ``num_examples``, ``steps``, ``loss`` (the last epoch's mean) and, under privacy,
        the epsilons of :func:`~geofm.federated.dpsgd.composed_epsilons`.
    """
    d, privacy = cfg.diffusion, cfg.diffusion.privacy
    image, _ = images[0]
    torch.manual_seed(noise_generator(cfg.run.seed, name, "init").initial_seed())
    device = device or torch.device("cpu")
    model = build_unet(d, image.shape[0], cfg.data.num_classes, image.shape[-1]).to(device)
    scheduler = build_scheduler(d)
    optimizer = torch.optim.AdamW(model.parameters(), lr=d.lr)
    order = _generator("cpu", cfg.run.seed, name, "order")
    generator = _generator(device, cfg.run.seed, name, "train")
    loader = DataLoader(images, batch_size=min(d.batch_size, len(images)), shuffle=True, generator=order)
    engine = None
    if privacy is not None:
        # Opacus draws the Poisson batches from torch's global generator and the noise from ours, on the device:
        # both from OS entropy unless privacy.seed is set (a run seed known to others would expose the batches)
        torch.manual_seed(noise_generator(privacy.seed, "batches", name).initial_seed())
        noise = _generator(device, privacy.seed, "dpsgd", name)
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


def planned(cfg: FedDiffConfig, upload: Upload) -> dict[int, int]:
    """How many samples of each class the server draws from a client's model: its count (``samples:
    as_data``) or ``samples`` for each class it holds."""
    counts = upload.counts()
    per_class = {
        k: int(n) if cfg.diffusion.samples == "as_data" else cfg.diffusion.samples for k, n in enumerate(counts)
    }
    return {k: n for k, n in per_class.items() if counts[k]}


def _records(path: Path) -> list[dict]:
    """The batches ``samples.jsonl`` records as done (a last line cut short by a kill is left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def generate(cfg: FedDiffConfig, uploads: list[Upload], folder: Path, device: torch.device) -> list[dict]:
    """Draw every client's samples into ``folder/<class>/<client>_<i>.tif``; returns one record per batch.

    Batches of ``sample_batch`` samples of one client and class, each from a generator seeded by
    (``run.seed``, client, class, first index). A batch is done once its record (its files and each
    sample's FMF score, null without a client mean) is in ``folder/samples.jsonl``, after its files:
    a rerun skips the done batches, so an interrupted run continues where it stopped and ends with the
    samples of an unbroken one.
    """
    d, data = cfg.diffusion, cfg.data
    log_path = folder / "samples.jsonl"
    done = {(r["client"], r["label"], r["start"]): r for r in _records(log_path)}
    jobs = [
        (upload, k, start, min(d.sample_batch, n - start))
        for upload in uploads
        for k, n in planned(cfg, upload).items()
        for start in range(0, n, d.sample_batch)
    ]
    std, mean = (torch.tensor(v).view(-1, 1, 1) for v in (data.std, data.mean))
    bar = progress_bar(len(jobs), len(done), cfg.run.progress, "sampling", unit="batch")
    model, model_of, scheduler = None, None, build_scheduler(d)
    for upload, k, start, count in jobs:
        if (upload.name, k, start) in done:
            continue
        if model_of != upload.name:
            unet = build_unet(d, len(data.dataset_bands), data.num_classes, cfg.model.img_size)
            model, model_of = load_arrays(unet, upload.weights()).to(device).eval(), upload.name
        generator = _generator(device, cfg.run.seed, upload.name, k, start)
        labels = torch.full((count,), k, dtype=torch.long)
        images = sample(model, scheduler, labels, d.sampling_steps, generator).cpu()
        files = []
        for i, pixels in enumerate(((images * std + mean) / data.scale).numpy().astype(np.float32)):
            path = folder / data.class_names[k] / f"{upload.name}_{start + i:05d}.tif"
            write_geotiff(path, pixels, transform=(1.0, 0.0, 0.0, 0.0, -1.0, float(pixels.shape[1])), crs=None)
            files.append(path.relative_to(folder).as_posix())
        scores = None
        if FMF_MEAN in upload.arrays:
            scores = fmf.fmf_scores(images, torch.from_numpy(np.asarray(upload.arrays[FMF_MEAN]))).tolist()
        record = {"client": upload.name, "label": k, "start": start, "files": files, "scores": scores}
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[(upload.name, k, start)] = record
        bar.update()
    bar.close()
    return [done[(u.name, k, start)] for u, k, start, _ in jobs]


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
    "planned",
    "train_client",
]
