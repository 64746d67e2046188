"""A federated program run in this one process, without Flower: for debugging a program and for tests.

:class:`InProcess` is a :class:`~federation.runtime.contract.Transport` that calls each node's client
program directly and keeps each node's state between rounds as Flower's context does;
:func:`run_in_process` runs a registered program (the built-in one by default) on a validated config
with one client per institution.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from federation.runtime.contract import (
    CONFIG,
    INSTITUTION,
    PROGRAM,
    ClientProgram,
    Failure,
    Payload,
    Reply,
    config_entry,
    program_of,
)
from federation.runtime.roundloop import run_server
from geofm.fl.communication.spill import UploadStore


class InProcess:
    """Nodes that are client programs in this process, keyed by node id; with ``uploads``, each ``train``
    reply's arrays go to that store as Flower's transport puts them (see :mod:`~geofm.fl.communication.spill`)."""

    def __init__(self, clients: dict[int, ClientProgram], uploads: UploadStore | None = None) -> None:
        self.clients = clients
        self.states: dict[int, dict] = {}
        self.uploads = uploads

    def node_ids(self) -> list[int]:
        return sorted(self.clients)

    def exchange(
        self, kind: Literal["query", "train"], rnd: int, payloads: dict[int, Payload], timeout_s: float
    ) -> tuple[list[Reply], list[Failure]]:
        """Each node's reply in node order; a node whose program raises is a failure with its message."""
        replies, failures = [], []
        for node, (arrays, scalars) in payloads.items():
            try:
                if kind == "query":
                    replies.append(Reply(node, {}, self.clients[node].identity()))
                else:
                    upload, metrics, state = self.clients[node].train(arrays, scalars, self.states.get(node, {}))
                    self.states[node] = state
                    replies.append(Reply(node, self.uploads.keep(upload) if self.uploads else upload, metrics))
            except Exception as err:  # a failed node is reported to the round loop, as Flower reports it
                failures.append(Failure(node, f"{type(err).__name__}: {err}"))
        return replies, failures


def run_in_process(cfg, program: str = "geofm", wrap: Callable[[ClientProgram], ClientProgram] | None = None) -> Path:
    """Run the validated config ``cfg`` of the registered ``program`` (the built-in one: any task's federated
    config) with every client in this process; see :func:`run_tree_in_process`."""
    from geofm.config.base import config_to_dict

    return run_tree_in_process(config_to_dict(cfg), program, wrap)


def run_tree_in_process(
    tree: dict, program: str = "geofm", wrap: Callable[[ClientProgram], ClientProgram] | None = None
) -> Path:
    """Run the registered ``program`` on a config tree (validated by the program) with one client per
    institution in this process, each client program passed through ``wrap`` where given (e.g. to time
    it); returns the run directory.

    Raises:
        ConfigError: the tree is not a valid config of the program.
    """
    from geofm.config.federated import read_federated_config

    run_config = {PROGRAM: program, CONFIG: config_entry(tree)}
    built = program_of(run_config)
    server = built.make_server(run_config)
    names = built.client_names(tree) if built.client_names else read_federated_config(tree).client_names
    clients = {}
    for i, name in enumerate(names):
        client = built.make_client(run_config, {INSTITUTION: name})
        clients[i + 1] = wrap(client) if wrap else client
    run_server(server, InProcess(clients, getattr(server, "uploads", None)), poll_s=0)
    return Path(tree["run"]["output_dir"])


__all__ = ["InProcess", "run_in_process", "run_tree_in_process"]
