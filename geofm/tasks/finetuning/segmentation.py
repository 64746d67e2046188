"""Semantic segmentation: a class per pixel, UperNet, cross-entropy over labelled pixels, mIoU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from geofm.tasks.finetuning.base import MaskTask

if TYPE_CHECKING:
    from torchmetrics import Metric

    from geofm.data.finetune import TaskData


class Segmentation(MaskTask):
    """``image`` -> ``mask`` (int64, unscored pixels at ``data.unscored_label``); ``geofm predict`` writes class maps."""

    name = "segmentation"
    default_head = "upernet"
    primary_metric = "miou"

    @classmethod
    def metric_names(
        cls, num_classes: int | None, class_names: list[str] | None, ignore_index: int | None
    ) -> list[str]:
        """mIoU, pixel accuracy and ``iou/<class>`` per class but the ignored one."""
        from geofm.config.finetune import class_labels

        labels = class_labels(num_classes or 0, class_names)
        return ["miou", "accuracy"] + [f"iou/{name}" for i, name in enumerate(labels) if i != ignore_index]

    @classmethod
    def data(cls) -> TaskData:
        from geofm.data.finetune import TaskData
        from geofm.data.finetune.segmentation import SegmentationFolders
        from geofm.data.finetune.torchgeo import segmentation_scene

        return TaskData(cls.name, SegmentationFolders, cls.target, segmentation_scene, dense=True, labelled_masks=True)

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

        k, ignore = self.cfg.data.num_classes, self.cfg.data.unscored_label
        return {
            "miou": MulticlassJaccardIndex(k, average="macro", ignore_index=ignore),
            "accuracy": MulticlassAccuracy(k, average="micro", ignore_index=ignore),
            "iou": MulticlassJaccardIndex(k, average="none", ignore_index=ignore),
        }
