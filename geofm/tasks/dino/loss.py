"""DINO's self-distillation objective: cross-entropy of sharpened, centred teacher outputs and the student's.

Caron et al. 2021, Eq. 1 and Sec. 3.1, as the paper writes them:

* ``P_t(x) = softmax((g_t(x) - c) / tau_t)``, ``P_s(x) = softmax(g_s(x) / tau_s)``;
* ``loss = mean over pairs (x in global views, x' in all views, x' != x) of -P_t(x) . log P_s(x')``,
  each pair's cross-entropy averaged over the batch;
* the centre ``c <- m c + (1 - m) mean_batch g_t``, ``m`` 0.9, over every process's batch;
* the teacher ``theta_t <- l theta_t + (1 - l) theta_s`` with ``l`` following a cosine from
  ``l_0`` (0.996) to 1 over training;
* ``tau_t`` warms up linearly from ``warmup_teacher_temp`` to ``teacher_temp``.

geofm schedules the temperature warm-up and the momentum over the fraction of training done (steps
of a central run, rounds and local steps of a federated one) instead of epochs, so one setting means
the same in both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def dino_loss(
    student: Tensor, teacher: Tensor, centre: Tensor, student_temp: float, teacher_temp: float, global_views: int
) -> tuple[Tensor, Tensor]:
    """The loss of one batch and the teacher's probabilities.

    Args:
        student: (V * B, K) student logits, view by view, the ``global_views`` global views first.
        teacher: (global_views * B, K) teacher logits of the global views, in the same order.
        centre: (K,) the running centre of the teacher's logits.
        student_temp, teacher_temp: the two temperatures (the teacher's is the sharper).
        global_views: how many of the views are global (the teacher sees only those).

    Returns:
        The scalar loss (float32) and the (global_views * B, K) teacher probabilities.
    """
    views = student.shape[0] * global_views // teacher.shape[0]
    log_p_student = F.log_softmax(student.float() / student_temp, dim=-1).chunk(views)
    p_teacher = F.softmax((teacher.float() - centre) / teacher_temp, dim=-1)
    total, pairs = student.new_zeros((), dtype=torch.float32), 0
    for t, q in enumerate(p_teacher.chunk(global_views)):
        for s, log_p in enumerate(log_p_student):
            if s == t:
                continue
            total = total + torch.sum(-q * log_p, dim=-1).mean()
            pairs += 1
    return total / pairs, p_teacher


def updated_centre(centre: Tensor, batch_mean: Tensor, momentum: float) -> Tensor:
    """``m c + (1 - m) mean``: the centre after a step whose teacher logits averaged ``batch_mean``."""
    return centre * momentum + batch_mean * (1.0 - momentum)


def teacher_momentum(progress: float, base: float) -> float:
    """The EMA momentum at ``progress`` (0 to 1) of training: a cosine from ``base`` up to 1."""
    progress = min(max(progress, 0.0), 1.0)
    return 1.0 - (1.0 - base) * (math.cos(math.pi * progress) + 1.0) / 2.0


def teacher_temperature(progress: float, start: float, end: float, warmup: float) -> float:
    """The teacher's temperature at ``progress``: linear from ``start`` to ``end`` over the first ``warmup`` of training."""
    if warmup <= 0.0 or progress >= warmup:
        return end
    return start + (end - start) * max(progress, 0.0) / warmup


def entropy(probabilities: Tensor) -> Tensor:
    """Mean entropy (nats) of rows of probabilities: near 0 when the teacher collapses to one prototype,
    ``log K`` when it collapses to the uniform distribution."""
    return -(probabilities * torch.log(probabilities.clamp_min(1e-12))).sum(dim=-1).mean()


__all__ = ["dino_loss", "entropy", "teacher_momentum", "teacher_temperature", "updated_centre"]
