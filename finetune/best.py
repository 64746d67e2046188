"""The weights a finetuning run keeps: ``best/model.safetensors`` (the whole model, backbone and head) and
``best/best.json`` (when and by what they were selected), and loading them back into a model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from geofm.config.base import CONFIG_FILE
from geofm.config.fedfinetune import check_finetuning_run, read_finetune_config
from geofm.config.finetune import FinetuneConfig
from geofm.config.saved import read_saved_config
from geofm.errors import CheckpointNotFoundError
from geofm.tasks.finetuning.model import FinetuneModel, build_finetune_model

BEST_DIR = "best"
MODEL_WEIGHTS = "model.safetensors"
BEST_RECORD = "best.json"


def save_best(model: torch.nn.Module, run_dir: Path, record: dict) -> Path:
    """Write the model's weights (float32) and ``record`` under ``run_dir/best``, replacing what was there."""
    folder = run_dir / BEST_DIR
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()).contiguous()
        for k, v in model.state_dict().items()
    }
    # new files replace the old ones (never rewritten in place: checkpoints hold hard links to them)
    tmp = folder / f".{MODEL_WEIGHTS}.tmp"
    save_file(state, str(tmp))
    os.replace(tmp, folder / MODEL_WEIGHTS)
    tmp = folder / f".{BEST_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, folder / BEST_RECORD)
    return folder / MODEL_WEIGHTS


def read_best(run_dir: Path) -> dict | None:
    """The record of the kept weights, or None if the run has kept none yet."""
    path = run_dir / BEST_DIR / BEST_RECORD
    return json.loads(path.read_text()) if path.is_file() and (run_dir / BEST_DIR / MODEL_WEIGHTS).is_file() else None


def snapshot_best(run_dir: Path, checkpoint: Path) -> None:
    """Record the kept weights with a training checkpoint (hard links: no copy while they are unchanged)."""
    if read_best(run_dir) is None:
        return
    target = checkpoint / BEST_DIR
    target.mkdir(exist_ok=True)
    for name in (MODEL_WEIGHTS, BEST_RECORD):
        (target / name).unlink(missing_ok=True)
        os.link(run_dir / BEST_DIR / name, target / name)


def restore_best(run_dir: Path, checkpoint: Path) -> dict | None:
    """Make the weights kept as of ``checkpoint`` the run's kept weights again; return their record.

    A run resumed from a checkpoint replays the steps after it, so a selection made after it is
    undone: the run's ``best/`` goes back to the snapshot taken with the checkpoint (or is removed
    when there was none).
    """
    shutil.rmtree(run_dir / BEST_DIR, ignore_errors=True)
    snapshot = checkpoint / BEST_DIR
    if read_best(checkpoint) is None:
        return None
    shutil.copytree(snapshot, run_dir / BEST_DIR)
    return read_best(run_dir)


def load_best_weights(model: torch.nn.Module, run_dir: Path) -> dict:
    """Load the run's kept weights into ``model`` (strictly); return their record.

    Raises:
        CheckpointNotFoundError: if the run has kept no weights (it has not validated or finished yet).
    """
    record = read_best(run_dir)
    if record is None:
        raise CheckpointNotFoundError(
            f"{(run_dir / BEST_DIR / MODEL_WEIGHTS).resolve()} does not exist: the run has not kept weights yet "
            "(it keeps them at each better validation, or at its end)"
        )
    state = load_file(str(run_dir / BEST_DIR / MODEL_WEIGHTS))
    model.load_state_dict(state, strict=True)
    return record


def run_config(run_dir: Path) -> FinetuneConfig:
    """The validated config a finetuning run saved (``config.yaml``): central or federated.

    Raises:
        CheckpointNotFoundError: if ``run_dir`` holds no config.
        ConfigError: if ``run_dir`` is a pretraining run.
    """
    check_finetuning_run(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path.resolve()} does not exist: {run_dir} is not a finetuning run directory")
    return read_finetune_config(read_saved_config(path), str(path))


def load_finetuned(run_dir: Path, cfg: FinetuneConfig | None = None) -> tuple[FinetuneModel, FinetuneConfig, dict]:
    """A finetuned run's model with its kept weights (eval mode), its config and the weights' record.

    Args:
        run_dir: the run directory.
        cfg: the config that builds the model (default: the run's own ``config.yaml``).
    """
    cfg = cfg or run_config(run_dir)
    model, _ = build_finetune_model(cfg, load_weights=False)
    record = load_best_weights(model, run_dir)
    return model.eval(), cfg, record
