"""The built-in finetuning tasks, one module each, registered in :data:`geofm.tasks.TASKS`.

:func:`task_of` binds a config's task to the config: its loss, mixing, metrics and forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from finetune.tasks.base import FinetuneTask, MaskTask
from geofm.tasks import finetune_task

if TYPE_CHECKING:
    from geofm.config.finetune import FinetuneConfig


def task_of(cfg: FinetuneConfig) -> FinetuneTask:
    """The registered task of ``cfg``, bound to it."""
    return finetune_task(cfg.task)(cfg)


__all__ = ["FinetuneTask", "MaskTask", "task_of"]
