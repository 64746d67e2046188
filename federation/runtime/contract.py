"""The federated runtime contract, in plain Python.

A federated algorithm is a :class:`ServerProgram` and a :class:`ClientProgram` that exchange
payloads: dicts of numpy arrays (uint8 packed bits, float32 tensors, int64 headers) and dicts of
scalars. :func:`federation.runtime.roundloop.run_server` drives a server program over any :class:`Transport`.
The Flower adapter (``federation.flower.adapter``) provides the transport
and runs the client programs; nothing here imports Flower.

Both programs come from a :class:`Program` registered by name in :data:`PROGRAMS` (built in:
``"geofm"``, :mod:`federation.programs.rounds`; a plug-in adds one through the
``geofm.federated_programs`` entry-point group), so any algorithm runs on the same runtime and a
node imports only programs its installation registered. The run config's keys:

``program``
    the registered program's name; it builds ``make_server(run_config) -> ServerProgram`` and
    ``make_client(run_config, node_config) -> ClientProgram``
``config``
    the program's config as JSON text (a YAML file with its overrides applied, see
    :func:`config_entry`): Flower hands the run config to the ServerApp and to every ClientApp, so
    the server and all institutions read the same config whatever machine they run on
``institutions``
    simulation only: comma-separated institution names, one per simulated node

A node's config names its institution (``institution``, and e.g. ``data-root``): set by
``flower-supernode --node-config`` in deployment, derived from ``partition-id`` and
``institutions`` in simulation (see :func:`node_identity`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from geofm.errors import ConfigError, FederatedRunError
from geofm.registry import Registry

Scalar = bool | int | float | str
Arrays = dict[str, np.ndarray]
Scalars = dict[str, Scalar]
Payload = tuple[Arrays, Scalars]

PROGRAM = "program"
CONFIG = "config"
INSTITUTIONS = "institutions"
RUN_CONFIG_DEFAULTS: dict[str, Scalar] = {
    PROGRAM: "geofm",
    CONFIG: "",
    INSTITUTIONS: "",
}
"""Every run-config key the runtime reads; the shipped Flower App declares the same keys."""

INSTITUTION = "institution"
DATA_ROOT = "data-root"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"


@dataclass(frozen=True)
class Reply:
    """What a node sent back: its upload and its metrics (the upload's arrays in memory, or on disk
    where the transport stored them as they arrived: :class:`~geofm.fl.communication.spill.StoredArrays`)."""

    node_id: int
    arrays: Mapping[str, np.ndarray]
    metrics: Scalars


@dataclass(frozen=True)
class Failure:
    """A selected node that raised, crashed or did not answer in time."""

    node_id: int
    reason: str


class ServerProgram(Protocol):
    """The server side of a federated algorithm.

    Plan attributes: ``num_rounds``, ``min_clients`` (fewest replies a round needs), ``fraction``
    (share of connected nodes selected per round, at least ``min_clients``), ``round_timeout_s``
    (per-round reply timeout, None waits until every node answered or went offline) and
    ``expected_clients`` (nodes to wait for before the first round). Optional: ``connect_timeout_s``
    (how long to wait for them, default 600), ``round_retries`` (attempts after a round that got
    fewer than ``min_clients`` replies, default 2), ``uploads`` (a
    :class:`~geofm.fl.communication.spill.UploadStore` the transport writes each ``train`` reply's arrays
    to as it arrives, so that the program holds none of them in memory; the program clears it once
    it aggregated the round) and a method ``select(rnd, attempt, node_ids)``
    choosing the round's nodes among the registered ones (default :func:`select_nodes`; a program
    that must select the same institutions after a restart, when Flower's node ids change,
    selects by the identities it registered), and ``close(error)``, called once the run ends, with the
    exception that ended it or None (the program closes its loggers).
    """

    num_rounds: int
    min_clients: int
    fraction: float
    round_timeout_s: float | None
    expected_clients: int

    def start_round(self) -> int:
        """First round to run: 1, or the round after a server checkpoint."""

    def register(self, node_id: int, identity: Scalars) -> None:
        """Learn which institution a node is (its :meth:`ClientProgram.identity`)."""

    def configure(self, rnd: int, node_ids: list[int]) -> dict[int, Payload]:
        """What each selected node receives; nodes left out get nothing this round."""

    def aggregate(self, rnd: int, replies: list[Reply], failures: list[Failure]) -> None:
        """Fold a round's replies (at least ``min_clients`` of them) into the server's model."""

    def finish(self) -> None:
        """Called once after the last round."""


class ClientProgram(Protocol):
    """The client side of a federated algorithm, built once per node and process."""

    def identity(self) -> Scalars:
        """Who this node is, e.g. ``{"client": "institution_a", "num_examples": 1234}``."""

    def train(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays]:
        """One round of local work: returns (upload arrays, metrics, new per-client state)."""


class Transport(Protocol):
    """How :func:`run_server` reaches the nodes (Flower's Grid in the adapter)."""

    def node_ids(self) -> list[int]:
        """Nodes connected now."""

    def exchange(
        self, kind: Literal["query", "train"], rnd: int, payloads: dict[int, Payload], timeout_s: float
    ) -> tuple[list[Reply], list[Failure]]:
        """Send each node its payload and collect replies; a node without a reply is a Failure."""


@dataclass(frozen=True)
class Plan:
    """A server program's plan attributes, validated."""

    num_rounds: int
    min_clients: int
    fraction: float
    round_timeout_s: float | None
    expected_clients: int
    connect_timeout_s: float = 600.0
    round_retries: int = 2

    def __post_init__(self) -> None:
        problems = []
        if self.num_rounds < 1:
            problems.append(f"num_rounds={self.num_rounds} (expected >= 1)")
        if self.min_clients < 1:
            problems.append(f"min_clients={self.min_clients} (expected >= 1)")
        if not 0.0 < self.fraction <= 1.0:
            problems.append(f"fraction={self.fraction} (expected 0 < fraction <= 1)")
        if self.round_timeout_s is not None and self.round_timeout_s <= 0:
            problems.append(f"round_timeout_s={self.round_timeout_s} (expected > 0 or None)")
        if self.expected_clients < self.min_clients:
            problems.append(f"expected_clients={self.expected_clients} (expected >= min_clients={self.min_clients})")
        if self.connect_timeout_s <= 0:
            problems.append(f"connect_timeout_s={self.connect_timeout_s} (expected > 0)")
        if self.round_retries < 0:
            problems.append(f"round_retries={self.round_retries} (expected >= 0)")
        if problems:
            raise ConfigError("invalid federated plan: " + "; ".join(problems))

    @classmethod
    def of(cls, program: ServerProgram) -> Plan:
        """Read and validate the plan attributes of a server program."""
        optional = {"connect_timeout_s", "round_retries"}
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in optional and not hasattr(program, name)]
        if missing:
            raise FederatedRunError(f"server program {type(program).__name__} lacks the plan attributes {missing}")
        return cls(**{name: getattr(program, name) for name in names if hasattr(program, name)})


