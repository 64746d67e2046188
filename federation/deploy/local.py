"""A whole deployment on this machine: a SuperLink and SuperNodes on 127.0.0.1 with TLS and SuperNode auth.

For tests, and for trying a federated program the way it will be deployed before going across
machines. Everything lives below one folder: certificates and keys, a Flower home per process
(``flwr`` CLI, SuperLink, each SuperNode), each process's log. Readiness is awaited by events (a port
accepting connections, a log line, the ``flwr`` CLI's answers), never by fixed sleeps; a safety
timeout only prevents a hang. :meth:`LocalDeployment.stop` (also on leaving the ``with`` block)
stops every process it started and every process those started, found by a marker in their
environment (Linux: read from ``/proc``), and waits until they are gone.

Example::

    with LocalDeployment(tmp / "fed", ["a", "b"], env={"PYTHONPATH": ...}) as deployment:
        run_id = deployment.launch({"program": "geofm", "config": config_entry(tree)})
        run = deployment.wait(run_id)          # the run's record from `flwr ls`
        assert run["status"] == "finished:completed", deployment.logs(run_id)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from federation.deploy.commands import (
    ACTIVATION_RETRY_S,
    APP_DIR,
    QUIET_ENV,
    flwr_json,
    register_command,
    run_command,
    status_command,
    superlink_command,
    supernode_command,
    write_run_config,
)
from federation.deploy.files import DEFAULT_CONNECTION, DeploymentFiles, write_deployment_files, write_node_keys
from federation.runtime.contract import DATA_ROOT, INSTITUTION, Scalar
from federation.runtime.processes import PROCESS_GROUP_ENV, marked_processes, start_time
from geofm.errors import FederatedRunError

MARKER = "GEOFM_LOCAL_DEPLOYMENT"
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


@dataclass
class Process:
    """A process this deployment started, its own process group, and its log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        """Everything it logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class LocalDeployment:
    """A SuperLink plus one authenticated SuperNode per institution, all on 127.0.0.1.

    Args:
        root: folder for everything (created).
        institutions: one registered SuperNode each, with ``--node-config institution=NAME data-root=...``.
        data_roots: institutions' data folders (default: ``root/data/NAME``).
        env: extra environment for every process (e.g. PYTHONPATH for the programs to import).
        safety_timeout_s: upper bound on any single wait; only guards against hanging forever.
        poll_s: the SuperNodes' ``geofm fed supernode --poll-s`` (default: Flower's own waits).
    """

    def __init__(
        self,
        root: Path,
        institutions: Sequence[str],
        *,
        data_roots: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        safety_timeout_s: float = 900.0,
        poll_s: float | None = None,
    ) -> None:
        self.poll_s = poll_s
        self.root = Path(root).resolve()
        self.institutions = list(institutions)
        self.data_roots = dict(data_roots or {})
        self.safety_timeout_s = safety_timeout_s
        self.files = DeploymentFiles(self.root / "certs")
        self.port = free_port()
        self.token = uuid.uuid4().hex
        self.processes: dict[str, Process] = {}
        self.node_ids: dict[str, int] = {}
        self.launched: list[Path] = []  # run-config files of the runs launched
        self._env = {
            **{key: value for key, value in os.environ.items() if key not in PROCESS_GROUP_ENV},
            **QUIET_ENV,
            **(env or {}),
            "HOME": str(self.root / "home"),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            MARKER: self.token,
        }

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        """Write certificates and keys, start the SuperLink, register and start every SuperNode."""
        try:
            (self.root / "home").mkdir(parents=True, exist_ok=True)
            write_deployment_files(self.files.root, self.institutions, HOST, port=self.port)
            self._start_superlink()
            for name in self.institutions:
                self.register(name)
                self.start_supernode(name)
            for name in self.institutions:
                self.wait_for_log(name, f"SuperNode ID: {self.node_ids[name]}")
        except BaseException:
            self.stop()
            raise

    def _home(self, name: str) -> Path:
        home = self.root / "homes" / name
        home.mkdir(parents=True, exist_ok=True)
        return home

    def _spawn(self, name: str, command: list[str]) -> Process:
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**self._env, "FLWR_HOME": str(self._home(name))}
        with log.open("ab") as out:
            popen = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        process = self.processes[name] = Process(name, popen, log)
        return process

    def _start_superlink(self) -> None:
        process = self._spawn("superlink", superlink_command(self.files, host=HOST, port=self.port))
        self._await(lambda: _accepts(self.port), f"the SuperLink to accept connections on {self.address}", process)

    def cli(self, command: list[str]) -> subprocess.CompletedProcess:
        """Run a ``flwr`` CLI command against this deployment's SuperLink."""
        env = {**self._env, "FLWR_HOME": str(self.files.flwr_home)}
        return subprocess.run(
            command,
            check=False,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=self.safety_timeout_s,
        )

    def _cli_json(self, command: list[str]) -> dict:
        return flwr_json(command, {**self._env, "FLWR_HOME": str(self.files.flwr_home)})

    def register(self, institution: str) -> int:
        """Register an institution's SuperNode public key with the SuperLink; returns its node id."""
        command = register_command(self.files.node_public_key(institution), institution)
        answer = self._cli_json([*command, "--format", "json"])
        self.node_ids[institution] = int(answer["node-id"])
        return self.node_ids[institution]

    def start_supernode(self, institution: str, retry_activation_s: float = ACTIVATION_RETRY_S) -> Process:
        """Start an institution's SuperNode on its own port and Flower home (writing its key pair if it has none),
        through ``geofm fed supernode`` as printed for institutions (``retry_activation_s=0``: plain flower-supernode)."""
        if not self.files.node_key(institution).exists():
            write_node_keys(self.files, institution)
        data_root = self.data_roots.get(institution, str(self.root / "data" / institution))
        node_config = {INSTITUTION: institution, DATA_ROOT: data_root}
        key = self.files.node_key(institution)
        command = supernode_command(
            self.files.ca_cert,
            key,
            self.address,
            free_port(),
            node_config,
            retry_activation_s=retry_activation_s,
            poll_s=self.poll_s,
        )
        return self._spawn(institution, command)

    def wait_for_log(self, name: str, text: str, count: int = 1) -> None:
        """Wait until a process has logged ``text`` (``count`` times: its log file spans restarts)."""
        process = self.processes[name]
        self._await(lambda: process.text().count(text) >= count, f"{name} to log {text!r} x{count}", process)

    def wait_for_file(self, path: Path, name: str) -> None:
        """Wait until ``path`` exists, failing at once if process ``name`` exits first."""
        self._await(path.exists, f"{path} to appear", self.processes[name])

    def kill(self, name: str) -> None:
        """SIGKILL a process and everything in its process group (a SuperNode and its ClientApp), as a crash would."""
        process = self.processes[name]
        _signal_group(process.popen, signal.SIGKILL)
        process.popen.wait()

    def wait_for_exit(self, name: str) -> int:
        """Wait until a process has exited; returns its exit code."""
        popen = self.processes[name].popen
        try:
            return popen.wait(timeout=self.safety_timeout_s)
        except subprocess.TimeoutExpired:
            raise FederatedRunError(f"{name} still runs after {self.safety_timeout_s:g} s") from None

    def _await(self, ready: Callable[[], bool], what: str, process: Process | None = None, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + self.safety_timeout_s
        while not ready():
            if process is not None and process.popen.poll() is not None:
                raise FederatedRunError(
                    f"{process.name} exited with code {process.popen.returncode} while waiting for {what}; "
                    f"its log ({process.log}) ends:\n{process.text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise FederatedRunError(f"gave up waiting for {what} after {self.safety_timeout_s:g} s")
            time.sleep(poll_s)

    def launch(self, run_config: Mapping[str, Scalar], app_dir: Path = APP_DIR) -> int:
        """Submit a run of the Flower App with these run-config entries; returns its run id."""
        config_file = write_run_config(self.root / f"run_config_{len(self.launched)}.toml", run_config)
        self.launched.append(config_file)
        return int(self._cli_json(run_command(config_file, DEFAULT_CONNECTION, app_dir))["run-id"])

    def status(self, run_id: int) -> dict:
        """The run's record from ``flwr ls`` (``status`` reads e.g. ``running`` or ``finished:completed``)."""
        return self._cli_json(status_command(run_id))["runs"][0]

    def wait(self, run_id: int, poll_s: float = 2.0) -> dict:
        """Wait until the run finished (completed, failed or stopped); returns its final record."""
        record: dict = {}

        def finished() -> bool:
            nonlocal record
            record = self.status(run_id)
            return record["status"].startswith("finished")

        self._await(finished, f"run {run_id} to finish", self.processes["superlink"], poll_s)
        return record

    def logs(self, run_id: int) -> str:
        """The run's ServerApp log as ``flwr log --show`` prints it."""
        result = self.cli(["flwr", "log", str(run_id), DEFAULT_CONNECTION, "--show"])
        return result.stdout + result.stderr

    def process_ids(self) -> set[int]:
        """Live processes started by this deployment, directly or by its processes (zombies excluded)."""
        return marked_processes(MARKER, self.token)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop every process: SIGTERM to each process group (SuperNodes first), SIGKILL after ``grace_s``,
        then SIGKILL to any descendant still carrying this deployment's marker. Returns once every
        process seen is gone, reaped included (a zombie's environment is unreadable, so processes are
        tracked by pid and start time from the first scan on)."""
        tracked = {pid: start_time(pid) for pid in self.process_ids()}
        for process in reversed(list(self.processes.values())):
            _signal_group(process.popen, signal.SIGTERM)
        for process in reversed(list(self.processes.values())):
            try:
                process.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(process.popen, signal.SIGKILL)
                process.popen.wait()
        deadline = time.monotonic() + self.safety_timeout_s
        while True:
            for pid in self.process_ids():
                tracked.setdefault(pid, start_time(pid))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            left = sorted(pid for pid, started in tracked.items() if started is not None and start_time(pid) == started)
            if not left:
                return
            if time.monotonic() > deadline:
                raise FederatedRunError(f"processes {left} of the local deployment are still there after SIGKILL")
            time.sleep(0.1)


def _signal_group(popen: subprocess.Popen, sig: signal.Signals) -> None:
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            return
