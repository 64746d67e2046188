"""Multi-label classification: a multi-hot label per image, binary cross-entropy, mean average precision."""

from __future__ import annotations

from typing import TYPE_CHECKING

from geofm.tasks.finetuning.base import FinetuneTask

if TYPE_CHECKING:
    from torch import Tensor, nn
    from torchmetrics import Metric

    from geofm.data.finetune import TaskData
    from geofm.tasks.finetuning.metrics import TaskMetrics


class Multilabel(FinetuneTask):
    """``image`` -> ``label`` (float multi-hot); timm's linear classifier; micro/macro mAP and micro F1."""

    name = "multilabel"
    target = "label"
    output = "logits"
    default_head = "linear"
    primary_metric = "map_micro"
    float_target = True

    @classmethod
    def metric_names(
        cls, num_classes: int | None, class_names: list[str] | None, ignore_index: int | None
    ) -> list[str]:
        return ["map_micro", "map_macro", "f1_micro"]

    @classmethod
    def data(cls) -> TaskData:
        from geofm.data.finetune import TaskData
        from geofm.data.finetune.multilabel import MultilabelFolder
        from geofm.data.finetune.torchgeo import multilabel_scene

        return TaskData(cls.name, MultilabelFolder, cls.target, multilabel_scene, stratified=True)

    def build_criterion(self) -> nn.Module:
        from torch import nn

        return nn.BCEWithLogitsLoss()

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.classification import MultilabelAveragePrecision, MultilabelF1Score

        k = self.cfg.data.num_classes
        return {
            "map_micro": MultilabelAveragePrecision(k, average="micro"),
            "map_macro": MultilabelAveragePrecision(k, average="macro"),
            "f1_micro": MultilabelF1Score(k, average="micro"),
        }

    def update_metrics(self, metrics: TaskMetrics, outputs: Tensor, target: Tensor) -> None:
        metrics.collection.update(outputs, target.long())
