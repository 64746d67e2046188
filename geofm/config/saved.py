"""Configs that runs saved (``config.yaml``), read back in today's shape.

A run keeps the validated config it started with. Where a key has since moved, its value is moved
here on reading, so that a run written before evaluates, predicts, reports and resumes as it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from geofm.config.base import read_config_tree
from geofm.config.finetune import head_options_from_flat_keys

MIGRATIONS = (head_options_from_flat_keys,)
"""Each takes a saved config tree and returns it in today's shape (unchanged where it already is)."""


def read_saved_config(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """The config tree a run saved at ``path``, ``overrides`` applied, in today's shape (not yet validated)."""
    tree = read_config_tree(path, tuple(overrides))
    for migrate in MIGRATIONS:
        tree = migrate(tree)
    return tree


__all__ = ["MIGRATIONS", "read_saved_config"]
