"""The losses of the finetuning tasks; each task (``geofm/tasks/finetuning/``) declares its inputs, target and loss.

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
unscored label, see :attr:`~geofm.config.finetune_data.FinetuneDataConfig.unscored_label`) and finite
target pixels (padding is NaN). A batch without one is a loss of 0 with the graph intact, not a NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
