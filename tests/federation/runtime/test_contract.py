"""The round loop and the contract functions, over a transport that needs no Flower."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from federation.runtime.contract import (
    PROGRAMS,
    Failure,
    Plan,
    Reply,
    client_program,
    config_entry,
    node_identity,
    program_config,
    program_of,
)
from federation.runtime.roundloop import RoundTimer, run_server, select_nodes
from geofm.errors import ConfigError, FederatedRunError, RunInterrupted


class Server:
    """Records what the loop asked of it."""

    def __init__(self, **plan) -> None:
        self.num_rounds, self.min_clients, self.fraction = 2, 2, 1.0
        self.round_timeout_s, self.expected_clients, self.round_retries = 5.0, 3, 0
        self.__dict__.update(plan)
        self.registered: dict[int, dict] = {}
        self.rounds: list[tuple[int, list[int], list[int]]] = []
        self.finished = False
        self.stray = False

    def start_round(self) -> int:
        return 1

    def register(self, node_id, identity) -> None:
        self.registered[node_id] = identity

    def configure(self, rnd, node_ids):
        payloads = {node: ({"w": np.full(2, rnd, dtype=np.uint8)}, {"round": rnd}) for node in node_ids}
        if self.stray:
            payloads[999] = ({}, {})
        return payloads

    def aggregate(self, rnd, replies, failures) -> None:
        self.rounds.append((rnd, sorted(r.node_id for r in replies), sorted(f.node_id for f in failures)))

    def finish(self) -> None:
        self.finished = True


class Transport:
    """Nodes 1..n; ``down[(rnd, attempt)]`` lists nodes that fail that train attempt."""

    def __init__(self, nodes=(1, 2, 3), down=None) -> None:
        self.nodes = list(nodes)
        self.down = down or {}
        self.trains: dict[int, int] = {}
        self.sent: list[tuple[str, int, list[int]]] = []

    def node_ids(self):
        return list(self.nodes)

    def exchange(self, kind, rnd, payloads, timeout_s):
        self.sent.append((kind, rnd, sorted(payloads)))
        if kind == "query":
            return [Reply(node, {}, {"client": f"inst{node}"}) for node in payloads], []
        attempt = self.trains.get(rnd, 0)
        self.trains[rnd] = attempt + 1
        failing = set(self.down.get((rnd, attempt), ()))
        replies = [Reply(node, payload[0], {}) for node, payload in payloads.items() if node not in failing]
        return replies, [Failure(node, "boom") for node in payloads if node in failing]


def test_rounds_run_with_handshake_first_and_a_failure_does_not_stop_a_round():
    server, transport = Server(), Transport(down={(2, 0): [3]})
    run_server(server, transport, poll_s=0)
    assert server.registered == {n: {"client": f"inst{n}"} for n in (1, 2, 3)}, (
        "every node registered from its query reply"
    )
    assert transport.sent[0] == ("query", 1, [1, 2, 3]), f"the handshake comes before any training: {transport.sent}"
    assert server.rounds == [(1, [1, 2, 3], []), (2, [1, 2], [3])], f"round 2 goes on without node 3: {server.rounds}"
    assert server.finished


def test_a_round_below_min_clients_is_retried_then_stops_the_run_naming_the_failures():
    server, transport = Server(round_retries=1), Transport(down={(1, 0): [2, 3]})
    run_server(server, transport, poll_s=0)
    assert server.rounds[0] == (1, [1, 2, 3], []), "the retried round aggregates the second attempt only"
    server, transport = Server(round_retries=1), Transport(down={(1, 0): [2, 3], (1, 1): [1, 3]})
    expected = r"round 1: fewer than min_clients=2 replies in each of 2 attempts .*1 of 3 selected nodes replied .*node 1: boom"
    with pytest.raises(FederatedRunError, match=expected):
        run_server(server, transport, poll_s=0)
    assert server.rounds == [] and not server.finished


def test_too_few_nodes_within_the_connect_timeout_is_a_clear_error():
    clock = itertools.count(0.0, 10.0)
    server = Server(expected_clients=4, connect_timeout_s=30.0)
    with pytest.raises(FederatedRunError, match=r"before round 1: 3 of 4 nodes connected after connect_timeout_s=30"):
        run_server(server, Transport(), poll_s=0, clock=lambda: next(clock))


def test_a_finished_run_finishes_again_without_waiting_for_nodes():
    clock = itertools.count(0.0, 1000.0)  # any wait for nodes would time out at once
    server = Server(connect_timeout_s=30.0)
    server.start_round = lambda: 3  # rounds 1-2 were done before a restart
    run_server(server, Transport(nodes=()), poll_s=0, clock=lambda: next(clock))
    assert server.finished and server.rounds == [], "a finished run only finishes: no round, no wait for nodes"


class Stopped(Transport):
    """Stopped on request (as a simulation's SIGINT) once ``rnd`` is reached: its next look for nodes raises."""

    def __init__(self, rnd: int) -> None:
        super().__init__()
        self.rnd = rnd

    def node_ids(self):
        if self.rnd == 1 or self.rnd - 1 in self.trains:  # round rnd - 1 was trained
            raise RunInterrupted("stopped by SIGINT")
        return super().node_ids()


@pytest.mark.parametrize("rnd, where", [(1, "before round 1"), (3, "after round 2")])
def test_a_run_stopped_on_request_names_the_last_round_done(rnd, where):
    server = Server(num_rounds=4)
    with pytest.raises(RunInterrupted, match=f"^stopped by SIGINT {where}; rerun the same command to resume$"):
        run_server(server, Stopped(rnd), poll_s=0)
    assert [r[0] for r in server.rounds] == list(range(1, rnd)) and not server.finished


def test_configure_may_address_selected_nodes_only():
    server = Server()
    server.stray = True
    with pytest.raises(FederatedRunError, match=r"payloads for nodes \[999\] that were not selected"):
        run_server(server, Transport(), poll_s=0)


def test_selection_takes_the_fraction_but_at_least_min_clients_reproducibly():
    plan = Plan(num_rounds=1, min_clients=2, fraction=0.3, round_timeout_s=None, expected_clients=2)
    nodes = list(range(10, 20))
    picked = select_nodes(nodes, plan, rnd=4, attempt=0)
    assert len(picked) == 3 and set(picked) <= set(nodes) and picked == select_nodes(nodes, plan, 4, 0)
    assert len(select_nodes(nodes[:3], plan, 1, 0)) == 2, "ceil(0.3 * 3) = 1 is raised to min_clients"


def test_plan_errors_name_every_bad_value():
    with pytest.raises(ConfigError, match=r"fraction=1.5 .*expected_clients=1 \(expected >= min_clients=2\)"):
        Plan(num_rounds=1, min_clients=2, fraction=1.5, round_timeout_s=None, expected_clients=1)
    with pytest.raises(FederatedRunError, match=r"lacks the plan attributes \['num_rounds'"):
        Plan.of(object())


def test_node_identity_in_deployment_and_simulation():
    deployed = {"institution": "esa", "data-root": "/data"}
    assert node_identity(deployed, {}) == deployed
    simulated = node_identity({"partition-id": 1, "num-partitions": 2}, {"institutions": "esa, ign"})
    assert simulated["institution"] == "ign"
    assert node_identity({"partition-id": 0, "num-partitions": 1}, {})["institution"] == "node0"
    with pytest.raises(ConfigError, match="names 2 institutions, but node partition-id=2"):
        node_identity({"partition-id": 2, "num-partitions": 3}, {"institutions": "esa,ign"})
    with pytest.raises(ConfigError, match="expected 'institution'"):
        node_identity({}, {})


def test_programs_load_by_registered_name_and_client_programs_are_built_once_per_process():
    import toy_federated_program as toy

    assert program_of({"program": "toy"}) is toy.PROGRAM
    assert program_of({"program": "geofm"}).make_server.__module__ == "federation.programs.rounds"
    with pytest.raises(ConfigError, match="unknown federated program 'tyo'; did you mean 'toy'"):
        program_of({"program": "tyo"})
    PROGRAMS.register("not-a-program", "numpy:uint8")
    with pytest.raises(ConfigError, match="'not-a-program' lacks make_server and make_client"):
        program_of({"program": "not-a-program"})
    old = {"server-factory": "toy_federated_program:make_server", "client-factory": "toy_federated_program:make_client"}
    with pytest.raises(ConfigError, match="no longer import factories by path; set 'program' to a registered program"):
        program_of(old)
    run_config = {"program": "toy"}
    first = client_program(run_config, {"institution": "a"})
    assert client_program(run_config, {"institution": "a"}) is first
    assert client_program(run_config, {"institution": "b"}) is not first
    tree = {"federation": {"rounds": 3}, "data": {"sources": [{"root": "/archive/a b"}]}}
    assert program_config({"config": config_entry(tree)}) == tree and program_config({}) == {}
    with pytest.raises(ConfigError, match="'config' is not JSON"):
        program_config({"config": "rounds: 3"})


class Timed(Transport):
    """Each train exchange takes ``seconds[rnd]`` on a fake clock; records the timeout each exchange got."""

    def __init__(self, seconds, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds, self.now, self.timeouts = seconds, 0.0, []

    def clock(self) -> float:
        return self.now

    def exchange(self, kind, rnd, payloads, timeout_s):
        assert isinstance(timeout_s, float) and math.isfinite(timeout_s), f"round {rnd} would wait forever"
        self.timeouts.append((kind, rnd, timeout_s))
        if kind == "train":
            self.now += min(self.seconds[rnd], timeout_s)
        return super().exchange(kind, rnd, payloads, timeout_s)


def test_without_a_configured_timeout_rounds_wait_a_bound_derived_from_the_observed_rounds():
    server = Server(num_rounds=4, round_timeout_s=None)
    # Round 2: node 3 dies and never answers; its wait ends at the timeout, and round 2 says nothing of round length.
    transport = Timed({1: 200.0, 2: 10_000.0, 3: 300.0, 4: 10.0}, down={(2, 0): [3]})
    run_server(server, transport, poll_s=0, clock=transport.clock)
    trains = [t for kind, _, t in transport.timeouts if kind == "train"]
    assert trains == [
        RoundTimer(None).timeout_s(),  # nothing observed yet: Flower's message lifetime
        5 * 200.0,
        5 * 200.0,  # the cut-short round 2 is not an observation
        5 * 300.0,
    ]
    assert server.rounds[1] == (2, [1, 2], [3]), "the round closes with the nodes that answered"
    assert server.finished
    timer = RoundTimer(None)
    timer.observe(1.0, complete=True)
    assert timer.timeout_s() == 600.0, "a floor leaves room for a node that joins late and starts up"
    assert RoundTimer(7.0).timeout_s() == 7.0, "a configured timeout is used as it is"