class Program(NamedTuple):
    """A federated program: how to build its server and a node's client from the run config; optionally
    the institutions a simulation of its config tree runs (``geofm fed simulate`` without
    ``--institutions``) and the check of what a simulation of a run config needs of this machine
    (``check_simulation(run_config, source)``, ``source`` the config file's name: every input, every
    institution's data included, and the output folder), which ``geofm fed simulate`` runs before the
    simulation engine starts and which raises a :class:`~geofm.errors.GeoFMError` naming what is wrong."""

    make_server: Callable[[dict[str, Scalar]], ServerProgram]
    make_client: Callable[[dict[str, Scalar], dict[str, Scalar]], ClientProgram]
    client_names: Callable[[dict[str, Any]], list[str]] | None = None
    check_simulation: Callable[[dict[str, Scalar], str], None] | None = None


PROGRAMS: Registry[Program] = Registry("federated program", "geofm.federated_programs")
"""Federated programs a run config names (``geofm fed simulate --program``)."""
PROGRAMS.register("geofm", "federation.programs.rounds:PROGRAM")
PROGRAMS.register("feddiff", "federation.programs.feddiff:PROGRAM")
PROGRAMS.register("oscar", "federation.programs.oscar:PROGRAM")
PROGRAMS.register("ensemble", "federation.programs.ensemble:PROGRAM")

