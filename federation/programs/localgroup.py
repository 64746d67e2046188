"""A node's local group: the processes (GPUs) of one machine that train a client's rounds data-parallel.

An institution's client trains its local steps over ``federation.local_processes`` processes of its
node (a deployed node's ``local-processes``), as a central run does under ``torchrun``: the same
DeepSpeed engine, ZeRO stage from the config, over one process group (NCCL on GPUs, gloo on a CPU).
The process that talks to Flower (a simulation's actor, a deployed node's worker) is not itself a
rank: a process holds one default process group, and a simulation's process trains several clients
and already formed a group of one for them. It starts the group once instead, as child processes
(``python -m federation.programs.localgroup``), and keeps it for the run. Each round it sends every rank the
round's message (the config, the node's config, the payloads and the client's state) over the
rank's own socket, with the client program's class (its module, which the rank imports when it
reads the message); every rank trains its share of each global batch (the client's ``train_here``);
rank 0 answers with the upload, the metrics and the state, the others with None. A rank builds each
client program once.

A rank exits when its socket closes (its parent ended, ``kill -9`` included). A rank that fails or
dies ends the whole group (the others may wait in a collective for it): the round fails as a
one-process client's would, and the next round starts a new group.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from federation.deploy.nodeworker import _transportable
from federation.runtime.processes import PROCESS_GROUP_ENV
from geofm.errors import FederatedRunError
from geofm.training import engine as ds

log = logging.getLogger("geofm.fl")

GRACE_S = 10.0
"""How long a closing group's ranks get to exit after their sockets close, before they are killed."""


class LocalGroup:
    """``size`` child processes forming one process group, started now and kept until :meth:`close`.

    Args:
        size: the number of processes (ranks 0 to ``size - 1``; rank ``r`` uses local GPU ``r``).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        root = str(Path(__file__).resolve().parents[2])  # this checkout, whatever the parent's working directory
        env = {key: value for key, value in os.environ.items() if key not in PROCESS_GROUP_ENV}
        env.update(
            PYTHONPATH=os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])]),
            WORLD_SIZE=str(size),
            LOCAL_WORLD_SIZE=str(size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(ds.free_port()),
        )
        self.members: list[tuple[subprocess.Popen, Connection]] = []
        for rank in range(size):
            ours, theirs = socket.socketpair()
            with theirs:
                process = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdin=subprocess.DEVNULL,
                )
            self.members.append((process, Connection(ours.detach())))

    def train(self, client: type, cfg, node_config: dict, arrays: Any, config: Any, state: Any) -> Any:
        """One round of the client program that ``client(cfg, node_config)`` builds (its ``train_here``, e.g.
        :meth:`federation.programs.client.FederatedClient.train_here`): rank 0's answer.

        Raises:
            Exception: what a rank raised, with its traceback as a note (the group is ended).
            FederatedRunError: a rank died during the round (the group is ended).
        """
        message = pickle.dumps(
            (client, cfg, dict(node_config), arrays, config, state), protocol=pickle.HIGHEST_PROTOCOL
        )
        for _, connection in self.members:
            connection.send_bytes(message)
        return self._answers()[0]

    def _answers(self) -> list[Any]:
        """Every rank's answer, in rank order, as they come."""
        answers: list[Any] = [None] * self.size
        pending = {connection: rank for rank, (_, connection) in enumerate(self.members)}
        while pending:
            for connection in wait(list(pending)):
                rank = pending.pop(connection)
                try:
                    status, answers[rank] = connection.recv()
                except (EOFError, OSError):
                    code = self.members[rank][0].wait()
                    self.close(kill=True)
                    raise FederatedRunError(
                        f"rank {rank} of this node's {self.size} training processes ended during the round "
                        f"(exit code {code}); its output above says why"
                    ) from None
                if status == "error":
                    self.close(kill=True)
                    raise answers[rank]
        return answers

    def close(self, kill: bool = False) -> None:
        """End the group: close the ranks' sockets and wait for them to exit (``kill``: kill them first)."""
        if _groups.get(self.size) is self:
            del _groups[self.size]
        for process, connection in self.members:
            connection.close()
            if kill:
                process.kill()
        for process, _ in self.members:
            try:
                process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


_groups: dict[int, LocalGroup] = {}


def local_group(size: int) -> LocalGroup:
    """This process's group of ``size`` processes, started on first use and kept for the run."""
    if size not in _groups:
        log.info("starting this node's %d training processes (kept for the run)", size)
        _groups[size] = LocalGroup(size)
    return _groups[size]


@atexit.register
def _close_groups() -> None:
    for group in list(_groups.values()):
        group.close()


def serve(connection: Connection) -> None:
    """A rank's loop: train each round its parent sends, answer, and exit when the parent is gone."""
    clients: dict[str, Any] = {}
    while True:
        try:
            client, cfg, node_config, arrays, config, state = connection.recv()
        except (EOFError, OSError):
            return
        try:
            key = json.dumps(
                [f"{client.__module__}.{client.__qualname__}", cfg.model_dump(mode="json"), node_config], sort_keys=True
            )
            if key not in clients:
                clients[key] = client(cfg, node_config)
            answer = ("ok", clients[key].train_here(arrays, config, state))
        except Exception as err:  # travels to the parent, which raises it as a one-process client would
            err.add_note(
                f"in rank {os.environ.get('RANK')} of the node's training processes:\n{traceback.format_exc()}"
            )
            answer = ("error", _transportable(err))
        connection.send(answer)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
