"""What a task's model reads from a batch, what it is compared with, and the loss.

==================  ================================  ===============================================
task                inputs -> target                  loss
==================  ================================  ===============================================
``classification``  ``image`` -> ``label``           cross-entropy (label smoothing), or timm's
                                                      SoftTargetCrossEntropy after timm's Mixup/CutMix
``multilabel``      ``image`` -> ``label`` multi-hot  BCE with logits
``segmentation``    ``image`` -> ``mask``            cross-entropy, ``data.ignore_index`` left out
``change``          ``image1``, ``image2`` -> ``mask``  cross-entropy over (no change, change)
``superres``        ``image`` -> ``target``          L1
==================  ================================  ===============================================

Dense losses are means over the pixels that count: labelled mask pixels (padding carries the
unscored label, see :attr:`~geofm.config.finetune.FinetuneDataConfig.unscored_label`) and finite
target pixels (padding is NaN). A batch without one is a loss of 0 with the graph intact, not a NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor, nn

from geofm.config.finetune import FinetuneConfig

INPUT_KEYS = {
    "classification": ("image",),
    "multilabel": ("image",),
    "segmentation": ("image",),
    "change": ("image1", "image2"),
    "superres": ("image",),
}
TARGET_KEY = {
    "classification": "label",
    "multilabel": "label",
    "segmentation": "mask",
    "change": "mask",
    "superres": "target",
}


def model_inputs(task: str, batch: dict[str, Tensor], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The model's inputs of a batch, on ``device`` in ``dtype``."""
    return [batch[key].to(device, dtype, non_blocking=True) for key in INPUT_KEYS[task]]


def batch_target(task: str, batch: dict[str, Tensor], device: torch.device) -> Tensor:
    """The target of a batch, on ``device``: int64 labels or masks, float multi-hot or images."""
    return batch[TARGET_KEY[task]].to(device, non_blocking=True)


def build_criterion(cfg: FinetuneConfig) -> nn.Module:
    """The task's training loss of (outputs, target)."""
    task = cfg.task
    if task == "classification":
        if cfg.finetune.mixing:
            return SoftTargetCrossEntropy()
        return nn.CrossEntropyLoss(label_smoothing=cfg.finetune.label_smoothing)
    if task == "multilabel":
        return nn.BCEWithLogitsLoss()
    if task in ("segmentation", "change"):
        return LabelledCrossEntropy(cfg.data.unscored_label)
    return FiniteL1()


class LabelledCrossEntropy(nn.Module):
    """Cross-entropy averaged over the labelled pixels; 0 for a batch without any (never NaN)."""

    def __init__(self, unscored_label: int) -> None:
        super().__init__()
        self.unscored_label = unscored_label

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        total = F.cross_entropy(logits, target, ignore_index=self.unscored_label, reduction="sum")
        return total / (target != self.unscored_label).sum().clamp(min=1)


class FiniteL1(nn.Module):
    """L1 averaged over the finite target pixels (padding is NaN); 0 for a batch without any."""

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        valid = torch.isfinite(target)
        difference = torch.where(valid, output - target.nan_to_num(), 0.0)
        return difference.abs().sum() / valid.sum().clamp(min=1)


def build_mixing(cfg: FinetuneConfig) -> Mixup | None:
    """timm's Mixup/CutMix for classification training batches (it also smooths the labels), or None.

    It draws from numpy's global generator: seed that per step to repeat a run.
    """
    opt = cfg.finetune
    if not opt.mixing:
        return None
    return Mixup(
        mixup_alpha=opt.mixup,
        cutmix_alpha=opt.cutmix,
        prob=opt.mix_prob,
        switch_prob=opt.mix_switch_prob,
        label_smoothing=opt.label_smoothing,
        num_classes=cfg.data.num_classes,
    )
