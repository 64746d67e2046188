"""Configs that runs saved (``config.yaml``), read back in today's shape.

A run keeps the validated config it started with. Where a key has since moved, its value is moved
here on reading, so that a run written before evaluates, predicts, reports and resumes as it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from geofm.config.algorithm import AggregatorConfig, ServerOptimizerConfig
from geofm.config.base import FORM_ONLY, MovedKeys, read_config_tree
from geofm.config.finetune import FLAT_HEAD_KEYS
from geofm.config.pretrain import objective_options
from geofm.data.layouts import LAYOUT_KEYS_MOVED
from geofm.errors import ConfigError
from geofm.objective_settings import MIM_TASK, objective_settings_into_options
from geofm.tasks import TASKS


def _into_options(section: dict, moved: MovedKeys, name: str | None) -> dict:
    """``section`` without its keys of ``moved``; the value of each moves to ``options`` where entry
    ``name`` read it and it differs from its default then (a run saved every default)."""
    flat = {key: section[key] for key in moved if key in section}
    if not flat:
        return section
    options = dict(section.get("options") or {})
    for key, value in flat.items():
        readers, option, default = moved[key]
        if name in readers and value != default:
            options[option] = value
    return {**{key: value for key, value in section.items() if key not in flat}, "options": options}


def head_options_from_flat_keys(tree: dict) -> dict:
    """A finetuning config tree of before ``head.options`` in today's shape: :data:`FLAT_HEAD_KEYS`
    move into the options of the config's head (``head.name``, or the task's own)."""
    head = tree.get("head") if isinstance(tree, dict) else None
    if not isinstance(head, dict):
        return tree
    task = tree.get("task")
    name = head.get("name") or (TASKS.get(task).default_head if task in TASKS else None)
    return {**tree, "head": _into_options(head, FLAT_HEAD_KEYS, name)}


def server_rule_options_from_flat_keys(tree: dict) -> dict:
    """A federated config tree of before the aggregator and the server optimiser kept their settings in
    ``options`` in today's shape: the keys each section's ``moved`` lists move into its entry's options."""
    algorithm = tree.get("algorithm") if isinstance(tree, dict) else None
    if not isinstance(algorithm, dict):
        return tree
    sections = {}
    for key, section in (("aggregator", AggregatorConfig), ("server_optimizer", ServerOptimizerConfig)):
        given = algorithm.get(key)
        if isinstance(given, dict):
            name = given.get("name", section.model_fields["name"].default)
            sections[key] = _into_options(given, section.moved, name)
    return {**tree, "algorithm": {**algorithm, **sections}}


def source_options_from_flat_keys(tree: dict) -> dict:
    """A config tree of before sources kept their layout's settings in ``options`` in today's shape (a
    run's saved config): each ``data.sources[]`` entry's keys of :data:`LAYOUT_KEYS_MOVED` move to its
    ``options``, those at what a run saved where a source left them out (null, the default) dropped."""
    data = tree.get("data") if isinstance(tree, dict) else None
    sources = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(sources, list) or not any(
        isinstance(s, dict) and set(LAYOUT_KEYS_MOVED) & set(s) for s in sources
    ):
        return tree
    moved = []
    for source in sources:
        flat = {key: source[key] for key in LAYOUT_KEYS_MOVED if isinstance(source, dict) and key in source}
        if not flat:
            moved.append(source)
            continue
        options = {
            **(source.get("options") or {}),
            **{k: v for k, v in flat.items() if v not in (None, LAYOUT_KEYS_MOVED[k])},
        }
        moved.append({**{k: v for k, v in source.items() if k not in flat}, "options": options})
    return {**tree, "data": {**data, "sources": moved}}


def objective_options_in_full(tree: dict) -> dict:
    """A pretraining config tree with its ``task_options`` as a validated config holds them, every default
    written (a run saved before kept only those its config gave); unchanged where they do not validate."""
    if not isinstance(tree, dict) or not isinstance(tree.get("task_options"), dict):
        return tree
    task = tree.get("task", MIM_TASK)
    if task not in TASKS or getattr(TASKS.get(task), "kind", None) != "pretraining":
        return tree
    try:
        return {**tree, "task_options": objective_options(task, tree["task_options"], FORM_ONLY)}
    except (ValueError, ConfigError):
        return tree


MIGRATIONS = (
    head_options_from_flat_keys,
    source_options_from_flat_keys,
    server_rule_options_from_flat_keys,
    objective_settings_into_options,
    objective_options_in_full,
)
"""Each takes a saved config tree and returns it in today's shape (unchanged where it already is)."""


def read_saved_config(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """The config tree a run saved at ``path``, ``overrides`` applied, in today's shape (not yet validated).

    Raises:
        ConfigError: naming ``path`` and the field, where the tree cannot be moved to today's shape.
    """
    tree = read_config_tree(path, tuple(overrides))
    try:
        for migrate in MIGRATIONS:
            tree = migrate(tree)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return tree


__all__ = [
    "MIGRATIONS",
    "head_options_from_flat_keys",
    "objective_options_in_full",
    "read_saved_config",
    "server_rule_options_from_flat_keys",
    "source_options_from_flat_keys",
]
