"""OSCAR's halves in plain PyTorch: a client's class embeddings, the server's guided diffusion model and its samples.

After OSCAR (Zaland et al., "One-Shot Federated Learning with Classifier-Free Diffusion Models",
2025). A client encodes its images with the shared encoder (a geofm backbone's pooled global
features, :func:`build_encoder`) and uploads, per class it holds, the mean embedding, with its
per-class counts. The server trains a U-Net conditioned on that encoder's embedding
(:class:`~geofm.models.diffusion.EmbeddingUNet`) on its public imagery with condition dropout
(:func:`train_server_model`), or loads one trained earlier, then draws per client and class as many
samples as the client holds, guided by the uploaded mean embedding (classifier-free guidance),
into the synthetic classification folder (:mod:`geofm.fl.oneshot.synthetic`). The program around
both is :mod:`federation.programs.oscar`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from geofm.checkpoints import load_backbone_for_bands
from geofm.config.oneshot import public_images
from geofm.config.oscar import OscarConfig
from geofm.data.finetune.augment import ClassificationView
from geofm.data.finetune.folders import whole
from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.readers import WindowReader
from geofm.errors import CheckpointFormatError, ConfigError
from geofm.fl.oneshot.feddiff import COUNTS, Upload
from geofm.fl.oneshot.synthetic import SampleJob, sample_jobs, seeded_generator, write_samples
from geofm.fl.privacy.client_level import noise_generator
from geofm.models.backbones import backbone_kwargs, create_backbone, resize_input
from geofm.models.diffusion import (
    EmbeddingUNet,
    build_embedding_unet,
    build_scheduler,
    diffusion_loss,
    drop_conditions,
    load_arrays,
    model_arrays,
    sample,
)
from geofm.runlog import progress_bar

EMBEDDINGS = "class_embeddings"  # upload: float32 (classes held, embed dim): mean embedding of each, in class order
SERVER_MODEL = "server_model.safetensors"  # in the run dir: the trained EmbeddingUNet's weights
SERVER_METRICS = "server_model.json"  # in the run dir: its training's steps, loss and public images


def build_encoder(cfg: OscarConfig, device: torch.device | None = None) -> nn.Module:
    """The shared encoder (``cfg.encoder``) on ``data.bands``, in eval mode on ``device``: a headless timm
    backbone whose forward gives pooled global features (B, ``num_features``), taking ``model.img_size`` inputs.

    Raises:
        ConfigError: the checkpoint does not fit the encoder's model (naming ``oscar.encoder``).
    """
    enc = cfg.encoder
    m = enc.model
    kwargs = backbone_kwargs(
        in_chans=len(cfg.data.bands), img_size=m.img_size, window_size=m.window_size, timm_kwargs=m.timm_kwargs
    )
    encoder = create_backbone(m.arch, kwargs)
    if enc.checkpoint is not None:
        try:
            load_backbone_for_bands(encoder, enc.checkpoint, cfg.data.bands)
        except CheckpointFormatError as err:
            raise ConfigError(
                f"oscar.encoder: the checkpoint {enc.checkpoint} does not fit the model {m.arch}: {err}"
            ) from None
    if m.img_size != cfg.model.img_size:
        resize_input(encoder, cfg.model.img_size)
    return encoder.to(device or torch.device("cpu")).eval().requires_grad_(False)


def band_positions(cfg: OscarConfig) -> list[int]:
    """Where the encoder's bands (``data.bands``) are among the dataset's, which the diffusion model generates."""
    return [cfg.data.dataset_bands.index(band) for band in cfg.data.bands]


@torch.no_grad()
def class_embeddings(
    encoder: nn.Module, images: Dataset, classes: int, batch_size: int, device: torch.device | None = None
) -> dict[str, np.ndarray]:
    """A client's upload: the mean embedding of each class it holds (:data:`EMBEDDINGS`, float32, classes in
    order) and its per-class counts (:data:`COUNTS`, int64), from ``(image, label)`` pairs."""
    device = device or torch.device("cpu")
    sums, counts = (
        torch.zeros(classes, encoder.num_features, dtype=torch.float64),
        torch.zeros(classes, dtype=torch.int64),
    )
    for batch, labels in DataLoader(images, batch_size=batch_size):
        sums.index_add_(0, labels, encoder(batch.to(device)).double().cpu())
        counts += torch.bincount(labels, minlength=classes)
    held = counts > 0
    means = sums[held] / counts[held].unsqueeze(1)
    return {EMBEDDINGS: means.float().numpy(), COUNTS: counts.numpy()}


class PublicImages(Dataset):
    """The server's public imagery (:func:`~geofm.config.oneshot.public_images` of ``oscar.public``): each file
    read whole in the dataset's bands, normalised as the finetuning data is, then a random crop resized to
    ``model.img_size`` with random flips (:class:`~geofm.data.finetune.augment.ClassificationView`, torch's
    global generator)."""

    def __init__(self, cfg: OscarConfig) -> None:
        data = cfg.all_bands().data
        self.files, self.bands = public_images(cfg.oscar.public, data.suffixes), list(data.dataset_bands)
        self.normaliser = BandNormaliser.from_config(data)
        self.view = ClassificationView(cfg.model.img_size, True, data.crop_scale, data.hflip, data.vflip)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Tensor:
        with WindowReader(self.files[index], len(self.bands), self.bands) as reader:
            image = self.normaliser(reader.read(*whole(reader.info)), reader.info.nodata, reader.path)[0]
        return self.view({"image": image})["image"]


def train_server_model(
    cfg: OscarConfig, encoder: nn.Module, public: Dataset, device: torch.device | None = None
) -> tuple[EmbeddingUNet, dict]:
    """Train the server's U-Net on ``public`` images conditioned on the encoder's embedding of each (its
    ``data.bands``), each condition dropped to zero with probability ``oscar.p_uncond``.

    Returns:
        The model (eval mode) and its metrics: ``public_images``, ``steps``, ``loss`` (the last epoch's mean).
    """
    d, seed = cfg.diffusion, cfg.run.seed
    device = device or torch.device("cpu")
    torch.manual_seed(noise_generator(seed, "server", "init").initial_seed())
    bands = len(cfg.data.dataset_bands)
    model = build_embedding_unet(d, bands, encoder.num_features, cfg.model.img_size).to(device)
    scheduler, optimizer = build_scheduler(d), torch.optim.AdamW(model.parameters(), lr=d.lr)
    order, generator = (
        seeded_generator("cpu", seed, "server", "order"),
        seeded_generator(device, seed, "server", "train"),
    )
    loader = DataLoader(public, batch_size=min(d.batch_size, len(public)), shuffle=True, generator=order)
    positions = band_positions(cfg)
    model.train()
    steps, losses = 0, []
    bar = progress_bar(d.epochs * len(loader), 0, cfg.run.progress, "server model")
    for _ in range(d.epochs):
        losses = []
        for images in loader:
            images = images.to(device)
            with torch.no_grad():
                conditions = drop_conditions(encoder(images[:, positions]), cfg.oscar.p_uncond, generator)
            optimizer.zero_grad()
            loss = diffusion_loss(model, scheduler, images, conditions, generator)
            loss.backward()
            optimizer.step()
            steps, losses = steps + 1, [*losses, loss.item()]
            bar.update()
    bar.close()
    metrics = {"public_images": len(public), "steps": steps, "loss": float(np.mean(losses))}
    return model.eval(), metrics


def load_server_model(cfg: OscarConfig, path: Path, condition_dim: int, field: str) -> EmbeddingUNet:
    """A server model written by :func:`server_model`, for the encoder's ``condition_dim``.

    Raises:
        ConfigError: naming ``field``, where its embedding width or its U-Net differs from the config's.
    """
    arrays = load_file(path)
    width = arrays["project.weight"].shape[1] if "project.weight" in arrays else None
    if width != condition_dim:
        raise ConfigError(
            f"{field} {path}: a model conditioned on {width}-dimensional embeddings, the encoder gives {condition_dim}"
        )
    model = build_embedding_unet(cfg.diffusion, len(cfg.data.dataset_bands), condition_dim, cfg.model.img_size)
    try:
        return load_arrays(model, arrays).eval()
    except RuntimeError as err:
        raise ConfigError(f"{field} {path}: not a U-Net of diffusion.unet {cfg.diffusion.unet}: {err}") from None


def server_model(cfg: OscarConfig, encoder: nn.Module, run_dir: Path, device: torch.device) -> EmbeddingUNet:
    """The server's model: ``oscar.diffusion_checkpoint``, else the one this run trained (``run_dir/``
    :data:`SERVER_MODEL`), else one trained now on the public imagery and saved there."""
    dim, saved = encoder.num_features, run_dir / SERVER_MODEL
    if cfg.oscar.diffusion_checkpoint is not None:
        return load_server_model(cfg, cfg.oscar.diffusion_checkpoint, dim, "oscar.diffusion_checkpoint").to(device)
    if saved.exists():
        return load_server_model(cfg, saved, dim, "the run's server model").to(device)
    model, metrics = train_server_model(cfg, encoder, PublicImages(cfg), device)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SERVER_METRICS).write_text(json.dumps(metrics, indent=1))
    save_file(model_arrays(model), saved)  # last: a run killed while saving trains again
    return model


def generate(cfg: OscarConfig, uploads: list[Upload], model: EmbeddingUNet, folder: Path) -> list[dict]:
    """Draw every client's samples into ``folder`` (:func:`~geofm.fl.oneshot.synthetic.write_samples`): per
    class it holds, guided by its mean embedding with ``oscar.guidance_scale``, each batch from a generator
    seeded by (``run.seed``, client, class, first index); returns one record per batch."""
    device = next(model.parameters()).device
    scheduler, d = build_scheduler(cfg.diffusion), cfg.diffusion
    conditions = {
        u.name: dict(zip(np.flatnonzero(u.counts()).tolist(), np.asarray(u.arrays[EMBEDDINGS]), strict=True))
        for u in uploads
    }

    def draw(job: SampleJob) -> tuple[Tensor, None]:
        condition = torch.from_numpy(conditions[job.client][job.label]).expand(job.count, -1)
        generator = seeded_generator(device, cfg.run.seed, job.client, job.label, job.start)
        images = sample(model, scheduler, condition, d.sampling_steps, generator, cfg.oscar.guidance_scale)
        return images.cpu(), None

    return write_samples(cfg, sample_jobs(cfg, {u.name: u.counts() for u in uploads}), draw, folder)


__all__ = [
    "EMBEDDINGS",
    "SERVER_METRICS",
    "SERVER_MODEL",
    "PublicImages",
    "band_positions",
    "build_encoder",
    "class_embeddings",
    "generate",
    "load_server_model",
    "server_model",
    "train_server_model",
]
