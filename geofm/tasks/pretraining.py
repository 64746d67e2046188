"""What every pretraining objective shares, central or federated: the files, the batches, the public images.

The programs (central :mod:`pretrain.central`, federated :mod:`federation`) know nothing of images,
masks or teachers: they build the task the config names (:data:`geofm.tasks.TASKS`) and ask it for
the model, the samples, the forward of one micro-batch, what follows an optimizer step, and the
export at the end (the interface: :class:`geofm.tasks.PretrainingTask`). An objective is a subclass
of :class:`PretrainingObjective` in its own module (:mod:`geofm.tasks.mim.task`, :mod:`geofm.tasks.dino.task`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from geofm.config import config_to_dict
from geofm.config.base import FORM_ONLY
from geofm.config.federated import FederatedConfig
from geofm.config.pretrain import PretrainingConfig
from geofm.errors import ConfigError, DatasetNotFoundError
from geofm.fl.partitions.files import PARTITIONERS
from geofm.models.backbones import backbone_kwargs, prefer_fused_attention
from geofm.registry import entry_options
from geofm.tasks import TASKS, ClientShare, StepOutput

if TYPE_CHECKING:  # a config names its task while it is validated: this module imports torch in its methods only
    import torch

    from geofm.config import TeacherConfig
    from geofm.data.pile import PretrainPile
    from geofm.fl.algorithms.context import PublicImages
    from geofm.tasks.mim.model import MaskedImageModel
    from geofm.training.rundir import InputPath

log = logging.getLogger("geofm.pretrain")

RESUME_INVARIANTS = ("model", "task", "task_options", "data.bands", "data.custom_bands", "run.seed")
"""What a resumed run must share with the run that wrote its checkpoints (the objective's settings: ``task_options``)."""

EPOCH_STRIDE = 100_003
"""A sampler's epoch in round ``rnd`` is ``rnd * EPOCH_STRIDE + epoch``: every round draws its own order."""


def student_kwargs(cfg: PretrainingConfig) -> dict:
    """timm kwargs of the student backbone (recorded in the exported sidecar)."""
    m = cfg.model
    return backbone_kwargs(
        in_chans=len(cfg.data.bands), img_size=m.img_size, window_size=m.window_size, timm_kwargs=m.timm_kwargs
    )


def export_pretrained(
    cfg: PretrainingConfig,
    encoder: torch.nn.Module,
    run_dir: Path,
    step: int,
    final: dict | None,
    *,
    method: str,
    teacher: TeacherConfig | None = None,
    extra: dict | None = None,
) -> Path:
    """Write a pretrained backbone (timm layout) with its sidecar and model card next to the run.

    ``method`` names the objective in the sidecar (``gfm``, ``simmim``, ``dino``), ``teacher`` the
    frozen teacher it distilled (GFM); ``extra`` adds sidecar entries (a federated run's ``federation`` record).
    """
    from geofm.checkpoints import export_backbone
    from geofm.checkpoints.provenance import gsd_range, releases_of

    metadata = {
        "method": method,
        "bands": list(cfg.data.bands),
        "gsd": gsd_range(s.gsd for s in cfg.data.sources),
        "img_size": cfg.model.img_size,
        "normalisation": {
            s.name: {"bands": list(s.bands), "scale": s.scale, "mean": list(s.mean), "std": list(s.std)}
            for s in cfg.data.sources
        },
        "data": [{"name": s.name, "root": str(s.root), "weight": s.weight, "gsd": s.gsd} for s in cfg.data.sources],
        "teacher": None if teacher is None else {"arch": teacher.arch, "checkpoint": str(teacher.checkpoint)},
        "steps": step,
        "metrics": final,
        "config": config_to_dict(cfg),
        **(extra or {}),
    }
    releases = releases_of(
        {
            "model.init_checkpoint": cfg.model.init_checkpoint,
            "task_options.teacher.checkpoint": teacher.checkpoint if teacher is not None else None,
        }
    )
    if releases:
        metadata["releases"] = releases
    path = export_backbone(encoder, run_dir, arch=cfg.model.arch, create_kwargs=student_kwargs(cfg), metadata=metadata)
    log.info("exported backbone to %s", path)
    return path


def share_pile(cfg: PretrainingConfig, shares: list[list[Path]] | None, mask_fn=None, views=None) -> PretrainPile:
    """A pile over the sources that have files in ``shares``, with only those files (None: every
    source with every file); ``mask_fn`` and ``views`` as :class:`~geofm.data.pile.PretrainPile` takes them."""
    from geofm.data.pile import PretrainPile

    if shares is None:
        return PretrainPile(cfg.data, cfg.model.img_size, mask_fn=mask_fn, views=views)
    keep = [i for i, files in enumerate(shares) if files]
    data = cfg.data.model_copy(update={"sources": [cfg.data.sources[i] for i in keep]})
    return PretrainPile(data, cfg.model.img_size, mask_fn=mask_fn, files=[shares[i] for i in keep], views=views)


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
        from geofm.data.products import list_products

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


class PretrainingObjective(ABC):
    """What every pretraining objective shares on one machine's view of a run, central or federated.

    A subclass says what the objective trains (:meth:`build_model`, :meth:`prepare`), what a sample
    holds (:meth:`pile`), the loss of a micro-batch (:meth:`forward`), what it updates after an
    optimizer step (:meth:`after_step`) and keeps in checkpoints (:meth:`state_dict`), and what it
    writes at the end (:meth:`export`); the files a client trains on, its batches and the server's
    public images are the same for every objective (the files of the configured partition of
    ``data.sources``). See :class:`geofm.tasks.PretrainingTask` for the interface.

    Args:
        cfg: the run's config as this machine sees it (its own data and teacher paths).
    """

    kind = "pretraining"
    log_keys: tuple[str, ...] = ("loss",)
    resume_invariants: tuple[str, ...] = RESUME_INVARIANTS

    def __init__(self, cfg: PretrainingConfig) -> None:
        from geofm.training import engine as ds

        self.cfg = cfg
        self.device, self.dtype = ds.device(), ds.compute_dtype(cfg.train)
        self.warned: set[str] = set()  # the unreadable files warned of (data.on_bad_file: skip), each once

    @classmethod
    def check_config(cls, cfg: PretrainingConfig, architecture: bool = True) -> None:
        """The objective's rules on a config, with the checks that build the architecture (importing
        timm) where ``architecture``: by default, ``task_options`` checked by the class's ``Options``
        model (none: no options are taken).

        Raises:
            ValueError: naming the field and what the objective expects.
        """
        cls.options_of(cfg, architecture)

    @classmethod
    def options_of(cls, cfg: PretrainingConfig, architecture: bool = True) -> BaseModel | None:
        """``task_options`` validated by the class's ``Options`` model (None for an objective without one),
        with the checks of its sections that build an architecture where ``architecture``."""
        context = None if architecture else FORM_ONLY
        return entry_options(cfg.task, getattr(cls, "Options", None), cfg.task_options, "task_options", context)

    # ---- files ------------------------------------------------------------------------------
    def inputs(self) -> list[InputPath]:
        """The files a client (or a central run) reads besides its imagery."""
        return []

    def server_inputs(self) -> list[InputPath]:
        """The paths the server itself reads: its public sources (clients check their own data)."""
        from geofm.training.rundir import InputPath

        return [
            InputPath.of_source(f"data.sources.{i}.root ({s.name}, public)", s)
            for i, s in enumerate(self.cfg.data.sources)
            if s.name in self.cfg.federation.public_sources
        ]

    def client_inputs(self) -> list[InputPath]:
        """The folders of the clients' imagery, each named with who reads it (checked before a simulation,
        where every institution's data is on this machine)."""
        from geofm.training.rundir import InputPath

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
        ``by_source``, which ``own_data`` changes nothing of: a node's data root is its source's root),
        weighted by the samples of its pile (a file is one, a scene with ``chip_size`` its chips, a chip
        store's shard its chips; from the headers and the store's index, no pixels read)."""
        shares = client_shares(self.cfg, name)
        return ClientShare(sum(share_pile(self.cfg, shares).source_sizes), shares)

    # ---- the objective ------------------------------------------------------------------------
    @abstractmethod
    def build_model(self, initial_weights: bool = True) -> torch.nn.Module:
        """A fresh model; without ``initial_weights`` it skips ``model.init_checkpoint`` (a client overwrites it)."""

    def prepare(self, model: torch.nn.Module) -> None:
        """Ready ``model`` (and the objective's own networks) on this machine's device for training."""
        prefer_fused_attention(model, self.device)

    @abstractmethod
    def pile(self, shares: list[list[Path]] | None = None) -> PretrainPile:
        """The training samples of ``shares`` (per source of ``data.sources``; None: every file)."""

    @abstractmethod
    def forward(self, model, batch: dict) -> StepOutput:
        """The losses of one micro-batch (``model`` is the training engine or the model itself)."""

    def after_step(self, model: torch.nn.Module, progress: float) -> None:
        """Called after each optimizer step with the fraction of training done; nothing by default."""
        return None

    def state_dict(self) -> dict:
        """What the objective keeps beside the model in a checkpoint (none by default)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` from a checkpoint (nothing to restore by default)."""
        return None

    def param_groups(self, model: torch.nn.Module) -> None:
        """The engine's default groups (weight decay off for norms and biases)."""
        return None

    def figures(self, model: torch.nn.Module, pile: PretrainPile, run_dir: Path) -> None:
        """Redraw the objective's figures of a run at a checkpoint (none by default)."""
        return None

    @abstractmethod
    def export(self, model: torch.nn.Module, run_dir: Path, step: int, final: dict | None, extra: dict) -> Path:
        """Write the trained backbone with its sidecar and model card; returns its path."""

    def products(self, run_dir: Path) -> list[Path]:
        """The exported backbone, its sidecar and its model card."""
        from geofm.checkpoints.export import EXPORT_FILES

        return [run_dir / name for name in EXPORT_FILES]

    # ---- federated rounds ----------------------------------------------------------------------
    def evaluate_round(self, model: torch.nn.Module, rnd: int) -> None:
        """Pretraining validates nothing between rounds; its rounds log their losses."""
        return None

    def evaluate_client(self, model: torch.nn.Module, name: str, own_data: bool) -> None:
        """Nor does a client validate its own model in pretraining."""
        return None

    def local_batches(self, shares: list[list[Path]], steps: int, rnd: int, seed: int) -> Iterator[list[dict]]:
        """``steps`` local steps, each a list of micro-batches, drawn from ``shares`` in an order fixed by ``seed``.

        Over several processes (``federation.local_processes``) each takes every ``world_size``-th sample
        of the order: a step's micro-batches over all processes hold the images of one process's step
        at the same global batch.
        """
        from torch.utils.data import DataLoader

        from geofm.data.pile import PileSampler, warn_skipped
        from geofm.training import engine as ds

        cfg = self.cfg
        pile = self.pile(shares)
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

    def public_images(self) -> PublicImages | None:
        """The server's public sources for a server-side step (FedSense's distillation): batches of their
        images, the encoder's pooled features, the encoder's parameters; None without a public source."""
        from geofm.fl.algorithms.context import PublicImages

        if not self.cfg.federation.public_sources:
            return None
        return PublicImages(self._public_batches, pooled_features, lambda model: model.encoder.parameters())

    def _public_batches(self, rnd: int, batch_size: int) -> Iterator[torch.Tensor]:
        """Endless batches of the server's public images (plain crops), reshuffled per round."""
        from torch.utils.data import DataLoader

        from geofm.data.pile import PileSampler, warn_skipped

        cfg = self.cfg
        pile = share_pile(cfg, self._public_shares())
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

    def _public_shares(self) -> list[list[Path]]:
        """Every file of the server's public sources, per source of ``cfg.data.sources`` (empty lists for the others)."""
        from geofm.data.products import list_products

        public = self.cfg.federation.public_sources
        return [list_products(s) if s.name in public else [] for s in self.cfg.data.sources]


def objective_of(cfg: PretrainingConfig) -> PretrainingObjective:
    """The objective ``cfg`` names, bound to it: what a federated program holds of a pretraining task on
    each machine (:data:`geofm.tasks.FEDERATED_TASKS`), the objective being a federated task itself."""
    return TASKS.get(cfg.task)(cfg)


__all__ = [
    "EPOCH_STRIDE",
    "RESUME_INVARIANTS",
    "PretrainingObjective",
    "client_shares",
    "export_pretrained",
    "objective_of",
    "pooled_features",
    "share_pile",
    "student_kwargs",
]
