"""Evaluating a finetuned model on a split, and the evaluation record (``eval.json``) that reports compare.

An evaluation record holds ``task``, ``dataset``, ``train_fraction``, ``split``, ``metrics`` (see
:mod:`geofm.tasks.finetuning.metrics`), ``primary_metric`` and its value as ``score``, for dense tasks
``scored_pixels`` (the target pixels the metrics counted: never padding, nor ``data.ignore_index``),
plus provenance the caller adds (checkpoint, selection, epochs, seconds...).

A dense task's evaluation tiles a region (a scene, or a window of one) with ``model.img_size`` tiles
that overlap at the far edges; the tiles' outputs are blended into one output per region as
``geofm predict`` blends them (:func:`finetune.predict.add_tile`), and each region is scored once, on
every target pixel exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from finetune.best import load_finetuned
from finetune.predict import add_tile, blend_weights
from finetune.splits import build_split
from geofm.config.finetune import FinetuneConfig
from geofm.config.finetune_data import Split
from geofm.data.finetune import FinetuneDataset
from geofm.tasks.finetuning.metrics import TaskMetrics
from geofm.training import engine as ds


class Evaluation(NamedTuple):
    """The metrics of a model on a dataset, and the target pixels they counted (None: not a dense task)."""

    metrics: dict[str, float]
    scored_pixels: int | None


def tiling(dataset: Dataset) -> tuple[FinetuneDataset, list[int]] | None:
    """The dense evaluation tiles a dataset (a :class:`FinetuneDataset` or a ``Subset`` of one) holds:
    the dataset of the tiles and the tile index of each sample (None: not evaluation tiles)."""
    indices = list(range(len(dataset)))
    while isinstance(dataset, Subset):
        indices = [dataset.indices[i] for i in indices]
        dataset = dataset.dataset
    return (dataset, indices) if isinstance(dataset, FinetuneDataset) and dataset.tiled else None


def eval_loader(
    dataset: Dataset,
    cfg: FinetuneConfig,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    *,
    keep: bool = False,
) -> DataLoader:
    """The loader of an evaluation, each process taking every ``world_size``-th sample in order; of
    dense evaluation tiles, every ``world_size``-th region, its tiles in a row.

    With ``keep`` its workers persist between passes: a loader that serves every validation of a run.
    """
    tiles = tiling(dataset)
    if tiles is None:
        order: Iterable[int] = range(rank, len(dataset), world_size)
    else:
        source, index = tiles
        mine = [i for i, t in enumerate(index) if source.tiles[t][0] % world_size == rank]
        order = sorted(mine, key=index.__getitem__)
    workers = cfg.data.num_workers
    return DataLoader(
        dataset,
        batch_size=cfg.finetune.eval_batch_size or cfg.train.micro_batch_size,
        sampler=order,
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
    """The task's metrics of ``model`` on a dataset (each process takes its share, see
    :func:`eval_loader`), or through a loader of :func:`eval_loader`.

    Dense evaluation tiles are blended into one output per region, and each region is scored once.
    The model is put in eval mode for the pass and returned to its previous mode.
    """
    was_training = model.training
    model.eval()
    loader = data if isinstance(data, DataLoader) else eval_loader(data, cfg, device, rank, world_size)
    metrics = TaskMetrics(cfg, device)
    task = metrics.task
    stitcher = None
    if (tiles := tiling(loader.dataset)) is not None:
        source, index = tiles
        stitcher = RegionStitcher(source, (index[i] for i in loader.sampler))
    for batch in loader:
        outputs = model(*task.model_inputs(batch, device, dtype))
        target = task.batch_target(batch, device)
        if stitcher is None:
            metrics.update(outputs, target)
            continue
        for region_outputs, region_target in stitcher.add(outputs, target):
            metrics.update(region_outputs, region_target)
    if stitcher is not None and (last := stitcher.finish()) is not None:
        metrics.update(*last)
    result = Evaluation(metrics.compute(), metrics.scored_pixels())
    model.train(was_training)
    return result


class RegionStitcher:
    """Blends the outputs of a dense task's evaluation tiles, coming in the order of their regions,
    into one output and one target per region (a batch of one).

    Pixels of a region that no tile given covers (a ``Subset`` of its tiles) hold the unscored label
    (masks) or NaN (images) in the target.

    Args:
        dataset: the dataset of the tiles.
        indices: the tile index of each sample, in the order the samples come.
    """

    def __init__(self, dataset: FinetuneDataset, indices: Iterator[int]) -> None:
        self.dataset = dataset
        self.indices = indices
        self.region: int | None = None
        self.weights: Tensor | None = None  # of a tile's output, once its size is known
        self.sums: tuple[Tensor, Tensor, Tensor] | None = None  # scores, weights, target of the region

    def add(self, outputs: Tensor, target: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """Add a batch of tiles' outputs and targets; yields each region they complete."""
        size = self.dataset.img_size
        for output, tile_target in zip(outputs.detach().float(), target, strict=True):
            region, top, left = self.dataset.tiles[next(self.indices)]
            factor = output.shape[-1] // size
            if region != self.region:
                if (done := self.finish()) is not None:
                    yield done
                self._start(region, output, tile_target, factor)
            height, width = self.dataset.extents[region]
            rows, cols = min(size, height - top) * factor, min(size, width - left) * factor
            top, left = top * factor, left * factor
            scores, weight_sum, whole = self.sums
            add_tile(scores, weight_sum, output, self.weights, top, left, rows, cols)
            whole[..., top : top + rows, left : left + cols] = tile_target[..., :rows, :cols]

    def finish(self) -> tuple[Tensor, Tensor] | None:
        """The blended output and the target of the region in progress, if any, which is then done."""
        if self.sums is None:
            return None
        scores, weight_sum, whole = self.sums
        self.region, self.sums = None, None
        return (scores / weight_sum)[None], whole[None]

    def _start(self, region: int, output: Tensor, tile_target: Tensor, factor: int) -> None:
        height, width = (side * factor for side in self.dataset.extents[region])
        fill = float("nan") if tile_target.is_floating_point() else self.dataset.mask_fill
        self.region = region
        if self.weights is None:
            self.weights = torch.from_numpy(blend_weights(output.shape[-1])).to(output.device)
        self.sums = (
            output.new_zeros((output.shape[0], height, width)),
            output.new_zeros((height, width)),
            tile_target.new_full((*tile_target.shape[:-2], height, width), fill),
        )


def format_metrics(values: dict[str, float]) -> str:
    """Metrics for a log line: ``miou 0.5698, accuracy 0.7270``."""
    return ", ".join(f"{name} {value:.4f}" for name, value in values.items())


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
    samples = len(dataset.regions)  # scenes, or windows of them: a dense task's tiles are scored as one
    return eval_record(cfg, split, evaluation, run_dir=str(run_dir), samples=samples, selected=record)
