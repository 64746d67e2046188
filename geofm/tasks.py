"""The task registry: what a program trains, each task declared in one module.

A task names its data, model and head, loss, metrics and best-metric rule, evaluation tiling and
prediction output in one place (its module); programs look it up by the name a config gives. The
built-in tasks are registered here lazily by import path, so the library never imports the
programs that implement them; a third-party package registers another through the
``geofm.tasks`` entry-point group (see :mod:`geofm.registry`), and the config class of its
federated runs through ``geofm.federated_configs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from geofm.registry import Registry

if TYPE_CHECKING:  # config validation reads the registry without importing torch
    from torch import Tensor

TASKS: Registry = Registry("task", "geofm.tasks")
"""What a program trains: data, model and head, loss and metrics (``task`` of a config)."""
TASKS.register("mim", "pretrain.task:MaskedImageModelling")
TASKS.register("classification", "finetune.tasks.classification:Classification")
TASKS.register("multilabel", "finetune.tasks.multilabel:Multilabel")
TASKS.register("segmentation", "finetune.tasks.segmentation:Segmentation")
TASKS.register("change", "finetune.tasks.change:Change")
TASKS.register("superres", "finetune.tasks.superres:Superres")

FEDERATED_CONFIGS: Registry = Registry("federated config", "geofm.federated_configs")
"""The config class of a task's federated runs, by task name (a plug-in task registers its own)."""
FEDERATED_CONFIGS.register("mim", "geofm.config.federated:FederatedConfig")
for _finetuning in ("classification", "multilabel", "segmentation", "change", "superres"):
    FEDERATED_CONFIGS.register(_finetuning, "geofm.config.fedfinetune:FederatedFinetuneConfig")


@dataclass
class StepOutput:
    """One micro-batch's forward pass as the training loop and an algorithm's hooks see it.

    Attributes:
        losses: ``"loss"`` is what is minimised; every other entry is logged beside it.
        outputs: what the model returned (logits, features), for hooks that need it.
    """

    losses: dict[str, Tensor]
    outputs: Any = field(default=None)


__all__ = ["TASKS", "StepOutput"]


@dataclass(frozen=True)
class ClientShare:
    """What one client of a federated run trains on: its example count (the weight of its update)
    and the task's own description of its data (files per source, sample indices...)."""

    num_examples: int
    data: Any