RETIRED_KEYS = ("server-factory", "client-factory")
"""Run-config keys of earlier versions, which named any importable factory."""


def program_of(run_config: Mapping[str, Scalar]) -> Program:
    """The registered program the run config's ``program`` entry names.

    Raises:
        ConfigError: the entry names no registered program (listing the nearest), or the run
            config still uses the retired ``server-factory``/``client-factory`` keys.
    """
    retired = [key for key in RETIRED_KEYS if run_config.get(key)]
    if retired:
        raise ConfigError(
            f"run config {', '.join(map(repr, retired))}: nodes no longer import factories by path; set "
            f"{PROGRAM!r} to a registered program instead (registered: {', '.join(PROGRAMS.names())})"
        )
    program = PROGRAMS.get(str(run_config.get(PROGRAM, "") or ""))
    if not all(callable(getattr(program, name, None)) for name in ("make_server", "make_client")):
        raise ConfigError(f"federated program {run_config.get(PROGRAM)!r} lacks make_server and make_client")
    return program


def config_entry(tree: Mapping[str, Any]) -> str:
    """A program's config tree as the run config's ``config`` entry (compact JSON)."""
    return json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str)


def program_config(run_config: Mapping[str, Scalar]) -> dict[str, Any]:
    """The program's config tree from the run config's ``config`` entry (empty when there is none).

    Raises:
        ConfigError: if the entry is not a JSON object.
    """
    text = str(run_config.get(CONFIG, "") or "")
    if not text:
        return {}
    try:
        tree = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"run config {CONFIG!r} is not JSON: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"run config {CONFIG!r}: expected a JSON object, got {type(tree).__name__}")
    return tree


def institutions(run_config: Mapping[str, Scalar]) -> list[str]:
    """The ``institutions`` entry as a list of names."""
    return [name.strip() for name in str(run_config.get(INSTITUTIONS, "")).split(",") if name.strip()]


def node_identity(node_config: Mapping[str, Scalar], run_config: Mapping[str, Scalar]) -> Scalars:
    """The node config a client program is built with, with ``institution`` always set.

    A deployed SuperNode names its institution itself (``--node-config 'institution="a" ...'``); a
    simulated node has only ``partition-id`` and ``num-partitions`` and takes the name at that
    position in ``institutions`` (``node<partition-id>`` when that list is empty).
    """
    config = dict(node_config)
    if INSTITUTION in config:
        return config
    if PARTITION_ID not in config:
        raise ConfigError(
            f"node config {config}: expected {INSTITUTION!r} (flower-supernode --node-config "
            f'\'{INSTITUTION}="name" {DATA_ROOT}="/path"\') or {PARTITION_ID!r} (simulation)'
        )
    names = institutions(run_config)
    index = int(config[PARTITION_ID])
    if names and index >= len(names):
        raise ConfigError(
            f"run config {INSTITUTIONS!r} names {len(names)} institutions, but node {PARTITION_ID}={index}"
        )
    config[INSTITUTION] = names[index] if names else f"node{index}"
    return config


def make_server_program(run_config: Mapping[str, Scalar]) -> ServerProgram:
    """Build the server program of the registered program the run config names."""
    return program_of(run_config).make_server(dict(run_config))


_client_programs: dict[tuple, ClientProgram] = {}


def client_program(run_config: Mapping[str, Scalar], node_config: Mapping[str, Scalar]) -> ClientProgram:
    """The client program for this run and node, built on first use and kept for the process's lifetime."""
    key = (tuple(sorted(run_config.items())), tuple(sorted(node_config.items())))
    if key not in _client_programs:
        _client_programs[key] = program_of(run_config).make_client(dict(run_config), dict(node_config))
    return _client_programs[key]
