"""Scene classification: one class per image, cross-entropy with optional Mixup/CutMix and label smoothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from geofm.tasks.finetuning.base import FinetuneTask

if TYPE_CHECKING:
    from torch import nn
    from torchmetrics import Metric

    from geofm.data.finetune import TaskData


class Classification(FinetuneTask):
    """``image`` -> ``label`` (int64); timm's linear classifier; overall accuracy; not predicted per pixel."""

    name = "classification"
    target = "label"
    output = "logits"
    default_head = "linear"
    primary_metric = "accuracy"
    mixes = True

    @classmethod
    def data(cls) -> TaskData:
        from geofm.data.finetune import TaskData
        from geofm.data.finetune.classification import ClassFolders
        from geofm.data.finetune.torchgeo import classification_scene

        return TaskData(cls.name, ClassFolders, cls.target, classification_scene, stratified=True, class_targets=True)

    def build_criterion(self) -> nn.Module:
        from timm.loss import SoftTargetCrossEntropy
        from torch import nn

        if self.cfg.finetune.mixing:
            return SoftTargetCrossEntropy()
        return nn.CrossEntropyLoss(label_smoothing=self.cfg.finetune.label_smoothing)

    def build_mixing(self) -> Any:
        """timm's Mixup/CutMix (it also smooths the labels), or None; it draws from numpy's global
        generator: seed that per step to repeat a run."""
        opt = self.cfg.finetune
        if not opt.mixing:
            return None
        from timm.data import Mixup

        return Mixup(
            mixup_alpha=opt.mixup,
            cutmix_alpha=opt.cutmix,
            prob=opt.mix_prob,
            switch_prob=opt.mix_switch_prob,
            label_smoothing=opt.label_smoothing,
            num_classes=self.cfg.data.num_classes,
        )

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.classification import MulticlassAccuracy

        return {"accuracy": MulticlassAccuracy(self.cfg.data.num_classes, average="micro")}
