"""Masked image modelling (GFM, or SimMIM without a teacher) as a task a federated program runs.

The federated program (:mod:`federation`) knows nothing of images or teachers: it builds this task
from the run's config (registered as ``"mim"`` in :data:`geofm.tasks.TASKS`) and asks it for the
model, a client's batches, the forward of one micro-batch, the server's public images and pooled
features for similarity distillation, and the export at the end, with the reconstruction figure of
the server's public chips (a client's images never leave it). Each piece is the one central
pretraining uses (:mod:`pretrain.central`), so a federated client trains the very same objective.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from geofm import engine as ds
from geofm.checkpoints.teacher import build_teacher
from geofm.config import TeacherConfig, config_to_dict
from geofm.config.federated import FederatedConfig
from geofm.data.pile import PileSampler, PretrainPile, warn_skipped
from geofm.data.products import list_products
from geofm.errors import ConfigError, DatasetNotFoundError
from geofm.federated.algorithms.context import PublicImages
from geofm.federated.partitions.files import PARTITIONERS
from geofm.models.backbones import patch_size_of
from geofm.models.masking import MaskGenerator
from geofm.models.mim import MaskedImageModel
from geofm.models.teacher import FrozenTeacher
from geofm.reconstruction import shown_chips, write_reconstruction_figure
from geofm.rundir import InputPath
from geofm.runlog import LOSS_KEYS
from geofm.tasks import ClientShare, StepOutput
from pretrain.central import RESUME_INVARIANTS, build_student, export_student, prepare_models

log = logging.getLogger("geofm.federated")

EPOCH_STRIDE = 100_003
"""A sampler's epoch in round ``rnd`` is ``rnd * EPOCH_STRIDE + epoch``: every round draws its own order."""


@functools.cache
def _teacher(teacher_json: str, bands_json: str) -> FrozenTeacher:
    """The frozen teacher, built once per process (clients sharing a simulation worker share it)."""
    return build_teacher(TeacherConfig.model_validate(json.loads(teacher_json)), json.loads(bands_json))


def frozen_teacher(cfg: FederatedConfig) -> FrozenTeacher | None:
    """The run's frozen teacher (None for plain SimMIM), loaded from this machine's weights file."""
    if cfg.teacher is None:
        return None
    return _teacher(
        json.dumps(config_to_dict(cfg)["teacher"], sort_keys=True), json.dumps(cfg.data.teacher_band_indices)
    )


def share_pile(cfg: FederatedConfig, shares: list[list[Path]], mask_fn) -> PretrainPile:
    """A pile over the sources that have files in ``shares``, with only those files."""
    keep = [i for i, files in enumerate(shares) if files]
    data = cfg.data.model_copy(update={"sources": [cfg.data.sources[i] for i in keep]})
    return PretrainPile(data, cfg.model.img_size, mask_fn=mask_fn, files=[shares[i] for i in keep])


def pooled_features(model: MaskedImageModel, images: torch.Tensor) -> torch.Tensor:
    """Average-pooled final encoder features (p, d) of unmasked images: the similarity distillation's Z."""
    features = model.encoder.forward_features(images)
    return features.mean(dim=(1, 2)) if features.ndim == 4 else features[:, model.encoder.num_prefix_tokens :].mean(1)


class _ListedSources(Sequence):
    """Each configured source's files, listed when first indexed (a node reads only the folders it needs)."""

    def __init__(self, cfg: FederatedConfig) -> None:
        self.sources = cfg.data.sources
        self.listed: dict[int, list[Path]] = {}

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> list[Path]:
        if index not in self.listed:
            self.listed[index] = list_products(self.sources[index])
        return self.listed[index]


