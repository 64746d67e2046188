"""A task's evaluation metrics, from torchmetrics, accumulated over batches and synchronised across processes.

==================  ========================================================================================
``classification``  ``accuracy``: overall (micro) accuracy
``multilabel``      ``map_micro``, ``map_macro``: average precision over all (label, image) pairs and mean
                    per label; ``f1_micro`` at probability 0.5
``segmentation``    ``miou``: mean IoU over the classes present in predictions or targets; ``accuracy``:
                    pixel accuracy; ``iou/<class>`` per class (0 for a class in neither), but the
                    ignored one. Pixels at ``data.ignore_index`` and padding are left out.
``change``          ``f1``, ``precision``, ``recall``, ``iou`` of the change class (the argmax of the logits)
``superres``        ``psnr`` (mean over images) and ``ssim`` of the high-resolution bands, in scaled units
                    (``raw * scale`` of ``data.hr``, default ``data``) over ``[0, finetune.superres_data_range]``,
                    on each image's area without padding (an image under SSIM's 11 px window counts for
                    PSNR only)
==================  ========================================================================================

Padding of scenes smaller than the model's input never counts: masks carry the unscored label
there, super-resolution targets NaN. :meth:`TaskMetrics.scored_pixels` says how many target pixels
the metrics of a dense task counted.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection, SumMetric
from torchmetrics.classification import (
    BinaryF1Score,
    BinaryJaccardIndex,
    BinaryPrecision,
    BinaryRecall,
    MulticlassAccuracy,
    MulticlassJaccardIndex,
    MultilabelAveragePrecision,
    MultilabelF1Score,
)
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from geofm.config.finetune import FinetuneConfig, class_labels, metric_names
from geofm.data.finetune import BandNormaliser

SSIM_WINDOW = 11
"""Side of the Gaussian window of torchmetrics' SSIM (its default)."""


def _metrics(cfg: FinetuneConfig) -> dict[str, Metric]:
    k, ignore = cfg.data.num_classes, cfg.data.unscored_label
    if cfg.task == "classification":
        return {"accuracy": MulticlassAccuracy(k, average="micro")}
    if cfg.task == "multilabel":
        return {
            "map_micro": MultilabelAveragePrecision(k, average="micro"),
            "map_macro": MultilabelAveragePrecision(k, average="macro"),
            "f1_micro": MultilabelF1Score(k, average="micro"),
        }
    if cfg.task == "segmentation":
        return {
            "miou": MulticlassJaccardIndex(k, average="macro", ignore_index=ignore),
            "accuracy": MulticlassAccuracy(k, average="micro", ignore_index=ignore),
            "iou": MulticlassJaccardIndex(k, average="none", ignore_index=ignore),
        }
    if cfg.task == "change":
        return {
            "f1": BinaryF1Score(ignore_index=ignore),
            "precision": BinaryPrecision(ignore_index=ignore),
            "recall": BinaryRecall(ignore_index=ignore),
            "iou": BinaryJaccardIndex(ignore_index=ignore),
        }
    data_range = (0.0, cfg.finetune.superres_data_range)
    return {
        "psnr": PeakSignalNoiseRatio(data_range=data_range, dim=(1, 2, 3)),
        "ssim": StructuralSimilarityIndexMeasure(data_range=data_range),
    }


class TaskMetrics:
    """The metrics of a task: :meth:`update` with each batch's outputs and targets, then :meth:`compute`.

    Under several processes, :meth:`compute` gathers every process's state (torchmetrics), so each
    process returns the metrics of the whole evaluation set.
    """

    def __init__(self, cfg: FinetuneConfig, device: torch.device | str = "cpu") -> None:
        """Initialise a new TaskMetrics instance.

        Args:
            cfg: the finetuning config (task, classes, ignore index, normalisation of superres).
            device: where the metric states live (that of the outputs).
        """
        self.task = cfg.task
        self.names = metric_names(cfg.task, cfg.data.num_classes, cfg.data.class_names, cfg.data.ignore_index)
        self.classes = class_labels(cfg.data.num_classes or 0, cfg.data.class_names)
        self.collection = MetricCollection(_metrics(cfg)).to(device)
        self.unscored_label = cfg.data.unscored_label
        self.pixels = SumMetric().to(device) if cfg.task in ("segmentation", "change", "superres") else None
        if cfg.task == "superres":
            targets = BandNormaliser.for_targets(cfg.data)
            self.mean = torch.from_numpy(targets.mean).to(device)[None]
            self.std = torch.from_numpy(targets.std).to(device)[None]

    def update(self, outputs: Tensor, target: Tensor) -> None:
        """Add a batch: the model's outputs (logits, or normalised images) and the batch's target."""
        outputs = outputs.detach().float()
        if self.task in ("segmentation", "change"):
            self.pixels.update((target != self.unscored_label).sum())
            self.collection.update(outputs.argmax(dim=1), target)
        elif self.task == "multilabel":
            self.collection.update(outputs, target.long())
        elif self.task == "superres":
            self.pixels.update(torch.isfinite(target).all(dim=1).sum())
            self._update_superres(outputs * self.std + self.mean, target.float() * self.std + self.mean)
        else:
            self.collection.update(outputs, target)

    def _update_superres(self, outputs: Tensor, targets: Tensor) -> None:
        """Each image on its area without padding (NaN, at the bottom and right of a small scene)."""
        for output, target in zip(outputs, targets, strict=True):
            finite = torch.isfinite(target).all(dim=0)
            rows, cols = int(finite.any(dim=1).sum()), int(finite.any(dim=0).sum())
            if not rows or not cols:
                continue
            pair = output[None, :, :rows, :cols], target[None, :, :rows, :cols]
            self.collection["psnr"].update(*pair)
            if min(rows, cols) >= SSIM_WINDOW:
                self.collection["ssim"].update(*pair)

    def compute(self) -> dict[str, float]:
        """The metrics of everything added, in :func:`~geofm.config.finetune.metric_names` order."""
        values = self.collection.compute()
        flat: dict[str, float] = {}
        for name, value in values.items():
            if value.ndim:
                flat.update(
                    {f"{name}/{label}": float(v) for label, v in zip(self.classes, value.tolist(), strict=True)}
                )
            else:
                flat[name] = float(value)
        return {name: flat[name] for name in self.names}

    def scored_pixels(self) -> int | None:
        """Target pixels the metrics counted, of everything added (None: not a dense task).

        Neither padding nor pixels at ``data.ignore_index``; super-resolution: high-resolution pixels.
        """
        return None if self.pixels is None else int(self.pixels.compute())

    def reset(self) -> None:
        """Forget every batch added."""
        self.collection.reset()
        if self.pixels is not None:
            self.pixels.reset()
