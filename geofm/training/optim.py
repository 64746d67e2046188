"""Optimizer pieces that need no training engine: AdamW's parameter groups.

:mod:`geofm.training.engine` builds its optimizer from these; plain-PyTorch steps (the GPU device check,
which runs where DeepSpeed is not installed) use the same groups.
"""

from __future__ import annotations

from timm.optim import param_groups_weight_decay
from torch import nn


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on norms, biases and the model's ``no_weight_decay()`` names.

    Frozen parameters are left out, so a teacher inside ``model`` would get no optimizer state.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    return param_groups_weight_decay(model, weight_decay=weight_decay, no_weight_decay_list=skip)
