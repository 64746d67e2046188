"""The toy federated program, importable by name in this process, in Ray workers and in Flower's processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[2]
TOY = "toy_federated_program"
# Factories are named by import path, so the toy must be importable as a top-level module: here, in Ray
# workers (they get this process's sys.path) and in Flower's processes (they get TOY_PYTHONPATH).
sys.path.insert(0, str(HERE))
TOY_PYTHONPATH = f"{REPO}:{HERE}"


@pytest.fixture
def toy_run_config(tmp_path):
    """A run config of the toy program writing its records to ``tmp_path/records.jsonl``, with extra overrides."""

    def make(overrides: str = "", **entries) -> dict:
        return {
            "server-factory": f"{TOY}:make_server",
            "client-factory": f"{TOY}:make_client",
            "overrides": f"out={tmp_path / 'records.jsonl'} {overrides}",
            **entries,
        }

    return make


@pytest.fixture
def toy_pythonpath() -> str:
    """PYTHONPATH for Flower's processes: this checkout first, then the toy program's folder."""
    return TOY_PYTHONPATH