def client_shares(cfg: FederatedConfig, name: str) -> list[list[Path]]:
    """The files client ``name`` trains on, per source of ``cfg.data.sources`` (empty lists for the others).

    Raises:
        ConfigError: ``name`` is not one of the config's clients.
        DatasetNotFoundError: a source folder the client reads is missing or empty, naming the client.
    """
    names = cfg.client_names
    if name not in names:
        raise ConfigError(f"institution {name!r} is not a client of this federation; its clients are {names}")
    fed = cfg.federation
    public = [i for i, s in enumerate(cfg.data.sources) if s.name in fed.public_sources]
    partitioner = PARTITIONERS.get(fed.partition)
    try:
        files = partitioner(
            _ListedSources(cfg),
            len(names),
            names.index(name),
            seed=cfg.run.seed,
            public=public,
            alpha=fed.dirichlet_alpha,
        )
    except DatasetNotFoundError as err:
        raise DatasetNotFoundError(f"client {name}: {err}") from None
    shares: list[list[Path]] = [[] for _ in cfg.data.sources]
    for item in files:
        shares[item.source].append(Path(item.path))
    return shares


class MaskedImageModelling:
    """The GFM/SimMIM objective on one machine's view of a federated run.

    Args:
        cfg: the run's config as this machine sees it (its own data and teacher paths).
    """

    log_keys = LOSS_KEYS
    resume_invariants = RESUME_INVARIANTS

    def __init__(self, cfg: FederatedConfig) -> None:
        self.cfg = cfg
        self.teacher: FrozenTeacher | None = None
        self.device, self.dtype = ds.device(), ds.compute_dtype(cfg.train)
        self.warned: set[str] = set()  # the unreadable files warned of (data.on_bad_file: skip), each once

    @classmethod
    def federated(cls, cfg: FederatedConfig) -> MaskedImageModelling:
        """The task as a federated program runs it: this class itself."""
        return cls(cfg)

    def inputs(self) -> list[InputPath]:
        """The files a client reads besides its imagery: the teacher's weights."""
        return [InputPath("teacher.checkpoint", self.cfg.teacher.checkpoint)] if self.cfg.teacher else []

    def server_inputs(self) -> list[InputPath]:
        """The paths the server itself reads: its public sources (clients check their own data)."""
        return [
            InputPath.of_source(f"data.sources.{i}.root ({s.name}, public)", s)
            for i, s in enumerate(self.cfg.data.sources)
            if s.name in self.cfg.federation.public_sources
        ]

    def client_inputs(self) -> list[InputPath]:
        """The folders of the clients' imagery, each named with who reads it (checked before a simulation,
        where every institution's data is on this machine)."""
        fed = self.cfg.federation
        return [
            InputPath.of_source(
                f"data.sources.{i}.root (institution {s.name})"
                if fed.partition == "by_source"
                else f"data.sources.{i}.root ({s.name}, shared by the clients)",
                s,
            )
            for i, s in enumerate(self.cfg.data.sources)
            if s.name not in fed.public_sources
        ]

    def client_share(self, name: str, own_data: bool) -> ClientShare:
        """Client ``name``'s files per source, from the configured partitioner (its own folder with
        ``by_source``, which ``own_data`` changes nothing of: a node's data root is its source's root)."""
        shares = client_shares(self.cfg, name)
        return ClientShare(sum(len(files) for files in shares), shares)

    def param_groups(self, model: MaskedImageModel) -> None:
        """The engine's default groups (weight decay off for norms and biases), as in central pretraining."""
        return None

    def evaluate_round(self, model: MaskedImageModel, rnd: int) -> None:
        """Pretraining validates nothing between rounds; its rounds log their losses."""
        return None

    def evaluate_client(self, model: MaskedImageModel, name: str, own_data: bool) -> None:
        """Nor does a client validate its own model in pretraining."""
        return None

    def build_model(self, initial_weights: bool = True) -> MaskedImageModel:
        """A fresh student; without ``initial_weights`` it skips ``model.init_checkpoint`` (a client overwrites it)."""
        cfg = self.cfg
        if not initial_weights:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_checkpoint": None})})
        return build_student(cfg)

    def prepare(self, model: MaskedImageModel) -> None:
        """Load the frozen teacher and move both models to this machine's device for training."""
        self.teacher = frozen_teacher(self.cfg)
        prepare_models(model, self.teacher, self.cfg, self.device)

    def local_batches(self, shares: list[list[Path]], steps: int, rnd: int, seed: int) -> Iterator[list[dict]]:
        """``steps`` local steps, each a list of micro-batches, drawn from ``shares`` in an order fixed by ``seed``.

        Over several processes (``federation.local_processes``) each takes every ``world_size``-th sample
        of the order: a step's micro-batches over all processes hold the images of one process's step
        at the same global batch.
        """
        cfg = self.cfg
        pile = share_pile(cfg, shares, self._masks())
        rank, world_size = ds.data_parallel_rank()
        micro = cfg.train.micro_batch_size
        images = ds.global_batch(cfg.train, world_size)
        per_epoch = max(images, pile.samples_per_epoch // images * images)
        sampler = PileSampler(pile.source_sizes, pile.weights, per_epoch, seed=seed, rank=rank, world_size=world_size)
        done, epoch = 0, 0
        while done < steps:
            sampler.set_epoch(rnd * EPOCH_STRIDE + epoch)
            loader = DataLoader(
                pile, batch_size=micro, sampler=sampler, num_workers=cfg.data.num_workers, drop_last=True
            )
            batches = iter(loader)
            for _ in range(per_epoch // images):
                if done == steps:
                    break
                micro_batches = [next(batches) for _ in range(cfg.train.grad_accum_steps)]
                for batch in micro_batches:
                    warn_skipped(batch, self.warned)
                yield micro_batches
                done += 1
            epoch += 1

    def forward(self, model, batch: dict) -> StepOutput:
        """The GFM losses of one micro-batch (``model`` is the training engine or the student itself)."""
        images = batch["image"].to(self.device, self.dtype, non_blocking=True)
        targets = self.teacher(images) if self.teacher is not None else None
        losses = model(
            images,
            batch["mask"].to(self.device, non_blocking=True),
            batch["valid"].to(self.device, non_blocking=True),
            targets,
        )
        return StepOutput(losses)

    def public_images(self) -> PublicImages | None:
        """The server's public sources for a server-side step (FedSense's distillation): batches of their
        images, the encoder's pooled features, the encoder's parameters; None without a public source."""
        if not self.cfg.federation.public_sources:
            return None
        return PublicImages(self._public_batches, pooled_features, lambda model: model.encoder.parameters())

    def _public_batches(self, rnd: int, batch_size: int) -> Iterator[torch.Tensor]:
        """Endless batches of the server's public images, reshuffled per round."""
        cfg = self.cfg
        pile = share_pile(cfg, self._public_shares(), None)
        sampler = PileSampler(
            pile.source_sizes, pile.weights, max(batch_size, pile.samples_per_epoch), seed=cfg.run.seed
        )
        epoch = 0
        while True:
            sampler.set_epoch(rnd * EPOCH_STRIDE + epoch)
            for batch in DataLoader(pile, batch_size=batch_size, sampler=sampler, drop_last=True):
                warn_skipped(batch, self.warned)
                yield batch["image"]
            epoch += 1

    def export(self, model: MaskedImageModel, run_dir: Path, step: int, final: dict | None, extra: dict) -> Path:
        """Write the student's backbone like a central run's, with ``extra`` in its sidecar, and the
        reconstruction figure of the server's public chips (none without a public source)."""
        cfg = self.cfg
        if cfg.federation.public_sources:
            pile = share_pile(cfg, self._public_shares(), self._masks())
            write_reconstruction_figure(model, pile, shown_chips(pile, cfg.run.seed), cfg.data.bands, run_dir)
        else:
            log.info("no reconstruction figure: the server holds no public source (federation.public_sources)")
        return export_student(cfg, model, run_dir, step, final, extra)

    def _masks(self) -> MaskGenerator:
        """The run's SimMIM masks at the student's token grid."""
        cfg = self.cfg
        patch = patch_size_of(cfg.model.arch, cfg.model.timm_kwargs)
        return MaskGenerator(cfg.model.img_size, cfg.masking.mask_patch_size, patch, cfg.masking.mask_ratio)

    def _public_shares(self) -> list[list[Path]]:
        """Every file of the server's public sources, per source of ``cfg.data.sources`` (empty lists for the others)."""
        public = self.cfg.federation.public_sources
        return [list_products(s) if s.name in public else [] for s in self.cfg.data.sources]


__all__ = ["MaskedImageModelling", "client_shares", "frozen_teacher", "pooled_features", "share_pile"]
