"""A federated program run in this one process, without Flower: for debugging a program and for tests.

:class:`InProcess` is a :class:`~federation.runtime.Transport` that calls each node's client
program directly and keeps each node's state between rounds as Flower's context does;
:func:`run_in_process` runs the built-in program of a validated federated config with one
client per institution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from federation.roundloop import run_server
from federation.runtime import ClientProgram, Failure, Payload, Reply
from geofm.federated.spill import UploadStore


class InProcess:
    """Nodes that are client programs in this process, keyed by node id; with ``uploads``, each ``train``
    reply's arrays go to that store as Flower's transport puts them (see :mod:`~geofm.federated.spill`)."""

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


def run_in_process(cfg) -> Path:
    """Run the federated config ``cfg`` (any task's) with every client in this process; returns its run directory."""
    from federation.client import FederatedClient
    from federation.server import FederatedServer

    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    server = FederatedServer(cfg)
    run_server(server, InProcess(clients, server.uploads), poll_s=0)
    return cfg.run.output_dir


__all__ = ["InProcess", "run_in_process"]
