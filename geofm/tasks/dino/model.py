"""DINO's networks on a timm backbone: the projection head, the student over multi-crop views, the EMA teacher.

Caron et al., "Emerging Properties in Self-Supervised Vision Transformers" (ICCV 2021). The student
is a backbone (its pooled representation: a ViT's class token, a Swin's average-pooled final map,
timm's ``forward_head(pre_logits=True)``) followed by :class:`ProjectionHead`; views of one size run
through the backbone together (DINO's multi-crop wrapper), so the global and the local crops cost
two backbone calls. The backbone is built with ``dynamic_img_size`` so local crops run at their own
size. :class:`EmaTeacher` holds the teacher's weights in float32 outside the training engine: under
bf16 an exponential moving average with momentum near 1 would round most of its increments away.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import Tensor, nn


class ProjectionHead(nn.Module):
    """DINO's head: an MLP to a bottleneck, L2-normalised, then a linear layer to ``out_dim`` prototypes.

    With ``norm_last_layer`` the last layer's weight rows are normalised to unit length at every call
    (DINO's weight normalisation with its gain fixed at 1), which stabilises training.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        layers: int = 3,
        norm_last_layer: bool = True,
    ) -> None:
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (layers - 1) + [bottleneck_dim]
        blocks: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            blocks.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                blocks.append(nn.GELU())
        self.mlp = nn.Sequential(*blocks)
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        self.norm_last_layer = norm_last_layer
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        weight = F.normalize(self.last_layer.weight, dim=1) if self.norm_last_layer else self.last_layer.weight
        return F.linear(x, weight)


def pooled_representation(encoder: nn.Module, images: Tensor) -> Tensor:
    """(B, D) representation of a timm backbone: the class token of a ViT, the pooled map of a Swin."""
    return encoder.forward_head(encoder.forward_features(images), pre_logits=True)


class DinoStudent(nn.Module):
    """The trained network: ``encoder`` (a plain timm backbone) and ``head``; its state-dict keys say so.

    Called with the views of a batch (a sequence of (B, C, H, W) tensors, global views first), it
    returns the head's logits of every view stacked view by view: (V * B, out_dim).
    """

    def __init__(self, encoder: nn.Module, head: ProjectionHead) -> None:
        super().__init__()
        self.encoder, self.head = encoder, head

    def no_weight_decay(self) -> set[str]:
        """The encoder's own exemptions (position embeddings, tokens), under their names here."""
        own = getattr(self.encoder, "no_weight_decay", set)()
        return {f"encoder.{name}" for name in own}

    def forward(self, views: Sequence[Tensor]) -> Tensor:
        features, start = [], 0
        while start < len(views):  # consecutive views of one size run through the backbone together
            end = start
            while end < len(views) and views[end].shape[-2:] == views[start].shape[-2:]:
                end += 1
            features.append(pooled_representation(self.encoder, torch.cat(list(views[start:end]))))
            start = end
        return self.head(torch.cat(features))


class EmaTeacher(nn.Module):
    """A float32 copy of the student updated as ``teacher <- m teacher + (1 - m) student`` after each step.

    It is never trained (no gradients) and runs its forward under autocast to the training dtype.
    """

    def __init__(self, student: DinoStudent) -> None:
        super().__init__()
        self.network = copy.deepcopy(student).float().requires_grad_(False).eval()

    @torch.no_grad()
    def update(self, student: nn.Module, momentum: float) -> None:
        """One EMA step towards ``student`` (its parameters in any dtype, e.g. the engine's bf16 module)."""
        ours = list(self.network.parameters())
        theirs = [p.detach().float() for p in student.parameters()]
        torch._foreach_mul_(ours, momentum)
        torch._foreach_add_(ours, theirs, alpha=1.0 - momentum)

    @torch.no_grad()
    def forward(self, views: Sequence[Tensor]) -> Tensor:
        """The logits of ``views`` (float32), computed in the views' dtype."""
        first = views[0]
        with torch.autocast(first.device.type, dtype=first.dtype, enabled=first.dtype != torch.float32):
            return self.network(list(views)).float()


__all__ = ["DinoStudent", "EmaTeacher", "ProjectionHead", "pooled_representation"]
