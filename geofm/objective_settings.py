"""Masked image modelling's settings in configs of earlier versions, moved to where they live now.

Until masked image modelling owned its settings, every pretraining config had top-level ``masking``
and ``teacher`` sections, whatever its objective, and a run saved both (``config.yaml``, the
``config`` of an exported backbone's sidecar). They are now the ``task_options`` of task ``mim``.
This module holds no import of the config package, so that the checkpoint readers can move them too.
"""

from __future__ import annotations

from typing import Any

from geofm.errors import ConfigError

MIM_TASK = "mim"
"""The objective that owns ``masking`` and ``teacher``, and the task of a config that named none."""

MIM_SECTIONS_BEFORE: dict[str, Any] = {"masking": {"mask_patch_size": 32, "mask_ratio": 0.6}, "teacher": None}
"""The top-level sections configs had before they moved into ``task_options``, with their defaults then."""


def _is_default(key: str, value: Any) -> bool:
    default = MIM_SECTIONS_BEFORE[key]
    return value is None or (isinstance(value, dict) and default is not None and {**default, **value} == default)


def objective_settings_into_options(tree: dict) -> dict:
    """A pretraining config ``tree`` of an earlier version in today's shape: its top-level ``masking`` and
    ``teacher`` move into the ``task_options`` of task ``mim``, and are dropped for another objective
    where they hold the defaults (null, SimMIM's masking), as every run of an earlier version saved them.

    Raises:
        ConfigError: naming the field, where another objective's config sets a masking or a teacher.
    """
    moved = {key: tree[key] for key in MIM_SECTIONS_BEFORE if isinstance(tree, dict) and key in tree}
    if not moved:
        return tree
    rest = {key: value for key, value in tree.items() if key not in moved}
    task = tree.get("task", MIM_TASK)
    if task == MIM_TASK:
        return {**rest, "task_options": {**moved, **(tree.get("task_options") or {})}}
    for key, value in moved.items():
        if not _is_default(key, value):
            raise ConfigError(
                f"{key}: {value!r} is masked image modelling's setting, which task {task} does not read; remove "
                f"{key} to read the config as a {task} run"
            )
    return rest


__all__ = ["MIM_SECTIONS_BEFORE", "MIM_TASK", "objective_settings_into_options"]
