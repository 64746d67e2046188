"""A round's uploads combined: screened (:mod:`~geofm.fl.aggregation.screening`), then averaged by
their bounded data weights, or combined by the configured :class:`Aggregator`
(:mod:`~geofm.fl.aggregation.robust`).

The server's memory stays flat in the number of clients: screening decodes one upload at a time
and keeps only its norm, and the accepted uploads keep their encoded update (as it arrived),
decoded again each time it is taken (:class:`~geofm.fl.aggregation.screening.Decoded`). The
weighted mean is a running sum over them; the rules that need every update at once spill them to
disk (:mod:`~geofm.fl.communication.spill`).

An upload may carry several named payloads (SCAFFOLD sends its model update and its control
update): :func:`aggregate_payloads` screens each payload on its own rules, with its own history of
norms, and a client's upload counts only if every payload passes; all payloads of the round then
share the same clients and weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from geofm.errors import LayoutMismatchError
from geofm.fl.aggregation.screening import (
    Accepted,
    Decoded,
    Rejection,
    Upload,
    UploadRules,
    bound_examples,
    screen_uploads,
)
from geofm.fl.communication.codec import Packet


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
    takes them one at a time holds one at a time (see :mod:`~geofm.fl.aggregation.robust`).
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

    ``aggregator`` (see :mod:`~geofm.fl.aggregation.robust`) combines them; None: the weighted mean. When
    it finds the round too small (:class:`TooFewUpdates`), every accepted upload is rejected with its
    reason and the round has no update.
    """
    named = [ClientUpload(u.client, {"update": u.packet}, u.num_examples) for u in uploads]
    return aggregate_payloads(named, {"update": rules}, {"update": recent_norms}, aggregator)["update"]
