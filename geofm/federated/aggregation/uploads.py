"""Server side of a round's uploads: screening, decoding and data-weighted averaging.

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
caller to log. The accepted updates are combined by their weighted mean, or by the configured
:class:`Aggregator` (:mod:`~geofm.federated.aggregation.robust`).

The server's memory stays flat in the number of clients: screening decodes one upload at a time
and keeps only its norm, and the accepted uploads keep their encoded update (as it arrived),
decoded again each time it is taken (:class:`Decoded`). The weighted mean is a running sum over
them; the rules that need every update at once spill them to disk (:mod:`~geofm.federated.communication.spill`).

An upload may carry several named payloads (SCAFFOLD sends its model update and its control
update): :func:`aggregate_payloads` screens each payload on its own rules, with its own history of
norms, and a client's upload counts only if every payload passes; all payloads of the round then
share the same clients and weights.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from geofm.errors import CodecError, ConfigError, LayoutMismatchError
from geofm.federated.communication.codec import Packet, decode


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


@dataclass(frozen=True, eq=False)
class ClientUpload:
    """One client's upload of named payloads.

    Attributes:
        client: the client's id, as the caller logs it.
        payloads: payload name -> encoded vector (a packet, or its arrays as they arrived).
        num_examples: number of local training examples, the client's weight.
        metadata: what else the client reported (local steps, an algorithm's own numbers).
    """

    client: str
    payloads: Mapping[str, Packet | Mapping[str, np.ndarray]]
    num_examples: int
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rejection:
    """An upload left out of the round, and why."""

    client: str
    reason: str


@dataclass(frozen=True, eq=False)
class Accepted:
    """An upload that passed screening: its encoded update, as it arrived, and its L2 norm.

    ``num_examples`` is the weight the round gives it: the claimed count after the bounds;
    ``metadata`` is what else the client reported with it (:class:`ClientUpload`).
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


@dataclass(frozen=True, eq=False)
class RoundAggregate:
    """The outcome of a round's uploads.

    Attributes:
        update: the accepted updates combined (by default their data-weighted mean), or None if
            none was accepted or the aggregator found too few.
        accepted: the accepted uploads (their updates decoded on access), in upload order.
        weights: each accepted upload's weight (its share of the accepted examples).
        rejected: the uploads left out, with reasons.
        bounded: client -> (claimed, counted) example counts, for the uploads whose claim was cut.
    """

    update: Tensor | None
    accepted: list[Accepted]
    weights: list[float]
    rejected: list[Rejection]
    bounded: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def updates(self) -> Decoded:
        """The accepted updates, decoded one at a time as they are taken (see :class:`Decoded`)."""
        return Decoded(self.accepted)

    def reported_mean(self, key: str) -> float | None:
        """The mean of the number ``key`` the accepted uploads report in their metadata, weighted as their
        updates (over those that report it); None when none does."""
        reported = [
            (float(a.metadata[key]), w) for a, w in zip(self.accepted, self.weights, strict=True) if key in a.metadata
        ]
        if not reported:
            return None
        return sum(v * w for v, w in reported) / sum(w for _, w in reported)


class Aggregator(Protocol):
    """Combines equally long update vectors (one per accepted client, with its weight) into one.

    The updates come as a :class:`Decoded` sequence: each is decoded when taken, so a rule that
    takes them one at a time holds one at a time (see :mod:`~geofm.federated.aggregation.robust`).
    """

    def combine(self, updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor: ...


class TooFewUpdates(ValueError):
    """A round has fewer accepted updates than its aggregator needs."""


def weighted_mean(vectors: Iterable[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum_i w_i v_i / sum_i w_i`` of equally long vectors, as a new float32 tensor: a running sum
    that takes the vectors once, in order, and keeps none of them.

    Raises:
        LayoutMismatchError: if the vectors differ in shape.
        ValueError: if there are no vectors, the counts differ, or a weight is negative or all are zero.
    """
    if not weights or (isinstance(vectors, Sized) and len(vectors) != len(weights)):
        count = len(vectors) if isinstance(vectors, Sized) else "some"
        raise ValueError(f"expected one weight per vector and at least one vector, got {count} and {len(weights)}")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    total = float(sum(weights))
    mean: Tensor | None = None
    for vector, weight in zip(vectors, weights, strict=True):
        if mean is None:
            mean = torch.zeros_like(vector, dtype=torch.float32)
        elif vector.shape != mean.shape:
            raise LayoutMismatchError(f"cannot average vectors of shapes {tuple(mean.shape)} and {tuple(vector.shape)}")
        mean.add_(vector, alpha=weight / total)
    assert mean is not None  # one weight per vector, and at least one weight
    return mean


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


def aggregate_payloads(
    uploads: Sequence[ClientUpload],
    rules: Mapping[str, UploadRules],
    recent_norms: Mapping[str, Sequence[float]] | None = None,
    aggregator: Aggregator | None = None,
) -> dict[str, RoundAggregate]:
    """Screen every payload of a round's uploads and average each over the clients whose payloads all passed.

    Args:
        uploads: the round's uploads.
        rules: payload name -> what the server accepts for it; every upload must carry each.
        recent_norms: payload name -> norms of that payload accepted in recent rounds.
        aggregator: combines each payload's accepted updates; None: their weighted mean (see
            :func:`aggregate_uploads`).

    Returns:
        Payload name -> its round aggregate. Every aggregate lists the same accepted clients (in
        upload order) with the same bounded weights, and every rejection of the round; with more
        than one payload, a rejection's reason starts with the payload's name.
    """
    recent_norms = recent_norms or {}
    index = {u.client: i for i, u in enumerate(uploads)}
    rejected: dict[int, Rejection] = {}
    passed: dict[str, dict[str, Accepted]] = {}
    for name, payload_rules in rules.items():
        present = []
        for i, upload in enumerate(uploads):
            if name in upload.payloads:
                present.append(i)
            else:
                rejected.setdefault(i, Rejection(upload.client, f"sent no {name!r} payload"))
        screened = [Upload(uploads[i].client, uploads[i].payloads[name], uploads[i].num_examples) for i in present]
        accepted, refused = screen_uploads(screened, payload_rules, recent_norms.get(name, ()))
        passed[name] = {a.client: a for a in accepted}
        for rejection in refused:
            reason = f"{name}: {rejection.reason}" if len(rules) > 1 else rejection.reason
            rejected.setdefault(index[rejection.client], Rejection(rejection.client, reason))
    rejections = [rejected[i] for i in sorted(rejected)]
    clients = [u.client for i, u in enumerate(uploads) if i not in rejected]
    if not clients:
        return {name: RoundAggregate(update=None, accepted=[], weights=[], rejected=rejections) for name in rules}
    first = next(iter(rules))
    counted, bounded = bound_examples([passed[first][c] for c in clients], rules[first])
    total = sum(a.num_examples for a in counted)
    weights = [a.num_examples / total for a in counted]
    aggregates = {}
    for name in rules:
        accepted = [
            replace(passed[name][a.client], num_examples=a.num_examples, metadata=uploads[index[a.client]].metadata)
            for a in counted
        ]
        updates = Decoded(accepted)
        try:
            update = weighted_mean(updates, weights) if aggregator is None else aggregator.combine(updates, weights)
        except TooFewUpdates as exc:
            unused = [Rejection(a.client, f"not combined: {exc}") for a in counted]
            return {n: RoundAggregate(None, [], [], rejections + unused, bounded) for n in rules}
        aggregates[name] = RoundAggregate(update, accepted, weights, rejections, bounded)
    return aggregates


def aggregate_uploads(
    uploads: Sequence[Upload],
    rules: UploadRules,
    recent_norms: Sequence[float] = (),
    aggregator: Aggregator | None = None,
) -> RoundAggregate:
    """Screen a round's uploads and combine the accepted updates, weighted by their bounded example counts.

    ``aggregator`` (see :mod:`~geofm.federated.aggregation.robust`) combines them; None: the weighted mean. When
    it finds the round too small (:class:`TooFewUpdates`), every accepted upload is rejected with its
    reason and the round has no update.
    """
    named = [ClientUpload(u.client, {"update": u.packet}, u.num_examples) for u in uploads]
    return aggregate_payloads(named, {"update": rules}, {"update": recent_norms}, aggregator)["update"]
