"""Server side of a round's uploads: screening, decoding and data-weighted averaging.

Every upload passes absolute checks first: a well-formed packet (:class:`~geofm.errors.CodecError`
otherwise), the model's number of values, the configured bit width, finite values and a positive
example count. With at least ``min_uploads_for_norm_rule`` uploads left, an update whose L2 norm
exceeds ``norm_factor`` times the median norm of those uploads is rejected too. The ratio to the
median is used rather than a MAD rule because with the few clients of a federation (3-20) the MAD
is often near zero and would reject ordinary spread; the median itself tolerates up to half of
the uploads being outliers. Rejected uploads come back with a reason for the caller to log.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from geofm.errors import CodecError, ConfigError, LayoutMismatchError
from geofm.federated.codec import Packet, decode


@dataclass(frozen=True, eq=False)
class Upload:
    """One client's upload of a round.

    Attributes:
        client: the client's id, as the caller logs it.
        packet: the encoded update, or its arrays as they arrived (:meth:`Packet.to_arrays`).
        num_examples: number of local training examples, the client's weight.
    """

    client: str
    packet: Packet | Mapping[str, np.ndarray]
    num_examples: int


@dataclass(frozen=True)
class Rejection:
    """An upload left out of the round, and why."""

    client: str
    reason: str


@dataclass(frozen=True, eq=False)
class Accepted:
    """An upload that passed screening, with its decoded update (float32 CPU vector)."""

    client: str
    update: Tensor
    num_examples: int


@dataclass(frozen=True)
class UploadRules:
    """What the server accepts in a round.

    Attributes:
        num_values: length of the model's update vector.
        bits: the configured bit width of uploads.
        norm_factor: reject updates with a norm above this multiple of the round's median norm.
        min_uploads_for_norm_rule: apply the norm rule only with at least this many uploads
            (after the absolute checks); below it, only the absolute checks apply.
    """

    num_values: int
    bits: int
    norm_factor: float = 10.0
    min_uploads_for_norm_rule: int = 3

    def __post_init__(self) -> None:
        if self.norm_factor <= 1.0:
            raise ConfigError(f"norm_factor must be greater than 1, got {self.norm_factor}")
        if self.min_uploads_for_norm_rule < 3:
            raise ConfigError(f"min_uploads_for_norm_rule must be at least 3, got {self.min_uploads_for_norm_rule}")


@dataclass(frozen=True, eq=False)
class RoundAggregate:
    """The outcome of a round's uploads.

    Attributes:
        update: data-weighted mean of the accepted updates, or None if none was accepted.
        accepted: the accepted uploads with their decoded updates, in upload order.
        weights: each accepted upload's weight (its share of the accepted examples).
        rejected: the uploads left out, with reasons.
    """

    update: Tensor | None
    accepted: list[Accepted]
    weights: list[float]
    rejected: list[Rejection]


def weighted_mean(vectors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum_i w_i v_i / sum_i w_i`` of equally long vectors, as a new float32 tensor.

    Raises:
        LayoutMismatchError: if the vectors differ in shape.
        ValueError: if there are no vectors, the counts differ, or a weight is negative or all are zero.
    """
    if not vectors or len(vectors) != len(weights):
        raise ValueError(
            f"expected one weight per vector and at least one vector, got {len(vectors)} and {len(weights)}"
        )
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    total = float(sum(weights))
    mean = torch.zeros_like(vectors[0], dtype=torch.float32)
    for vector, weight in zip(vectors, weights, strict=True):
        if vector.shape != mean.shape:
            raise LayoutMismatchError(f"cannot average vectors of shapes {tuple(mean.shape)} and {tuple(vector.shape)}")
        mean.add_(vector, alpha=weight / total)
    return mean


def _check(upload: Upload, rules: UploadRules) -> tuple[Tensor | None, str | None]:
    """Decode one upload and apply the absolute checks: (update, None) or (None, reason)."""
    if upload.num_examples <= 0:
        return None, f"reports {upload.num_examples} training examples; expected a positive count"
    try:
        packet = upload.packet if isinstance(upload.packet, Packet) else Packet.from_arrays(upload.packet)
    except CodecError as exc:
        return None, f"malformed packet: {exc}"
    if packet.n != rules.num_values:
        return None, f"update has {packet.n} values; the model has {rules.num_values}"
    if packet.bits != rules.bits:
        return None, f"update is encoded with {packet.bits} bits; the round expects {rules.bits}"
    update = decode(packet)
    if packet.bits == 32 and not bool(torch.isfinite(update).all()):
        return None, f"update holds {int((~torch.isfinite(update)).sum())} NaN or Inf values"
    return update, None


def screen_uploads(uploads: Sequence[Upload], rules: UploadRules) -> tuple[list[Accepted], list[Rejection]]:
    """Decode a round's uploads and sort them into accepted and rejected (see the module docstring).

    The norm rule is skipped when the median norm is zero: it then says nothing about scale.

    Returns:
        The accepted uploads with their decoded updates, and the rejections, each in upload order.
    """
    passed: list[tuple[int, Accepted]] = []
    rejected: list[tuple[int, Rejection]] = []
    for index, upload in enumerate(uploads):
        update, reason = _check(upload, rules)
        if reason is None:
            passed.append((index, Accepted(upload.client, update, upload.num_examples)))
        else:
            rejected.append((index, Rejection(upload.client, reason)))
    accepted = passed
    if len(passed) >= rules.min_uploads_for_norm_rule:
        norms = [float(torch.linalg.vector_norm(a.update)) for _, a in passed]
        median = statistics.median(norms)
        if median > 0:
            limit = rules.norm_factor * median
            accepted = [item for item, norm in zip(passed, norms, strict=True) if norm <= limit]
            for (index, a), norm in zip(passed, norms, strict=True):
                if norm > limit:
                    reason = (
                        f"update norm {norm:.4g} exceeds {rules.norm_factor:g} x the round's median norm {median:.4g}"
                    )
                    rejected.append((index, Rejection(a.client, reason)))
    return [a for _, a in accepted], [r for _, r in sorted(rejected, key=lambda item: item[0])]


def aggregate_uploads(uploads: Sequence[Upload], rules: UploadRules) -> RoundAggregate:
    """Screen a round's uploads and average the accepted updates weighted by their example counts."""
    accepted, rejected = screen_uploads(uploads, rules)
    if not accepted:
        return RoundAggregate(update=None, accepted=[], weights=[], rejected=rejected)
    total = sum(a.num_examples for a in accepted)
    weights = [a.num_examples / total for a in accepted]
    update = weighted_mean([a.update for a in accepted], weights)
    return RoundAggregate(update=update, accepted=accepted, weights=weights, rejected=rejected)
