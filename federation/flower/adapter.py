"""Flower adapter: runs any federated program of :mod:`federation.runtime.contract` on Flower's Message API.

With :mod:`federation.flower.simulation`, the only module of the project that imports ``flwr``. It provides

- ``server_app`` and ``client_app``, the components the shipped Flower App names
  (``federation/flower/app/pyproject.toml``) for deployment with ``flwr run``: their run config
  comes from Flower (the App's defaults fused with ``flwr run --run-config`` overrides);
- :func:`build_server_app` / :func:`build_client_app` for apps bound to a run config given in Python,
  which :func:`federation.flower.simulation.simulate` runs on one machine with Flower's simulation engine (Ray).

Messages carry a payload as two records: ``arrays`` (an ArrayRecord of numpy arrays, dtypes kept
exactly: uint8 stays uint8) and ``scalars`` (a ConfigRecord). The server asks each new node for its
identity with a ``query`` message and sends work with ``train`` messages; the round loop itself is
:func:`federation.runtime.roundloop.run_server`. A client's per-node state lives in the ClientApp's
``context.state`` under :data:`STATE_KEY`; Flower keeps it between messages of a run, in the
simulation engine and on a SuperNode (which starts a fresh ClientApp process per message).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from federation.deploy.nodeworker import NodeWorker
from federation.runtime.contract import (
    INSTITUTION,
    PROGRAM,
    RUN_CONFIG_DEFAULTS,
    Arrays,
    ClientProgram,
    Failure,
    Payload,
    Reply,
    Scalar,
    client_program,
    make_server_program,
    node_identity,
)
from federation.runtime.roundloop import run_server
from geofm import PROJECT_LOGGERS
from geofm.errors import FederatedRunError, GeoFMError, RunInterrupted

if TYPE_CHECKING:  # the store imports torch, which a ClientApp process does without until it trains
    from federation.flower.simulation import SimulationStop
    from geofm.fl.communication.spill import UploadStore

ARRAYS = "arrays"
SCALARS = "scalars"
STATE_KEY = "geofm-client-state"
PULL_INTERVAL_S = 0.2
"""How often the server asks the SuperLink for replies while a round runs."""
_ERROR_NAMES = {code: name.lower().replace("_", " ") for name, code in vars(ErrorCode).items() if name.isupper()}

log = logging.getLogger("geofm.fl")


def to_array_record(arrays: Mapping[str, np.ndarray], what: str) -> ArrayRecord:
    """Numpy arrays -> ArrayRecord, keeping each array's dtype and shape."""
    if not isinstance(arrays, Mapping):
        raise FederatedRunError(f"{what}: expected a dict of numpy arrays, got {type(arrays).__name__}")
    record = ArrayRecord()
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise FederatedRunError(f"{what}[{key!r}]: expected a numpy array, got {type(value).__name__}")
        record[key] = Array(value)
    return record


def from_array_record(record: ArrayRecord) -> Arrays:
    """ArrayRecord -> dict of numpy arrays."""
    return {key: array.numpy() for key, array in record.items()}


def to_config_record(scalars: Mapping[str, Scalar], what: str) -> ConfigRecord:
    """A dict of scalars (numpy scalars allowed) -> ConfigRecord."""
    if not isinstance(scalars, Mapping):
        raise FederatedRunError(f"{what}: expected a dict of scalars, got {type(scalars).__name__}")
    plain = {key: value.item() if isinstance(value, np.generic) else value for key, value in scalars.items()}
    try:
        return ConfigRecord(plain)
    except TypeError as err:
        raise FederatedRunError(
            f"{what}: values must be bool, int, float, str, bytes or lists of those ({err})"
        ) from err


def _content(payload: Payload, what: str) -> RecordDict:
    arrays, scalars = payload
    return RecordDict(
        {ARRAYS: to_array_record(arrays, f"{what} arrays"), SCALARS: to_config_record(scalars, f"{what} scalars")}
    )


