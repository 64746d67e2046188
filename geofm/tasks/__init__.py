"""The task registry and the task interface: what a program trains, each task declared in one module.

A task is what a config's ``task`` names. Every task is a class in one module, registered in
:data:`TASKS`, of one of two kinds (its ``kind``):

* ``"pretraining"``: an objective on unlabelled imagery (masked image modelling, DINO), run by
  ``geofm pretrain`` and by a federated program the same way: :class:`PretrainingTask`;
* ``"finetuning"``: a labelled downstream task (classification, segmentation...), declared by
  ``geofm.tasks.finetuning`` and run by ``geofm finetune`` and, through its federated adapter, by a
  federated program.

What a federated program asks of either on one machine is :class:`FederatedTask`. The built-in tasks
are registered here lazily by import path, so the library never imports the programs that implement
them; a third-party package registers another through the ``geofm.tasks`` entry-point group (see
:mod:`geofm.registry`): one module and one registration. What runs a task is registered by its kind,
so a task never reaches the programs that run it: federated runs are validated with the config class
of the kind (:data:`FEDERATED_CONFIGS`), a federated program holds the task as the kind's
:data:`FEDERATED_TASKS` entry makes it (:func:`federated_task`), and one machine trains it with the
kind's :data:`CENTRAL_PROGRAMS` entry (:func:`train_central`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from geofm.errors import ConfigError
from geofm.registry import Registry

if TYPE_CHECKING:  # config validation reads the registry without importing torch
    from collections.abc import Iterator
    from pathlib import Path

    import torch
    from torch import Tensor, nn
    from torch.utils.data import Dataset

    from geofm.data.pile import PretrainPile
    from geofm.fl.algorithms.context import PublicImages
    from geofm.training.rundir import InputPath

TASKS: Registry = Registry("task", "geofm.tasks")
"""What a program trains: data, model and head, loss and metrics (``task`` of a config)."""
TASKS.register("mim", "geofm.tasks.mim.task:MaskedImageModelling")
TASKS.register("dino", "geofm.tasks.dino.task:SelfDistillation")
TASKS.register("classification", "geofm.tasks.finetuning.classification:Classification")
TASKS.register("multilabel", "geofm.tasks.finetuning.multilabel:Multilabel")
TASKS.register("segmentation", "geofm.tasks.finetuning.segmentation:Segmentation")
TASKS.register("change", "geofm.tasks.finetuning.change:Change")
TASKS.register("superres", "geofm.tasks.finetuning.superres:Superres")


def pretraining_objectives() -> dict[str, str]:
    """The registered pretraining objectives, each name with its summary (for help texts); an entry whose
    module cannot be imported (a broken plug-in) is left out, as ``geofm list tasks`` reports it."""
    objectives = {}
    for name in TASKS:
        try:
            kind = getattr(TASKS.get(name), "kind", None)
        except ConfigError:
            continue
        if kind == "pretraining":
            objectives[name] = TASKS.summary(name)
    return objectives


def finetune_task(name: str) -> Any:
    """The registered finetuning task ``name``: a class of ``geofm.tasks.finetuning`` or of a plug-in.

    Raises:
        ConfigError: for an unregistered name (listing the nearest names), or a task that does not finetune.
    """
    task = TASKS.get(name)
    if getattr(task, "kind", None) != "finetuning":
        raise ConfigError(f"task {name!r} is a pretraining task; geofm finetune and geofm eval take a finetuning task")
    return task


FEDERATED_CONFIGS: Registry = Registry("federated config", "geofm.federated_configs")
"""The config class of federated runs by task kind: a new task of a known kind needs no entry here."""
FEDERATED_CONFIGS.register("pretraining", "geofm.config.federated:FederatedConfig")
FEDERATED_CONFIGS.register("finetuning", "geofm.config.fedfinetune:FederatedFinetuneConfig")

FEDERATED_TASKS: Registry = Registry("federated task", "geofm.federated_tasks")
"""By task kind, what a federated program holds of a task on one machine: a callable of the run's
validated config returning its :class:`FederatedTask` (a pretraining objective bound to the config
is one itself; a finetuning task is adapted)."""
FEDERATED_TASKS.register("pretraining", "geofm.tasks.pretraining:objective_of")
FEDERATED_TASKS.register("finetuning", "finetune.federated_task:FederatedFinetuning")

CENTRAL_PROGRAMS: Registry = Registry("central program", "geofm.central_programs")
"""By task kind, the program that trains a task on one machine (``geofm pretrain``, ``geofm finetune``): a
function of the validated config returning the run directory."""
CENTRAL_PROGRAMS.register("pretraining", "pretrain.central:pretrain")
CENTRAL_PROGRAMS.register("finetuning", "finetune.run:finetune")


def federated_task(cfg: Any) -> FederatedTask:
    """The task ``cfg`` names as a federated program runs it on this machine (its kind's :data:`FEDERATED_TASKS`)."""
    return FEDERATED_TASKS.get(TASKS.get(cfg.task).kind)(cfg)


def train_central(cfg: Any) -> Path:
    """Train the task ``cfg`` names on one machine with its kind's program (:data:`CENTRAL_PROGRAMS`); returns
    the run directory."""
    return CENTRAL_PROGRAMS.get(TASKS.get(cfg.task).kind)(cfg)


@dataclass
class StepOutput:
    """One micro-batch's forward pass as the training loop and an algorithm's hooks see it.

    Attributes:
        losses: ``"loss"`` is what is minimised; every other entry is logged beside it.
        outputs: what the model returned (logits, features), for hooks that need it.
    """

    losses: dict[str, Tensor]
    outputs: Any = field(default=None)


@dataclass(frozen=True)
class ClientShare:
    """What one client of a federated run trains on: its example count (the weight of its update)
    and the task's own description of its data (files per source, sample indices...)."""

    num_examples: int
    data: Any


class FederatedTask(Protocol):
    """What a federated program asks of a task on one machine (the server's, or one client's).

    Attributes:
        kind: the task's kind (``"pretraining"``, ``"finetuning"``), which the registries above key.
        log_keys: the entries of :attr:`StepOutput.losses` a client averages over its round.
        resume_invariants: the config keys a resumed run must share with the run it continues.
        device: where this machine trains and evaluates.
        dtype: the dtype the forward computes in.
    """

    kind: ClassVar[str]
    log_keys: tuple[str, ...]
    resume_invariants: tuple[str, ...]
    device: torch.device
    dtype: torch.dtype

    def inputs(self) -> list[InputPath]:
        """The files every machine reads besides its data (a teacher's weights)."""

    def server_inputs(self) -> list[InputPath]:
        """The paths the server reads (public sources, held-out splits, the starting checkpoint)."""

    def client_inputs(self) -> list[InputPath]:
        """The clients' data, checked before a simulation (where every institution's data is local)."""

    def client_share(self, name: str, own_data: bool) -> ClientShare:
        """What client ``name`` trains on: its part of the data, or all of a node's own data."""

    def build_model(self, initial_weights: bool = True) -> nn.Module:
        """A fresh model; a client builds one without initial weights and loads the global model."""

    def prepare(self, model: nn.Module) -> None:
        """Ready the model (and the task's own networks) on this machine's device for training."""

    def param_groups(self, model: nn.Module) -> list[dict] | None:
        """The optimiser's parameter groups (None: the engine's defaults)."""

    def local_batches(self, data: Any, steps: int, rnd: int, seed: int) -> Iterator[list]:
        """``steps`` step-batches (each a list of micro-batches) of a client's :attr:`ClientShare.data`."""

    def forward(self, model: Any, batch: Any) -> StepOutput:
        """The losses of one micro-batch through ``model`` (the training engine, or the module)."""

    def after_step(self, model: nn.Module, progress: float) -> None:
        """Called after each optimizer step with the fraction of the run's training done (EMA teachers)."""

    def evaluate_client(self, model: nn.Module, name: str, own_data: bool) -> dict[str, float] | None:
        """A personalised client's model on its own validation data (None: the task validates nothing)."""

    def evaluate_round(self, model: nn.Module, rnd: int) -> dict[str, float] | None:
        """The global model after round ``rnd`` on the validation data (None: nothing to validate)."""

    def public_images(self) -> PublicImages | None:
        """The server's public images for a server-side step of an algorithm, or None."""

    def export(self, model: nn.Module, run_dir: Path, step: int, final: dict | None, extra: dict) -> Path:
        """Write the run's product at the end (an exported backbone, an evaluation); returns its path."""

    def products(self, run_dir: Path) -> list[Path]:
        """What :meth:`export` writes into ``run_dir`` (files and folders), for a logger to keep as artifacts."""


class PretrainingTask(FederatedTask, Protocol):
    """A pretraining objective, which ``geofm pretrain`` runs too (``kind = "pretraining"``).

    The class declares :meth:`check_config` (its rules and its ``task_options``, read while a config
    is validated); an instance is bound to one config. Implementations: :mod:`geofm.tasks`.
    """

    @classmethod
    def check_config(cls, cfg: Any, architecture: bool = True) -> None:
        """The objective's rules on a config (with ``architecture``, those that build the backbone);
        ValueError naming the field. The task's module imports torch in its methods only: a config is
        checked before the deep-learning stack loads."""

    def pile(self, shares: list[list[Path]] | None = None) -> PretrainPile:
        """The samples of ``shares`` (files per source) in the objective's form; None: every file."""

    def state_dict(self) -> dict:
        """What the objective keeps beside the model in a checkpoint (an EMA teacher)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` from a checkpoint."""

    def figures(self, model: nn.Module, pile: PretrainPile, run_dir: Path) -> None:
        """Redraw the objective's figures at a checkpoint (the reconstruction figure)."""


class FederatedFinetuningTask(FederatedTask, Protocol):
    """A finetuning task as a federated program holds it (``kind = "finetuning"``), with what the one-shot
    programs ask besides: the splits and the weights a finetuning run kept. Implementation:
    :class:`finetune.federated_task.FederatedFinetuning`.

    Attributes:
        train_set: the train split, which the clients' shares index.
        val_set: the validation split (None: the run validates nothing).
    """

    train_set: Dataset
    val_set: Dataset | None

    def load_kept(self, model: nn.Module, run_dir: Path) -> dict:
        """Load the weights a finetuning run in ``run_dir`` kept into ``model``; returns their record."""


__all__ = [
    "CENTRAL_PROGRAMS",
    "FEDERATED_CONFIGS",
    "FEDERATED_TASKS",
    "TASKS",
    "ClientShare",
    "FederatedFinetuningTask",
    "FederatedTask",
    "PretrainingTask",
    "StepOutput",
    "federated_task",
    "finetune_task",
    "pretraining_objectives",
    "train_central",
]
