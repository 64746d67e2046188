"""Evaluating a finetuned model on a split, and the evaluation record (``eval.json``) that reports compare.

An evaluation record holds ``task``, ``dataset``, ``train_fraction``, ``split``, ``metrics`` (see
:mod:`finetune.metrics`), ``primary_metric`` and its value as ``score``, for dense tasks
``scored_pixels`` (the target pixels the metrics counted: never padding, nor ``data.ignore_index``),
plus provenance the caller adds (checkpoint, selection, epochs, seconds...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset

from finetune.best import load_finetuned
from finetune.metrics import TaskMetrics
from finetune.splits import build_split
from geofm import engine as ds
from geofm.config.finetune import FinetuneConfig, Split


class Evaluation(NamedTuple):
    """The metrics of a model on a dataset, and the target pixels they counted (None: not a dense task)."""

    metrics: dict[str, float]
    scored_pixels: int | None


def eval_loader(
    dataset: Dataset,
    cfg: FinetuneConfig,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    *,
    keep: bool = False,
) -> DataLoader:
    """The loader of an evaluation, each process taking every ``world_size``-th sample in order.

    With ``keep`` its workers persist between passes: a loader that serves every validation of a run.
    """
    workers = cfg.data.num_workers
    return DataLoader(
        dataset,
        batch_size=cfg.finetune.eval_batch_size or cfg.train.micro_batch_size,
        sampler=range(rank, len(dataset), world_size),
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=keep and workers > 0,
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data: Dataset | DataLoader,
    cfg: FinetuneConfig,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    rank: int = 0,
    world_size: int = 1,
) -> Evaluation:
    """The task's metrics of ``model`` on a dataset (each process takes every ``world_size``-th
    sample), or through a loader of :func:`eval_loader`.

    The model is put in eval mode for the pass and returned to its previous mode.
    """
    was_training = model.training
    model.eval()
    loader = data if isinstance(data, DataLoader) else eval_loader(data, cfg, device, rank, world_size)
    metrics = TaskMetrics(cfg, device)
    task = metrics.task
    for batch in loader:
        outputs = model(*task.model_inputs(batch, device, dtype))
        metrics.update(outputs, task.batch_target(batch, device))
    result = Evaluation(metrics.compute(), metrics.scored_pixels())
    model.train(was_training)
    return result


def eval_record(cfg: FinetuneConfig, split: str, evaluation: Evaluation, **provenance: Any) -> dict[str, Any]:
    """An evaluation record: what was evaluated on which data, the metrics, and ``provenance``."""
    pixels = {} if evaluation.scored_pixels is None else {"scored_pixels": evaluation.scored_pixels}
    return {
        "task": cfg.task,
        "dataset": cfg.dataset_name,
        "train_fraction": cfg.data.train_fraction,
        "split": split,
        "primary_metric": cfg.primary_metric,
        "score": evaluation.metrics[cfg.primary_metric],
        "metrics": evaluation.metrics,
        **pixels,
        **provenance,
    }


def write_json(record: dict[str, Any], path: Path) -> Path:
    """Write a record as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def evaluate_run(run_dir: Path, split: Split = "test", cfg: FinetuneConfig | None = None) -> dict[str, Any]:
    """Evaluate a finetuned run's kept weights on a split (``geofm eval``).

    Args:
        run_dir: the finetuning run directory.
        split: train, val or test (evaluation views, no augmentation).
        cfg: the config giving the model and the data (default: the run's own).

    Returns:
        The evaluation record, with ``run_dir`` and the record of the weights (``selected``).
    """
    model, cfg, record = load_finetuned(run_dir, cfg)
    dev = ds.device()
    model.to(dev)
    dataset = build_split(cfg, split, train=False)
    evaluation = evaluate(model, dataset, cfg, dev)
    return eval_record(cfg, split, evaluation, run_dir=str(run_dir), samples=len(dataset), selected=record)
