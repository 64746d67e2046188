"""The round loop: :func:`run_server` drives a server program of :mod:`federation.runtime.contract` over any transport.

It waits for the nodes, learns who each one is (handshake), selects nodes every round, collects
their replies with a timeout (:class:`RoundTimer`), retries a round that got too few, and stops the
run with a :class:`~geofm.errors.FederatedRunError` when it cannot go on. Nothing here imports Flower.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable

from federation.runtime.contract import Plan, ServerProgram, Transport
from geofm.errors import FederatedRunError, RunInterrupted

log = logging.getLogger("geofm.fl")


def select_nodes(node_ids: list[int], plan: Plan, rnd: int, attempt: int) -> list[int]:
    """A reproducible random ``fraction`` of the nodes, at least ``min_clients`` of them (fewer only if fewer exist)."""
    count = min(len(node_ids), max(plan.min_clients, math.ceil(plan.fraction * len(node_ids))))
    return sorted(random.Random(rnd * 1009 + attempt).sample(sorted(node_ids), count))


def run_server(
    program: ServerProgram, transport: Transport, *, poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic
) -> None:
    """Run a server program from its start round to its last, then call its ``finish``; then its optional
    ``close(error)``, also when the run ends in an error (``error``, else None).

    Raises:
        FederatedRunError: too few nodes connected within ``connect_timeout_s``, a round got fewer
            than ``min_clients`` replies on every attempt, or ``configure`` addressed unselected nodes.
        ConfigError: the program's plan is invalid.
        RunInterrupted: the transport stopped the run on request (a simulation's SIGINT or SIGTERM),
            completed here with the last round done.
    """
    plan = Plan.of(program)
    loop = _RoundLoop(program, transport, plan, poll_s, clock)
    first = program.start_round()
    if first < 1:
        raise FederatedRunError(f"{type(program).__name__}.start_round() returned {first}, expected >= 1")
    done = first - 1
    close = getattr(program, "close", None)
    try:
        try:
            if first > plan.num_rounds:  # a finished run, rerun: no node is needed to finish it again
                log.info("rounds 1-%d are done; no round to run", plan.num_rounds)
            else:
                loop.await_nodes(plan.expected_clients, f"before round {first}")
            for rnd in range(first, plan.num_rounds + 1):
                loop.run_round(rnd)
                done = rnd
        except RunInterrupted as err:
            where = f"after round {done}" if done else "before round 1"
            raise RunInterrupted(f"{err} {where}; rerun the same command to resume") from None
        program.finish()
    except BaseException as err:
        if close is not None:
            close(err)
        raise
    if close is not None:
        close(None)


FIRST_ROUND_TIMEOUT_S = 43_200.0
"""A round with no observed round before it waits at most this long (Flower's own message lifetime, 12 h)."""
ROUND_TIMEOUT_FACTOR = 5.0
"""Later rounds wait at most this multiple of the slowest of the recent complete rounds..."""
ROUND_TIMEOUT_FLOOR_S = 600.0
"""...and never less than this, which covers a node that joins late and must start up first."""


class RoundTimer:
    """How long a round waits for replies: the configured ``round_timeout_s``, or one derived from observed rounds.

    Without a configured timeout, the first round of an invocation waits at most
    :data:`FIRST_ROUND_TIMEOUT_S`; each later one at most ``ROUND_TIMEOUT_FACTOR`` times the slowest
    of the last five rounds that every selected node answered (a round cut short by the timeout
    says nothing about how long one takes), and at least :data:`ROUND_TIMEOUT_FLOOR_S`. Either way a
    node that never answers fails the round's wait for it alone: the round closes with the others.
    """

    def __init__(self, configured_s: float | None) -> None:
        self.configured_s = configured_s
        self.complete_rounds_s: list[float] = []

    def timeout_s(self) -> float:
        if self.configured_s is not None:
            return self.configured_s
        if not self.complete_rounds_s:
            return FIRST_ROUND_TIMEOUT_S
        return max(ROUND_TIMEOUT_FLOOR_S, ROUND_TIMEOUT_FACTOR * max(self.complete_rounds_s[-5:]))

    def observe(self, seconds: float, complete: bool) -> None:
        """Record one exchange's duration; only those where every node answered shape the timeout."""
        if complete:
            self.complete_rounds_s.append(seconds)


class _RoundLoop:
    """State of one server run: which nodes are registered, and how to run a round."""

    def __init__(
        self, program: ServerProgram, transport: Transport, plan: Plan, poll_s: float, clock: Callable[[], float]
    ) -> None:
        self.program = program
        self.transport = transport
        self.plan = plan
        self.poll_s = poll_s
        self.clock = clock
        self.registered: set[int] = set()
        self.refused: dict[int, str] = {}  # nodes whose handshake failed, and why
        self.timer = RoundTimer(plan.round_timeout_s)

    def await_nodes(self, count: int, when: str) -> None:
        """Wait until ``count`` nodes are connected, at most ``connect_timeout_s``."""
        deadline = self.clock() + self.plan.connect_timeout_s
        while len(connected := self.transport.node_ids()) < count:
            if self.clock() >= deadline:
                raise FederatedRunError(
                    f"{when}: {len(connected)} of {count} nodes connected after connect_timeout_s="
                    f"{self.plan.connect_timeout_s:g}; check that the SuperNodes run, reach the SuperLink and "
                    f"have their public keys registered (flwr supernode register){self._refusals()}"
                )
            time.sleep(self.poll_s)
        log.info("%s: %d nodes connected", when, len(connected))

    def handshake(self, rnd: int) -> list[int]:
        """Register connected nodes not seen before; returns the registered nodes connected now."""
        connected = self.transport.node_ids()
        new = {node: ({}, {}) for node in connected if node not in self.registered}
        if new:
            replies, failures = self.transport.exchange("query", rnd, new, self.timer.timeout_s())
            for reply in replies:
                self.program.register(reply.node_id, reply.metrics)
                self.registered.add(reply.node_id)
                self.refused.pop(reply.node_id, None)
                identity = ", ".join(f"{key}={value}" for key, value in reply.metrics.items())
                log.info("node %d registered: %s", reply.node_id, identity)
            for failure in failures:
                self.refused[failure.node_id] = failure.reason
                log.warning("node %d did not answer the handshake: %s", failure.node_id, failure.reason)
        return sorted(self.registered.intersection(connected))

    def _refusals(self) -> str:
        """The handshake failures so far, for an error message."""
        if not self.refused:
            return ""
        return "; handshake failures: " + "; ".join(
            f"node {node}: {reason}" for node, reason in sorted(self.refused.items())
        )

    def run_round(self, rnd: int) -> None:
        """Run one round, retrying it while it gets fewer than ``min_clients`` replies."""
        plan = self.plan
        attempts = plan.round_retries + 1
        for attempt in range(attempts):
            if attempt:
                self.await_nodes(plan.min_clients, f"round {rnd} attempt {attempt + 1}")
            started = self.clock()
            available = self.handshake(rnd)
            if len(available) < plan.min_clients:
                problem = f"only {len(available)} registered nodes connected{self._refusals()}"
            else:
                select = getattr(self.program, "select", None)
                selected = sorted(
                    select(rnd, attempt, available) if select else select_nodes(available, plan, rnd, attempt)
                )
                payloads = self.program.configure(rnd, selected)
                stray = sorted(set(payloads) - set(selected))
                if stray:
                    raise FederatedRunError(
                        f"round {rnd}: {type(self.program).__name__}.configure returned payloads for nodes "
                        f"{stray} that were not selected (selected: {selected})"
                    )
                sent = self.clock()
                replies, failures = self.transport.exchange("train", rnd, payloads, self.timer.timeout_s())
                self.timer.observe(self.clock() - sent, complete=len(replies) == len(payloads))
                if len(replies) >= plan.min_clients:
                    self.program.aggregate(rnd, replies, failures)
                    log.debug(  # the program logs its own round line; failures are warned of one by one
                        "round %d: %d replies, %d failures (%.1f s)",
                        rnd,
                        len(replies),
                        len(failures),
                        self.clock() - started,
                    )
                    for failure in failures:
                        log.warning("round %d: node %d failed: %s", rnd, failure.node_id, failure.reason)
                    return
                reasons = "; ".join(f"node {f.node_id}: {f.reason}" for f in failures) or "none reported"
                problem = f"{len(replies)} of {len(payloads)} selected nodes replied (failures: {reasons})"
            log.warning("round %d attempt %d/%d below min_clients: %s", rnd, attempt + 1, attempts, problem)
        raise FederatedRunError(
            f"round {rnd}: fewer than min_clients={plan.min_clients} replies in each of {attempts} attempts "
            f"(round_retries={plan.round_retries}); last attempt: {problem}"
        )
