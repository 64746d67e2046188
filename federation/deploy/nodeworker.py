"""A long-lived process per deployed node that keeps its client program between messages.

A deployed SuperNode starts a fresh ClientApp process for every message. Building the client
program there each time (importing torch, DeepSpeed and timm, loading the teacher, indexing the
data) cost a deployed round 15-60 s where a simulated one, whose Ray actors live for the run, costs
1-3 s. So the ClientApp stays light and hands each message to the node's *worker*: a process that
the first message of a run starts, that builds the client program once and answers every later
message of that run, as a simulated node does.

The worker listens on a Unix socket in a folder only this user can open, and every connection
must present a random key that only this user can read (``multiprocessing.connection``'s
challenge). It serves one message at a time, and exits when its SuperNode is gone or after
:data:`IDLE_EXIT_S` without a message; a ClientApp that finds no worker (the first message, or
after an exit or a crash) starts one. An exception in the client program travels back to the
ClientApp, which raises it as if the program had run in its own process. Nothing here imports
Flower or torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from federation.runtime.contract import Scalar, client_program
from geofm.errors import FederatedRunError

STALE_S = 2 * 86_400.0
"""Files of workers that ended without cleaning up (killed) are removed after this long."""
IDLE_EXIT_S = 1800.0
"""A worker that got no message for this long exits; the next message starts a new one (and rebuilds)."""
START_TIMEOUT_S = 120.0
"""How long a ClientApp waits for a worker it started to listen (it only imports, it builds nothing yet)."""
WATCH_S = 2.0


def worker_folder() -> Path:
    """This user's folder of worker sockets and keys (mode 0700)."""
    folder = Path(tempfile.gettempdir()) / f"geofm-node-workers-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise FederatedRunError(f"{folder} must belong to this user and be closed to others (mode 0700)")
    return folder


class NodeWorker:
    """The ClientApp's side: the worker of one run on one node, started on first use.

    Args:
        run_id: the run, so that two runs never share a client program.
        run_config: the run config, as the registered program builds its client from it.
        node_config: the node's config, as the registered program builds its client from it.
        supernode_pid: the process whose end ends the worker (the SuperNode that started this ClientApp).
    """

    def __init__(
        self, run_id: int, run_config: Mapping[str, Scalar], node_config: Mapping[str, Scalar], supernode_pid: int
    ) -> None:
        self.run_config, self.node_config, self.supernode_pid = dict(run_config), dict(node_config), supernode_pid
        identity = json.dumps([run_id, self.run_config, self.node_config], sort_keys=True)
        name = hashlib.sha256(identity.encode()).hexdigest()[:20]
        folder = worker_folder()
        self.address, self.key_file = folder / f"{name}.sock", folder / f"{name}.key"
        self.log_file, self.lock_file = folder / f"{name}.log", folder / f"{name}.lock"

    def identity(self) -> Any:
        """The client program's :meth:`identity`, answered by the worker."""
        return self.call("identity")

    def train(self, arrays: Any, config: Any, state: Any) -> Any:
        """The client program's :meth:`train`, run by the worker."""
        return self.call("train", arrays, config, state)

    def call(self, method: str, *args: Any) -> Any:
        """Run ``method`` (``identity`` or ``train``) of the node's client program in its worker.

        Raises:
            Exception: what the client program raised, with the worker's traceback as a note.
            FederatedRunError: the worker could not be started or died while answering.
        """
        connection = self._connect()
        try:
            connection.send((method, args))
            status, value = connection.recv()
        except (EOFError, OSError) as err:
            raise FederatedRunError(f"the node's worker process ended while answering {method} ({err!r})") from err
        finally:
            connection.close()
        if status == "error":
            raise value
        return value

    def _connect(self) -> Connection:
        try:
            return self._open()
        except (FileNotFoundError, ConnectionRefusedError, EOFError):
            pass  # no worker yet, or one that has exited: start one
        with self.lock_file.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one start at a time, should two messages race
            try:
                return self._open()
            except (FileNotFoundError, ConnectionRefusedError, EOFError):
                self._start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return self._open()
            except (FileNotFoundError, ConnectionRefusedError, EOFError):
                if time.monotonic() > deadline:
                    raise FederatedRunError(
                        f"the node's worker did not listen on {self.address} within {START_TIMEOUT_S:g} s"
                    ) from None
                time.sleep(0.05)

    def _open(self) -> Connection:
        return Client(str(self.address), family="AF_UNIX", authkey=self.key_file.read_bytes())

    def _start(self) -> None:
        """Start a worker detached from this ClientApp process, which exits after this message."""
        _remove_stale(self.address.parent)
        if not self.key_file.exists():
            descriptor = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as f:
                f.write(secrets.token_bytes(32))
        self.address.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            __name__,
            "--address",
            str(self.address),
            "--key-file",
            str(self.key_file),
            "--watch-pid",
            str(self.supernode_pid),
            "--run-config",
            json.dumps(self.run_config),
            "--node-config",
            json.dumps(self.node_config),
        ]
        with self.log_file.open("ab") as log:  # the ClientApp's own output closes when it exits
            subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)


