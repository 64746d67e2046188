"""Change detection: a before and an after image, a change mask, a siamese UperNet, F1 of the change class."""

from __future__ import annotations

from typing import TYPE_CHECKING

from geofm.tasks.finetuning.base import MaskTask

if TYPE_CHECKING:
    from torchmetrics import Metric

    from geofm.config.finetune import FinetuneConfig
    from geofm.data.finetune import TaskData


class Change(MaskTask):
    """``image1``, ``image2`` -> ``mask`` in {0, 1} (2 classes); ``geofm predict`` takes two scenes."""

    name = "change"
    inputs = ("image1", "image2")
    default_head = "siamese_upernet"
    primary_metric = "f1"
    scenes = "a before and an after scene"

    @classmethod
    def check_config(cls, cfg: FinetuneConfig) -> None:
        super().check_config(cfg)
        if cfg.data.num_classes != 2:
            raise ValueError(
                f"task change has 2 classes (no change, change), got data.num_classes {cfg.data.num_classes}"
            )

    @classmethod
    def metric_names(
        cls, num_classes: int | None, class_names: list[str] | None, ignore_index: int | None
    ) -> list[str]:
        return ["f1", "precision", "recall", "iou"]

    @classmethod
    def data(cls) -> TaskData:
        from geofm.data.finetune import TaskData
        from geofm.data.finetune.change import ChangeFolders
        from geofm.data.finetune.torchgeo import change_scene

        return TaskData(cls.name, ChangeFolders, cls.target, change_scene, dense=True, labelled_masks=True)

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.classification import BinaryF1Score, BinaryJaccardIndex, BinaryPrecision, BinaryRecall

        ignore = self.cfg.data.unscored_label
        return {
            "f1": BinaryF1Score(ignore_index=ignore),
            "precision": BinaryPrecision(ignore_index=ignore),
            "recall": BinaryRecall(ignore_index=ignore),
            "iou": BinaryJaccardIndex(ignore_index=ignore),
        }
