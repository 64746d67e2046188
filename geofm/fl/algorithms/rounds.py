"""What passes between an algorithm and the runtime in a round: the records of its hooks and results,
and the flat arrays of the payloads that travel (``<payload>.<part>`` keys)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor, nn

from geofm.fl.communication.codec import Packet
from geofm.tasks import StepOutput

Arrays = dict[str, np.ndarray]


@dataclass(eq=False)
class LocalRound:
    """One client's local round as the algorithm's hooks see it.

    Attributes:
        client: the client's name.
        received: the downlink payloads, decoded (float32 CPU vectors).
        params: the trained module's shared parameters, in layout order.
        anchor: the round's global model split like ``params``, on their devices.
        state: the client's state, read and written by the algorithm.
        lr: the round's learning rate of the local optimiser.
        momentum: the local optimiser's SGD momentum (0: plain SGD, or AdamW).
        module: the module the client trains (its engine's), for hooks on its blocks.
        losses: a regulariser's values of each micro-batch so far (detached), for the round's log.
    """

    client: str
    received: dict[str, Tensor]
    params: list[Tensor]
    anchor: list[Tensor]
    state: Arrays
    lr: float
    module: nn.Module | None = None
    losses: list[Tensor] = field(default_factory=list)
    momentum: float = 0.0


@dataclass
class LocalHooks:
    """What the algorithm adds to one client's local steps.

    Attributes:
        around_gradient: a context entered around each forward/backward (parameters may be moved
            inside it and restored on exit, before the optimizer step).
        regulariser: ``(batch, output) -> Tensor`` added to each micro-batch's loss, or None; it
            sees the micro-batch, the forward's :class:`~geofm.tasks.StepOutput` and (through the
            :class:`LocalRound` it was made with) the client's state.
        ascent: ``(task loss closure) -> context`` entered inside ``around_gradient``: a first
            gradient from the closure, the parameters moved for the real forward/backward and restored
            on exit (SAM, set by :meth:`~geofm.fl.algorithms.base.Algorithm.hooks` from ``algorithm.sam``), or None (see
            :func:`geofm.training.loop.micro_step`).
    """

    around_gradient: Callable[[], AbstractContextManager] = contextlib.nullcontext
    regulariser: Callable[[Any, StepOutput], Tensor] | None = None
    ascent: Callable[[Callable[[], Tensor]], AbstractContextManager] | None = None


@dataclass
class LocalUpdate:
    """The end of a local round: the uplink payloads' values and the client's metadata for the server."""

    payloads: dict[str, Tensor]
    metadata: dict[str, float | int | str] = field(default_factory=dict)


@dataclass
class ServerRound:
    """The server update rule's result: the next global model, what to log, and the algorithm's new state.

    ``state`` (global tensors) and ``client_state`` (client -> tensors) replace those entries of
    the algorithm's state when the runtime keeps the round (:meth:`~geofm.fl.algorithms.base.Algorithm.commit`).
    """

    model: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Tensor] = field(default_factory=dict)
    client_state: dict[str, dict[str, Tensor]] = field(default_factory=dict)


def packet_arrays(packets: Mapping[str, Packet]) -> Arrays:
    """Packets as one flat dict of arrays, each key prefixed with its payload's name."""
    return {f"{p}.{key}": value for p, packet in packets.items() for key, value in packet.to_arrays().items()}


class _Payload(Mapping[str, np.ndarray]):
    """One payload's packet arrays, each taken from the flat arrays that travelled when it is read (a
    stored upload's are read from disk then, and not kept: :mod:`~geofm.fl.communication.spill`)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], payload: str, parts: list[str]) -> None:
        self._arrays, self._payload, self._parts = arrays, payload, parts

    def __getitem__(self, part: str) -> np.ndarray:
        if part not in self._parts:
            raise KeyError(part)
        return self._arrays[f"{self._payload}.{part}"]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


def payload_arrays(arrays: Mapping[str, np.ndarray], skip: Sequence[str] = ()) -> dict[str, Mapping[str, np.ndarray]]:
    """The flat arrays that travelled, as payload name -> that payload's packet arrays (read from
    ``arrays`` when taken), leaving out the keys in ``skip``."""
    parts: dict[str, list[str]] = {}
    for key in arrays:
        if key not in skip:
            payload, _, part = key.rpartition(".")
            parts.setdefault(payload, []).append(part)
    return {payload: _Payload(arrays, payload, names) for payload, names in parts.items()}


__all__ = ["Arrays", "LocalHooks", "LocalRound", "LocalUpdate", "ServerRound", "packet_arrays", "payload_arrays"]