class GridTransport:
    """The runtime's :class:`~federation.runtime.contract.Transport` over a Flower Grid.

    With ``stop`` (a simulation's), its next look for nodes or replies after a stop signal raises
    :class:`~geofm.errors.RunInterrupted`.
    """

    def __init__(self, grid: Grid, stop: SimulationStop | None = None, uploads: UploadStore | None = None) -> None:
        self.grid = grid
        self.stop = stop
        self.uploads = uploads

    def node_ids(self) -> list[int]:
        """Nodes connected to the SuperLink now (the simulated nodes in simulation)."""
        if self.stop is not None:
            self.stop.check()
        return sorted(self.grid.get_node_ids())

    def exchange(
        self, kind: str, rnd: int, payloads: dict[int, Payload], timeout_s: float
    ) -> tuple[list[Reply], list[Failure]]:
        """Send ``query`` or ``train`` messages and collect replies; error replies and silence become Failures.

        A node that dies mid-round never replies: its message expires after ``timeout_s`` (or the
        SuperLink reports it unreachable sooner) and the round closes with the nodes that answered.
        """
        if not payloads:
            return [], []
        message_type = MessageType.TRAIN if kind == "train" else MessageType.QUERY
        messages = [
            Message(
                _content(payload, f"round {rnd} payload for node {node}"),
                dst_node_id=node,
                message_type=message_type,
                group_id=str(rnd),
                ttl=timeout_s,
            )
            for node, payload in payloads.items()
        ]
        replies: list[Reply] = []
        failures: list[Failure] = []
        answered: set[int] = set()
        for node, message in self._send_and_receive(messages, list(payloads), timeout_s):
            answered.add(node)
            if message.has_error():
                code = _ERROR_NAMES.get(message.error.code, str(message.error.code))
                failures.append(Failure(node, f"{message.error.reason} ({code})"))
            else:
                content = message.content
                arrays = from_array_record(content[ARRAYS])
                if self.uploads is not None and kind == "train":  # on disk as it arrives: the server holds none
                    arrays = self.uploads.keep(arrays)
                replies.append(Reply(node, arrays, dict(content[SCALARS])))
        silent = [node for node in payloads if node not in answered]
        failures += [
            Failure(node, f"no reply (waited at most {timeout_s:g} s: the node is gone or too slow)") for node in silent
        ]
        return replies, failures

    def _send_and_receive(
        self, messages: list[Message], nodes: list[int], timeout_s: float
    ) -> Iterator[tuple[int, Message]]:
        """Push the messages and pull replies every :data:`PULL_INTERVAL_S` until all came or ``timeout_s`` passed.

        ``Grid.send_and_receive`` pulls every 3 s, which cost every deployed round up to 3 s on top
        of its work. Each reply is matched to its node by the message it replies to: the SuperLink
        answers for a node it found gone with its own id as the sender.

        Raises:
            RunInterrupted: a simulation received a stop signal.
        """
        ids = list(self.grid.push_messages(messages))
        waiting = {message_id: node for message_id, node in zip(ids, nodes, strict=True) if message_id}
        deadline = time.monotonic() + timeout_s
        while waiting:
            if self.stop is not None:
                self.stop.check()
            for reply in self.grid.pull_messages(list(waiting)):
                node = waiting.pop(reply.metadata.reply_to_message_id, None)
                if node is not None:
                    yield node, reply
            if waiting and time.monotonic() >= deadline:
                return
            if waiting:
                time.sleep(PULL_INTERVAL_S)


def _run_config(context: Context, bound: Mapping[str, Scalar]) -> dict[str, Scalar]:
    return {**RUN_CONFIG_DEFAULTS, **context.run_config, **bound}


