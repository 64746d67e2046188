"""A task's evaluation metrics, from torchmetrics, accumulated over batches and synchronised across processes.

Each task declares its metrics and how a batch updates them (``geofm/tasks/finetuning/``); the built-in ones:

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
from torchmetrics import MetricCollection, SumMetric

from geofm.config.finetune import FinetuneConfig, class_labels
from geofm.tasks.finetuning import task_of


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
        self.task = task = task_of(cfg)
        self.names = task.metric_names(cfg.data.num_classes, cfg.data.class_names, cfg.data.ignore_index)
        self.classes = class_labels(cfg.data.num_classes or 0, cfg.data.class_names)
        self.collection = MetricCollection(task.metrics()).to(device)
        self.pixels = SumMetric().to(device) if task.dense else None

    def update(self, outputs: Tensor, target: Tensor) -> None:
        """Add a batch: the model's outputs (logits, or normalised images) and the batch's target."""
        self.task.update_metrics(self, outputs.detach().float(), target)

    def compute(self) -> dict[str, float]:
        """The metrics of everything added, in the order of the task's ``metric_names``."""
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