def serve(
    address: Path,
    key_file: Path,
    run_config: dict[str, Scalar],
    node_config: dict[str, Scalar],
    watch_pid: int,
    idle_exit_s: float = IDLE_EXIT_S,
) -> None:
    """The worker's loop: answer one message at a time until the SuperNode is gone, it idles out or
    it is sent SIGTERM; it removes its socket, key and lock file as it exits."""
    listener = Listener(str(address), family="AF_UNIX", authkey=key_file.read_bytes())
    last_message = [time.monotonic()]
    busy = threading.Lock()

    def leave(*_: object) -> None:
        for path in (address, key_file, address.with_suffix(".lock")):
            path.unlink(missing_ok=True)
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(WATCH_S)
            gone = not _alive(watch_pid)
            idle = not busy.locked() and time.monotonic() - last_message[0] > idle_exit_s
            if gone or idle:
                leave()

    signal.signal(signal.SIGTERM, leave)
    threading.Thread(target=watch, daemon=True).start()
    while True:
        try:
            connection = listener.accept()
        except OSError:
            continue  # a client that failed the key challenge or hung up
        with busy, connection:
            try:
                method, args = connection.recv()
            except (EOFError, OSError):
                continue  # the ClientApp went away before asking: nothing to answer
            try:
                program = client_program(run_config, node_config)
                answer = ("ok", getattr(program, method)(*args))
            except Exception as err:  # the program's own error (an OSError too) travels back to the ClientApp
                err.add_note(f"in the node's worker process:\n{traceback.format_exc()}")
                answer = ("error", _transportable(err))
            with contextlib.suppress(EOFError, OSError):  # the ClientApp went away (its round timed out)
                connection.send(answer)
            last_message[0] = time.monotonic()


def _transportable(err: Exception) -> Exception:
    """``err`` if it survives pickling, else a FederatedRunError that names it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return FederatedRunError(f"{type(err).__name__}: {err}")


def _remove_stale(folder: Path) -> None:
    """Remove what killed workers left behind (socket, key, lock, log) once it is :data:`STALE_S` old."""
    cutoff = time.time() - STALE_S
    for path in folder.iterdir():
        try:
            if path.lstat().st_mtime < cutoff:
                path.unlink()
        except OSError:
            continue  # removed meanwhile by another node's ClientApp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a deployed node's worker (started by its ClientApp)")
    parser.add_argument("--address", type=Path, required=True)
    parser.add_argument("--key-file", type=Path, required=True)
    parser.add_argument("--watch-pid", type=int, required=True)
    parser.add_argument("--run-config", required=True)
    parser.add_argument("--node-config", required=True)
    args = parser.parse_args(argv)
    serve(args.address, args.key_file, json.loads(args.run_config), json.loads(args.node_config), args.watch_pid)


if __name__ == "__main__":
    main()