def _show_round_log() -> None:
    """Let the run's INFO lines reach stderr when nothing configured logging (a ``flwr-serverapp``
    process, whose output ``flwr log`` shows), as ``geofm fed simulate`` shows them; the root logger
    stays as it is, so Flower's own HTTP client logs do not flood the run's log."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


def _server_main(grid: Grid, context: Context, bound: Mapping[str, Scalar], stop: SimulationStop | None) -> None:
    _show_round_log()
    run_config = _run_config(context, bound)
    log.info("building the server of program %r", run_config[PROGRAM])
    program = make_server_program(run_config)
    try:
        run_server(program, GridTransport(grid, stop, getattr(program, "uploads", None)))
    except RunInterrupted as err:
        if stop is None:
            raise
        stop.interrupted = err  # the simulation raises it once Flower's engine ended (see SimulationStop)


def _client_reply(message: Message, context: Context, bound: Mapping[str, Scalar], node_worker: bool) -> Message:
    """Answer a query (identity) or train message with the node's client program.

    With ``node_worker`` (deployed nodes, where each message is a fresh process) the program runs
    in the node's long-lived worker (:mod:`federation.deploy.nodeworker`); otherwise (simulation,
    whose node processes live for the run) in this process, built once.

    An exception becomes an error reply whose reason names the institution and the exception; the
    node logs it too, in one line for bad input (a :class:`~geofm.errors.GeoFMError`, whose message
    names the file or field; the traceback at debug level) and with the traceback otherwise. The
    node's state is then left as it was.
    """
    run_config = _run_config(context, bound)
    name = context.node_config.get(INSTITUTION, f"node {context.node_id}")
    try:
        node_config = node_identity(context.node_config, run_config)
        name = node_config[INSTITUTION]
        if node_worker:
            program = NodeWorker(context.run_id, run_config, node_config, supernode_pid=os.getppid())
        else:
            program = client_program(run_config, node_config)
        if message.metadata.message_type == MessageType.QUERY:
            return Message(_content(({}, program.identity()), "identity"), reply_to=message)
        return _train(program, message, context)
    except Exception as err:
        reason = f"{name}: {type(err).__name__}: {err}"
        bad_input = isinstance(err, GeoFMError)
        with_traceback = not bad_input or log.isEnabledFor(logging.DEBUG)
        log.error(
            "%s of %s failed%s",
            message.metadata.message_type,
            name,
            f": {err}" if bad_input else "",
            exc_info=with_traceback,
        )
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)


def _train(program: ClientProgram, message: Message, context: Context) -> Message:
    state = from_array_record(context.state[STATE_KEY]) if STATE_KEY in context.state else {}
    result = program.train(from_array_record(message.content[ARRAYS]), dict(message.content[SCALARS]), state)
    if not (isinstance(result, tuple) and len(result) == 3):
        name = type(program).__name__
        raise FederatedRunError(f"{name}.train must return (arrays, metrics, state), got {type(result).__name__}")
    upload, metrics, new_state = result
    content = _content((upload, metrics), "upload")
    context.state[STATE_KEY] = to_array_record(new_state, "client state")
    return Message(content, reply_to=message)


def build_server_app(run_config: Mapping[str, Scalar] | None = None, stop: SimulationStop | None = None) -> ServerApp:
    """A ServerApp running the server program of ``run_config`` (entries given here win over Flower's run config).

    ``stop``: a simulation's stop signals, which end the server's run (see :class:`SimulationStop`).
    """
    bound = dict(run_config or {})
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        _server_main(grid, context, bound, stop)

    return app


def build_client_app(run_config: Mapping[str, Scalar] | None = None, *, node_worker: bool = False) -> ClientApp:
    """A ClientApp answering handshakes (query) and rounds (train) with the client program of ``run_config``.

    ``node_worker``: run the program in the node's long-lived worker process (for deployed
    SuperNodes, which start a ClientApp process per message), not in the ClientApp's process.
    """
    bound = dict(run_config or {})
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return _client_reply(message, context, bound, node_worker)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return _client_reply(message, context, bound, node_worker)

    return app


server_app = build_server_app()
client_app = build_client_app(node_worker=True)  # what `flwr run` deploys
client_app_without_worker = build_client_app()
"""Builds the client program in each message's own process, as deployed nodes did before the worker
(slower by the imports and the build; for comparison, ``geofm bench fed-deploy``, and debugging)."""


class _ShortWaits:
    """The ``time`` module as flower-supernode's message loop sees it: every wait at most ``longest_s``."""

    def __init__(self, longest_s: float) -> None:
        self.longest_s = longest_s

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.longest_s))


def run_supernode_in_process(arguments: list[str], poll_s: float) -> None:
    """``flower-supernode ARGUMENTS`` in this process, its waits for work and for replies at most ``poll_s``.

    flower-supernode 1.41 and 1.42 have no setting for them: its message loop sleeps 3 s after the SuperLink had
    no message for it and 0.5 s between looks for the ClientApp's reply, which a short round pays in full.
    """
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli import flower_supernode

    start_client_internal.time = _ShortWaits(poll_s)
    sys.argv = ["flower-supernode", *arguments]
    flower_supernode()


if __name__ == "__main__":  # geofm fed supernode's child: python -m federation.flower.adapter POLL_S ARGUMENTS
    run_supernode_in_process(sys.argv[2:], float(sys.argv[1]))
