"""The built-in finetuning tasks, one module each, registered in :data:`geofm.tasks.TASKS`.

:func:`task_of` binds a config's task to the config: its loss, mixing, metrics and forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from geofm.tasks import finetune_task
from geofm.tasks.finetuning.base import FinetuneTask, MaskTask

if TYPE_CHECKING:
    from geofm.config.finetune import FinetuneConfig


def task_of(cfg: FinetuneConfig) -> FinetuneTask:
    """The registered task of ``cfg``, bound to it."""
    return finetune_task(cfg.task)(cfg)


__all__ = ["FinetuneTask", "MaskTask", "task_of"]
