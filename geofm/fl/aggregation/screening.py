"""Screening of a round's uploads: absolute checks, the norm rule and the bounds on example counts.

Every upload passes absolute checks first: a well-formed packet (:class:`~geofm.errors.CodecError`
otherwise), the model's number of values, the configured bit width, a positive example count, and
a decoded update whose values and float32 L2 norm are finite, at every bit width (a 1-bit packet
with huge finite scales decodes to infinities).

The norm rule then rejects an update whose L2 norm exceeds ``norm_factor`` times a reference: the
median norm of the round's uploads when at least ``min_uploads_for_norm_rule`` passed the absolute
checks, otherwise the median of the norms accepted in recent rounds (``recent_norms``, kept by the
server) when it has that many; with neither (the first rounds of a one- or two-client federation)
only the absolute checks apply. The ratio to a median is used rather than a MAD rule because with
the few clients of a federation (3-20) the MAD is often near zero and would reject ordinary spread;
the median itself tolerates up to half of the uploads being outliers.

A client's weight is its example count, bounded: never more than the count declared for its
institution (``declared_examples``), and never more than ``examples_factor`` times the median
count of the round's other accepted uploads, so that one client claiming 10^9 examples cannot take
the round. Rejected uploads come back with a reason, bounded counts with both numbers, for the
caller to log. The accepted updates are then combined (:mod:`~geofm.fl.aggregation.uploads`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geofm.errors import CodecError, ConfigError
from geofm.fl.communication.codec import Packet, decode


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
    """An upload that passed screening: its encoded update, as it arrived, and its L2 norm.

    ``num_examples`` is the weight the round gives it: the claimed count after the bounds;
    ``metadata`` is what else the client reported with it (:class:`~geofm.fl.aggregation.uploads.ClientUpload`).
    """

    client: str
    packet: Packet | Mapping[str, np.ndarray]
    num_examples: int
    norm: float
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def update(self) -> Tensor:
        """The decoded update (a new float32 CPU vector), decoded afresh at each access: the server keeps
        the encoded uploads, never every decoded one."""
        return decode(_packet(self.packet))


class Decoded(Sequence[Tensor]):
    """Accepted uploads' updates, each decoded when it is taken and not kept: iterating over them holds
    one decoded update at a time."""

    def __init__(self, accepted: Sequence[Accepted]) -> None:
        self._accepted = list(accepted)

    def __len__(self) -> int:
        return len(self._accepted)

    def __getitem__(self, index: int | slice) -> Tensor | Decoded:
        if isinstance(index, slice):
            return Decoded(self._accepted[index])
        return self._accepted[index].update


@dataclass(frozen=True)
class UploadRules:
    """What the server accepts in a round.

    Attributes:
        num_values: length of the model's update vector.
        bits: the configured bit width of uploads.
        norm_factor: reject updates with a norm above this multiple of the round's median norm.
        min_uploads_for_norm_rule: compare with the round's median norm only with at least this
            many uploads (after the absolute checks); below it, with the median of the recent
            rounds' accepted norms if there are this many, else no norm rule.
        examples_factor: a client's weight counts at most this multiple of the median example
            count of the round's other accepted uploads; None: no such bound.
        declared_examples: the most examples each institution may claim (declared at deployment);
            institutions not listed are bounded by ``examples_factor`` only.
    """

    num_values: int
    bits: int
    norm_factor: float = 10.0
    min_uploads_for_norm_rule: int = 3
    examples_factor: float | None = 10.0
    declared_examples: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.norm_factor <= 1.0:
            raise ConfigError(f"norm_factor must be greater than 1, got {self.norm_factor}")
        if self.min_uploads_for_norm_rule < 3:
            raise ConfigError(f"min_uploads_for_norm_rule must be at least 3, got {self.min_uploads_for_norm_rule}")
        if self.examples_factor is not None and self.examples_factor < 1.0:
            raise ConfigError(f"examples_factor must be at least 1, got {self.examples_factor}")


def _packet(source: Packet | Mapping[str, np.ndarray]) -> Packet:
    """A packet, or one rebuilt (and checked) from its arrays."""
    return source if isinstance(source, Packet) else Packet.from_arrays(source)


def _check(upload: Upload, rules: UploadRules) -> tuple[float | None, str | None]:
    """Decode one upload and apply the absolute checks: (its update's L2 norm, None) or (None, reason).
    The decoded update is not kept."""
    if upload.num_examples <= 0:
        return None, f"reports {upload.num_examples} training examples; expected a positive count"
    try:
        packet = _packet(upload.packet)
    except CodecError as exc:
        return None, f"malformed packet: {exc}"
    if packet.n != rules.num_values:
        return None, f"update has {packet.n} values; the model has {rules.num_values}"
    if packet.bits != rules.bits:
        return None, f"update is encoded with {packet.bits} bits; the round expects {rules.bits}"
    update = decode(packet)
    if not bool(torch.isfinite(update).all()):
        bad = int((~torch.isfinite(update)).sum())
        return None, f"update decodes to {bad} NaN or Inf values ({packet.bits}-bit packet)"
    norm = float(torch.linalg.vector_norm(update))
    if not math.isfinite(norm):
        return None, f"update values are too large: its L2 norm overflows float32 ({packet.bits}-bit packet)"
    return norm, None


def screen_uploads(
    uploads: Sequence[Upload], rules: UploadRules, recent_norms: Sequence[float] = ()
) -> tuple[list[Accepted], list[Rejection]]:
    """Decode a round's uploads and sort them into accepted and rejected (see the module docstring).

    Each upload is decoded, checked and freed before the next; the accepted keep their encoded
    update and decode it again when it is taken.

    Args:
        uploads: the round's uploads.
        rules: what the server accepts.
        recent_norms: norms of updates accepted in recent rounds, the norm rule's reference when
            the round itself has too few uploads.

    The norm rule is skipped when the reference median is zero: it then says nothing about scale.

    Returns:
        The accepted uploads (counts not yet bounded), and the
        rejections, each in upload order.
    """
    passed: list[tuple[int, Accepted]] = []
    rejected: list[tuple[int, Rejection]] = []
    for index, upload in enumerate(uploads):
        norm, reason = _check(upload, rules)
        if norm is not None:
            passed.append((index, Accepted(upload.client, upload.packet, upload.num_examples, norm)))
        else:
            rejected.append((index, Rejection(upload.client, reason)))
    reference = _reference_norm(passed, rules, recent_norms)
    accepted = passed
    if reference is not None:
        median, what = reference
        limit = rules.norm_factor * median
        accepted = [item for item in passed if item[1].norm <= limit]
        for index, a in passed:
            if a.norm > limit:
                reason = f"update norm {a.norm:.4g} exceeds {rules.norm_factor:g} x {what} {median:.4g}"
                rejected.append((index, Rejection(a.client, reason)))
    return [a for _, a in accepted], [r for _, r in sorted(rejected, key=lambda item: item[0])]


def _reference_norm(
    passed: Sequence[tuple[int, Accepted]], rules: UploadRules, recent_norms: Sequence[float]
) -> tuple[float, str] | None:
    """The norm rule's reference median and what it is, or None where the rule does not apply."""
    if len(passed) >= rules.min_uploads_for_norm_rule:
        median, what = statistics.median(a.norm for _, a in passed), "the round's median norm"
    elif len(recent_norms) >= rules.min_uploads_for_norm_rule:
        median = statistics.median(recent_norms)
        what = f"the median norm of the last {len(recent_norms)} accepted updates"
    else:
        return None
    return (median, what) if median > 0 else None


def bound_examples(
    accepted: Sequence[Accepted], rules: UploadRules
) -> tuple[list[Accepted], dict[str, tuple[int, int]]]:
    """Each accepted upload with its example count bounded (see the module docstring).

    Returns:
        The uploads with the counts they are weighted by, and client -> (claimed, counted) for
        those whose claim was cut.
    """
    claims = [a.num_examples for a in accepted]
    bounded, cut = [], {}
    for i, a in enumerate(accepted):
        limit = rules.declared_examples.get(a.client)
        others = claims[:i] + claims[i + 1 :]
        if rules.examples_factor is not None and others:
            relative = max(1, math.floor(rules.examples_factor * statistics.median(others)))
            limit = relative if limit is None else min(limit, relative)
        if limit is not None and a.num_examples > limit:
            cut[a.client] = (a.num_examples, limit)
            a = replace(a, num_examples=limit)
        bounded.append(a)
    return bounded, cut
